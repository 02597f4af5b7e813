"""The bridge thread and everything that moves bytes: the round's collectives, the node reduce,
shared-memory gathers and slice kernels.
"""
