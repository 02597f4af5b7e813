"""The node's small Allgather through shared memory (:mod:`flodl_mpi.transport.shm_gather`), ranks played by threads.

One process, W threads, each with its own :class:`ShmGather` over one shared
buffer (threads see the same memory as processes mapping one file; the
multi-process form runs in ``tests/transport/test_node_reduce.py`` under mpiexec).
"""

import random
import threading
import time

import numpy as np
import pytest

from flodl_mpi.transport.shm_gather import STORES_ORDERED, ShmGather

pytestmark = pytest.mark.skipif(not STORES_ORDERED, reason="the shared gather is used on x86-64 only")


def run_ranks(W: int, capacity: int, body) -> list:
    """``body(gather, rank)`` on W threads sharing one zeroed area; each thread's result or exception."""
    area = bytearray(ShmGather.nbytes(W, capacity))
    out: list = [None] * W

    def one(r):
        try:
            out[r] = body(ShmGather(area, W, r, capacity), r)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[r] = exc

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a rank hung in the shared gather"
    return out


def row_of(rank: int, e: int, k: int) -> np.ndarray:
    return np.arange(k, dtype=np.float64) * 0.5 + 1000.0 * rank + 1e6 * e + (np.nan if k > 3 and e % 7 == 0 else 0)


@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_every_rank_gets_every_row_through_many_skewed_exchanges(W):
    # Ranks arrive out of step (random sleeps before and after each exchange); the row
    # length changes from one exchange to the next (alike on every rank), so a row left
    # over from an earlier exchange, or one already written for the next, would show.
    E = 60

    def body(g, r):
        rng = random.Random(r)
        got = []
        for e in range(E):
            if rng.random() < 0.3:
                time.sleep(rng.random() * 2e-3)
            k = 1 + (e * 5) % 9
            got.append(g.allgather(row_of(r, e, k)))
            if rng.random() < 0.3:
                time.sleep(rng.random() * 2e-3)
        return got

    results = run_ranks(W, 16, body)
    for r, got in enumerate(results):
        assert not isinstance(got, BaseException), got
        for e, m in enumerate(got):
            k = 1 + (e * 5) % 9
            want = np.stack([row_of(q, e, k) for q in range(W)])
            np.testing.assert_array_equal(m, want)  # NaN in the same places too


def test_rows_of_different_lengths_raise_the_same_error_on_every_rank():
    results = run_ranks(3, 8, lambda g, r: g.allgather(np.zeros(4 if r == 1 else 3)))
    for exc in results:
        assert isinstance(exc, ValueError)
        assert "differ in length (rank 0: 3, rank 1: 4, rank 2: 3)" in str(exc)


def test_a_row_over_capacity_is_refused_before_anything_is_published():
    area = bytearray(ShmGather.nbytes(2, 4))
    g = ShmGather(area, 2, 0, 4)
    with pytest.raises(ValueError, match="a row of 5 values does not fit the shared gather's 4"):
        g.allgather(np.zeros(5))
    assert not any(area)  # nothing published: the peer would not see a half exchange


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match=r"rank 2 not in \[0, 2\)"):
        ShmGather(bytearray(ShmGather.nbytes(2, 4)), 2, 2, 4)
