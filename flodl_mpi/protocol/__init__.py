"""The round's pure math: no MPI, no threads, no clocks (mass, wire layout, divergence, control row,
outer step, optimizer-state math, epoch aggregation, round profiles).
"""
