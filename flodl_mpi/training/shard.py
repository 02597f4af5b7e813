"""A rank's batches of one epoch under the CLI's plan, for a loop of your own (issue 22 item 6).

Invariant: :func:`shard` is a pure function of its arguments: every rank computes the
same epoch plan without communication (the CLI's: :func:`~flodl_mpi.training.data.epoch_permutation`
cut by :func:`~flodl_mpi.training.data.batch_indices`, handed out in fixed windows by
:func:`~flodl_mpi.policy.cadence.plan_window`), so the ranks' shards of an epoch together
hold each of its samples exactly once (``uneven="join"``), and a rank reads the very
samples ``flodl-mpi train`` would have it read at the same seed, window and world size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from flodl_mpi.policy.cadence import fixed_quotas, plan_window
from flodl_mpi.training.data import batch_indices, epoch_permutation, num_batches

__all__ = ["UNEVEN", "Shard", "plan_batches", "shard"]

#: What :func:`shard` does when the plan gives the ranks unequal numbers of batches.
UNEVEN = ("join", "drop", "pad")


@dataclass(frozen=True)
class Shard(Sequence):
    """One rank's batches of one epoch: a sequence of int64 sample-index arrays, in training order.

    Iterate it (``for idx in shard: x, y = data[idx]``), or give it to
    ``torch.utils.data.DataLoader(dataset, batch_sampler=shard)``: each item is one
    batch's indices into the dataset.

    Attributes:
        indices: per batch, int64 ``(k,)`` indices, ``1 <= k <= batch_size + 1`` (the plan's last
            batch may hold a folded lone sample, :func:`~flodl_mpi.training.data.num_batches`).
        batches: the global batch number (0-based, in the epoch's plan) of each item.
        padded: how many of the last items repeat a global batch (``uneven="pad"``), else 0.
        dropped: global batches of this rank's plan left out (``uneven="drop"``), else 0.
    """

    indices: tuple[np.ndarray, ...]
    batches: tuple[int, ...]
    padded: int = 0
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        return self.indices[i]

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.indices)

    @property
    def samples(self) -> int:
        """Samples in all of this rank's batches."""
        return int(sum(len(i) for i in self.indices))


def _check(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def plan_batches(n_batches: int, world_size: int, window: int = 1) -> list[list[int]]:
    """Per rank, the global batches it trains in an epoch of ``n_batches``: the CLI's fixed-window plan.

    Windows of ``window`` batches per rank, rank r's at an offset of ``r * window``
    in each; the epoch's last window, when fewer batches are left than ``world_size *
    window``, is split as :func:`~flodl_mpi.policy.cadence.fit_quotas` splits it
    (largest remainder; with fewer batches than ranks, one each to the lowest ranks).
    So counts differ by at most ``window`` (and at most 1 for ``window == 1``).

    Returns:
        ``world_size`` lists of ints; together each of ``0 .. n_batches - 1`` exactly once.

    Raises:
        TypeError: not an int. ValueError: ``n_batches < 0``, ``world_size < 1`` or ``window < 1``.
    """
    n_batches = _check(n_batches, "n_batches", 0)
    quotas = fixed_quotas(_check(world_size, "world_size", 1), _check(window, "window", 1))
    mine: list[list[int]] = [[] for _ in quotas]
    cursor = 0
    while cursor < n_batches:
        planned = plan_window(quotas, cursor, n_batches)
        for r, (start, count) in enumerate(zip(planned.starts, planned.counts)):
            mine[r].extend(range(start, start + count))
        cursor = planned.end
    return mine


def shard(
    n_samples: int,
    epoch: int,
    seed: int = 0,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    window: int = 1,
    drop_last: bool = False,
    uneven: str = "join",
) -> Shard:
    """This rank's batches of epoch ``epoch`` of a data set of ``n_samples``, as ``flodl-mpi train`` plans them.

    The epoch's order is ``np.random.default_rng([seed, epoch]).permutation(n_samples)``, cut
    into global batches of ``batch_size`` (a lone left-over sample folded into the last
    batch; ``drop_last`` drops the left-over samples, as the CLI's ``--drop-last``), handed
    out as ``plan_batches`` does. With the CLI's ``--seed``, ``--batch-size``,
    ``--window`` (1 for ``sync``) and world size, a rank gets the samples the CLI would
    train on it. Call it with your epoch counted from 0.

    Args:
        n_samples: samples in the training set, >= 0.
        epoch: the epoch, >= 0 (counted from 0: ``Averager.start_epoch`` is the first to run).
        seed: the data order's seed, >= 0 (the CLI's ``--seed``, default 0).
        batch_size: samples per global batch, >= 1.
        rank, world_size: this rank (``avg.rank``) of ``world_size`` (``avg.world_size``).
        window: batches per rank between rounds, >= 1: the averager's ``window`` (1 for ``sync``),
            so the ranks' batches of a round are neighbours in the plan, as the CLI's.
        drop_last: as the CLI's ``--drop-last``.
        uneven: what to do when the plan gives the ranks unequal numbers of batches (the
            epoch's last window, when its batches do not divide evenly): ``"join"``
            (default) keeps the plan, every sample once: run the loop in
            ``with avg.join():`` (:meth:`flodl_mpi.Averager.join`); ``"drop"`` gives every
            rank the smallest count, the extra batches of the last window not trained this
            epoch (``Shard.dropped``; which samples they hold changes with the epoch);
            ``"pad"`` gives every rank the largest count, a rank short of it repeating
            global batches from the epoch's start (``Shard.padded``; those samples are
            trained twice this epoch), as ``DistributedSampler`` pads.

    Returns:
        :class:`Shard`.

    Raises:
        TypeError: an argument of the wrong kind. ValueError: out of range (``rank`` not in
            ``[0, world_size)``, ``uneven`` not one of `UNEVEN`).
    """
    n_samples = _check(n_samples, "n_samples", 0)
    batch_size = _check(batch_size, "batch_size", 1)
    world_size = _check(world_size, "world_size", 1)
    rank = _check(rank, "rank", 0)
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if not isinstance(drop_last, bool):
        raise TypeError(f"drop_last must be True or False, got {type(drop_last).__name__} {drop_last!r}")
    if uneven not in UNEVEN:
        raise ValueError(f"uneven must be one of {', '.join(UNEVEN)}, got {uneven!r}")
    n_batches = num_batches(n_samples, batch_size, drop_last)
    plan = plan_batches(n_batches, world_size, window)
    mine, padded, dropped = list(plan[rank]), 0, 0
    counts = [len(p) for p in plan]
    if uneven == "drop":
        dropped = len(mine) - min(counts)
        mine = mine[: min(counts)]
    elif uneven == "pad" and n_batches:
        # the k-th padded batch of the cohort (ranks in order) repeats global batch k mod n_batches
        before = sum(max(counts) - c for c in counts[:rank])
        padded = max(counts) - len(mine)
        mine += [(before + k) % n_batches for k in range(padded)]
    perm = epoch_permutation(n_samples, _check(seed, "seed", 0), _check(epoch, "epoch", 0))
    indices = tuple(batch_indices(perm, batch_size, b, drop_last) for b in mine)
    return Shard(indices=indices, batches=tuple(mine), padded=padded, dropped=dropped)
