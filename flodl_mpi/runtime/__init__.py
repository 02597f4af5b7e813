"""The process around a run: MPI start-up, the world and its one abort decision, the launcher,
signals, stale shared memory.
"""
