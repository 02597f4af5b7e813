"""The ``flodl-mpi`` command and its sub-commands (train, report, inspect, export).
"""
