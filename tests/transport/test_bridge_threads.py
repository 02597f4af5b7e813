"""The bridge thread runs torch on the rank's thread budget (issue 9)."""

import threading
from unittest import mock

import numpy as np
import pytest
import torch
from mpi4py import MPI

from flodl_mpi.transport.bridge import Bridge

pytestmark = pytest.mark.mpi


def test_bridge_thread_sets_the_callers_torch_thread_count():
    # A new thread starts at BLAS/OpenMP's default (every core), whatever
    # torch.set_num_threads said on the main thread: the bridge thread must set
    # the count itself before its first torch op.
    calls = []
    real = torch.set_num_threads

    def spy(n):
        calls.append((threading.current_thread().name, n))
        real(n)

    before = torch.get_num_threads()
    with mock.patch.object(torch, "set_num_threads", spy):
        bridge = Bridge(MPI.COMM_WORLD.Dup(), [(3,)])
        bridge.param_tensors[0][:] = torch.from_numpy(np.arange(3, dtype=np.float32))
        bridge.start()
        try:
            assert bridge.round(steps=1, window=1).adopted
        finally:
            bridge.close()
    assert ("flodl-bridge", before) in calls
