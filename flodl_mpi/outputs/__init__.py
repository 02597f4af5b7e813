"""What a run leaves on disk: checkpoints, metrics.h5 and its writer thread, rank 0's recorder,
the run dir's lock and its stale files, and reading a run back.
"""
