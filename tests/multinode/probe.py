"""One line per rank: its world rank, host name, node id (its node's first world rank) and node size, and
whether a cross-host Allreduce of ones summed to the world size (and an 8 MB one ran) (run by tests/multinode/test_multinode.py)."""

import socket

import numpy as np

from mpi4py import MPI

world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
node_id = node.bcast(world.rank, root=0)
total = world.allreduce(1, op=MPI.SUM)
# 8 MB across the hosts: the test reads each host's link counter, so bytes that took another way would show
big = np.ones(1 << 20)
world.Allreduce(MPI.IN_PLACE, big, op=MPI.SUM)
assert big[0] == world.size
print(
    f"probe rank={world.rank} size={world.size} host={socket.gethostname()} node={node_id} "
    f"node_size={node.size} local_rank={node.rank} sum={total}",
    flush=True,
)
node.Free()
