"""The epoch's untrained batches re-split after ranks leave: every batch and sample trained once (SPEC §9)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from flodl_mpi.policy.cadence import Window
from flodl_mpi.training.data import batch_indices, epoch_permutation, num_batches
from flodl_mpi.training.resplit import BatchQueue, lost_positions


def test_hand_worked_shrink_mid_epoch():
    """10 batches, 3 ranks, quotas (2, 1, 1): rank 1 dies in the second window; the survivors kept theirs."""
    q = BatchQueue.whole(10)
    w1, ids = q.window([2, 1, 1], 0)
    assert [i.tolist() for i in ids] == [[0, 1], [2], [3]]
    w2, ids = q.window([2, 1, 1], w1.end)
    assert [i.tolist() for i in ids] == [[4, 5], [6], [7]]
    lost = lost_positions([w2], [1])
    assert lost == [6]
    after = q.after_change(w2.end, lost)
    assert after.batches.tolist() == [6, 8, 9]  # the dead rank's batch first, then those never handed out
    w3, ids = after.window([2, 1], 0)
    assert [i.tolist() for i in ids] == [[6, 8], [9]]
    assert w3.end == len(after)


def test_survivors_going_back_lose_their_window_too():
    q = BatchQueue.whole(8)
    w, _ = q.window([1, 2], 2)  # positions 2 (rank 0) and 3-4 (rank 1)
    assert lost_positions([w], [0, 1]) == [2, 3, 4]
    assert q.after_change(w.end, lost_positions([w], [0, 1])).batches.tolist() == [2, 3, 4, 5, 6, 7]


def _simulate(rng: random.Random, n_batches: int, world: int, async_: bool) -> list[int]:
    """One epoch with random quotas and random deaths; returns the batches each consensus holds, in order."""
    queue, cursor, kept = BatchQueue.whole(n_batches), 0, []
    recent: list[tuple[Window, tuple]] = []  # the windows since the last consensus all ranks hold
    while cursor < len(queue):
        quotas = [rng.randint(1, 4) for _ in range(world)]
        window, ids = queue.window(quotas, cursor)
        cursor = window.end
        recent.append((window, ids))
        die = world > 1 and rng.random() < 0.3
        if not die:
            # A round completes: blocking, this window's; async, the one in flight (a window older) on wait.
            if not async_ or len(recent) == 2:
                kept.extend(b for r in range(world) for b in recent[0][1][r].tolist())
                recent = recent[1:]
            continue
        failed = rng.sample(range(world), rng.randint(1, world - 1))
        revert = rng.random() < 0.5  # the survivors go back to the last consensus, or keep their steps
        lost_ranks = range(world) if revert else failed
        lost = lost_positions([w for w, _ in recent], lost_ranks)
        for _, i in recent:  # the survivors' steps that are kept are held by the new world's next consensus
            kept.extend(b for r in range(world) if r not in lost_ranks for b in i[r].tolist())
        queue, cursor, recent = queue.after_change(cursor, lost), 0, []
        world -= len(failed)
    for _, i in recent:  # the epoch's last round (async: waited for at the epoch's end)
        kept.extend(b for r in range(world) for b in i[r].tolist())
    return kept


@pytest.mark.parametrize("async_", [False, True])
def test_random_deaths_train_every_batch_exactly_once(async_):
    """400 seeded epochs (1-40 batches, 1-5 ranks, deaths in 30 % of windows): each batch held once."""
    rng = random.Random(21)
    for _ in range(400):
        n, world = rng.randint(1, 40), rng.randint(1, 5)
        kept = _simulate(rng, n, world, async_)
        assert sorted(kept) == list(range(n)), (n, world, kept)


def test_every_sample_once_with_the_cli_batch_plan():
    """With the CLI's plan (1437 digits, batches of 32 and 4: a folded lone sample), the kept batches' samples
    are every sample once."""
    rng = random.Random(5)
    for batch_size in (32, 4):
        perm = epoch_permutation(1437, 0, 3)
        n = num_batches(1437, batch_size)
        kept = _simulate(rng, n, 4, False)
        samples = np.concatenate([batch_indices(perm, batch_size, b) for b in kept])
        assert np.array_equal(np.sort(samples), np.arange(1437))


def test_bad_input_is_refused():
    q = BatchQueue.whole(5)
    with pytest.raises(ValueError, match=r"must be handed out already \(0 <= position < cursor 2\), got \[3\]"):
        q.after_change(2, [3])
    with pytest.raises(ValueError, match=r"lost positions named twice: \[1\]"):
        q.after_change(2, [1, 1])
    with pytest.raises(ValueError, match="distinct"):
        BatchQueue(np.array([1, 1]))
    with pytest.raises(ValueError, match=r"ranks \[2\] are not in the window's world of 2 ranks"):
        lost_positions([Window((0, 1), (1, 1))], [2])


def test_the_queue_round_trips_through_a_checkpoint():
    q = BatchQueue.whole(10)
    assert q.is_whole
    after = q.after_change(4, [1, 3])
    assert not after.is_whole and after.batches.tolist() == [1, 3, 4, 5, 6, 7, 8, 9]
    back = BatchQueue.from_state_dict(after.state_dict(), 10)
    assert back.batches.tolist() == after.batches.tolist()
    with pytest.raises(ValueError, match="holds batch 9, this run's epoch has 8 batches"):
        BatchQueue.from_state_dict(after.state_dict(), 8)
