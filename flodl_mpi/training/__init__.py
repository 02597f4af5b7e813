"""A rank's run: setup, the replica's training loop, tasks, data, built-in models, scalars,
progress and what a resume continues from.
"""
