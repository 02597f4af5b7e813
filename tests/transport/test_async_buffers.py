"""Async adopts floating buffers (BatchNorm's running statistics) by the params' rule, never frozen.

Before: the buffers were overwritten with the consensus of the snapshot a window old, so
each window's own updates were thrown away and the next snapshot held the previous
consensus again: the statistics stayed at the first round's for the whole run.
"""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from flodl_mpi.training.replica import Replica


class Counter(nn.Module):
    """One parameter (never moves here) and one floating buffer a "step" adds 1 to."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.register_buffer("count", torch.zeros(1))


def _async_run(adoption: str, steps: tuple[int, ...], windows: int) -> list[float]:
    """Two replicas under the async schedule: train a window, adopt the round in flight, snapshot, submit.

    The stand-in round averages the buffers' snapshots equally (every rank moved: SPEC §2
    step 6's mover mass); the last round is waited for and adopted whole (nothing trained
    since its snapshot), as the epoch's end does.
    """
    replicas = [Replica(Counter(), torch.device("cpu")) for _ in steps]
    stagings = []
    for rep in replicas:
        rep.keep_snapshot = True
        stagings.append(SimpleNamespace(param_tensors=[torch.zeros_like(p) for p in rep.params],
                                        buffer_tensors=[torch.zeros_like(b) for b in rep.float_buffers]))
    in_flight = False

    def land() -> None:  # the round's consensus lands in every rank's staging
        mean = sum(s.buffer_tensors[0] for s in stagings) / len(stagings)
        for s in stagings:
            s.buffer_tensors[0].copy_(mean)

    for _ in range(windows):
        for rep, n in zip(replicas, steps):
            rep.float_buffers[0].add_(float(n))
        if in_flight:
            land()
            for rep, s in zip(replicas, stagings):
                rep.adopt(s, alpha=0.5 if adoption == "easgd" else 1.0, delta=True)
        for rep, s in zip(replicas, stagings):
            rep.snapshot(s)
        in_flight = True
    land()
    for rep, s in zip(replicas, stagings):
        rep.adopt(s)
    return [float(rep.float_buffers[0]) for rep in replicas]


def test_delta_buffers_end_at_the_mean_of_the_ranks_own_updates():
    # Rank 0 adds 1 a window, rank 1 adds 3. Delta keeps the ranks' mean at each adoption
    # (mean(consensus + own - snapshot) = mean(own)), so after 6 windows and the last
    # round both hold (6 * 1 + 6 * 3) / 2 = 12. The old overwrite froze them at the
    # first round's consensus, (1 + 3) / 2 = 2.
    assert _async_run("delta", (1, 3), 6) == [12.0, 12.0]


def test_easgd_buffers_are_pulled_at_the_snapshot_like_the_params():
    # alpha 0.5, by hand (b: live, s: snapshot, c = mean(s)); the pull b += 0.5 (c - s):
    # w1: b = (1, 3), s = (1, 3), c = 2
    # w2: b = (2, 6) -> (2 + 0.5, 6 - 0.5) = (2.5, 5.5); s = (2.5, 5.5), c = 4
    # w3: b = (3.5, 8.5) -> (3.5 + 0.75, 8.5 - 0.75) = (4.25, 7.75); s = those, c = 6;
    # last round: both 6, the mean of the ranks' own updates (3 * 1 + 3 * 3) / 2, as delta.
    # (Blending the live values, b += 0.5 (c - b), ended at 4: half of each window lost.)
    assert _async_run("easgd", (1, 3), 3) == [6.0, 6.0]
    assert _async_run("delta", (1, 3), 3) == [6.0, 6.0]


def test_an_async_run_saves_running_statistics_that_follow_training(tmp_path_factory):
    """Built-in MLP (BatchNorm) on digits, 2 ranks, async, 3 epochs: each checkpoint's
    running mean and variance differ from the previous one's (the trial saw them equal in
    every checkpoint of 30 epochs), and are finite with a positive variance. The run is the
    session's `tests._runs.RUN_ASYNC` (was this test's own, the same command with ``-q``)."""
    from flodl_mpi.outputs.checkpoint import read_checkpoint
    from tests._runs import RUN_ASYNC, session_run_async

    assert RUN_ASYNC[1:] == ("--policy", "async", "--epochs", "3")
    run_dir = session_run_async(tmp_path_factory)
    paths = sorted((run_dir / "checkpoints").glob("*.h5"))
    assert len(paths) >= 2, paths
    stats = []
    for path in paths:
        bufs = read_checkpoint(path).buffers
        names = sorted(k for k in bufs if k.endswith(("running_mean", "running_var")))
        assert names, list(bufs)
        stats.append({k: np.asarray(bufs[k]) for k in names})
    for s in stats:
        assert all(np.all(np.isfinite(v)) for v in s.values())
        assert all(np.all(v > 0) for k, v in s.items() if k.endswith("running_var"))
    for before, after in itertools.pairwise(stats):
        for k in before:
            assert not np.array_equal(before[k], after[k]), k


def _adopted_bn(momentum, batches: int, consensus_mean: float, consensus_var: float,
                alpha: float = 1.0) -> tuple[nn.BatchNorm1d, list, list, dict]:
    """A BatchNorm replica: snapshot, ``batches`` training batches, then the delta adoption (pull ``alpha``)
    of a consensus; also returns the statistics at the snapshot."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3, momentum=momentum)
    warm = [torch.randn(8, 3) * 2 + 1 for _ in range(3)]
    later = [torch.randn(8, 3) * 0.5 - 2 for _ in range(batches)]
    bn.train()
    for x in warm:
        bn(x)
    rep = Replica(bn, torch.device("cpu"))
    rep.keep_snapshot = True
    staging = SimpleNamespace(param_tensors=[torch.zeros_like(p) for p in rep.params],
                              buffer_tensors=[torch.zeros_like(b) for b in rep.float_buffers])
    rep.snapshot(staging)
    at_snapshot = {k: getattr(bn, k).clone() for k in ("running_mean", "running_var")}
    for x in later:
        bn(x)
    names = rep.buffer_names
    staging.buffer_tensors[names.index("running_mean")].fill_(consensus_mean)
    staging.buffer_tensors[names.index("running_var")].fill_(consensus_var)
    for dst, src in zip(staging.param_tensors, rep.params):  # params: the rank's own (not under test)
        dst.copy_(src.detach())
    rep.adopt(staging, alpha=alpha, delta=True)
    return bn, later, warm, at_snapshot


@pytest.mark.parametrize("momentum", [0.1, 0.5, None])
@pytest.mark.parametrize("batches", [0, 1, 4])
@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_delta_running_statistics_are_as_if_the_consensus_was_taken_at_the_snapshot(momentum, batches, alpha):
    """The reference: a fresh BatchNorm that holds the pulled value at the snapshot,
    ``snapshot + alpha (consensus - snapshot)`` (the consensus at alpha 1; EASGD's pull
    below), and trains on the same batches (torch's own update, float64 compare)."""
    bn, later, warm, snap = _adopted_bn(momentum, batches, consensus_mean=0.25, consensus_var=1.5, alpha=alpha)
    ref = nn.BatchNorm1d(3, momentum=momentum)
    ref.train()
    ref.running_mean.copy_(snap["running_mean"] + alpha * (0.25 - snap["running_mean"]))
    ref.running_var.copy_(snap["running_var"] + alpha * (1.5 - snap["running_var"]))
    ref.num_batches_tracked.fill_(len(warm))
    for x in later:
        ref(x)
    for stat in ("running_mean", "running_var"):
        np.testing.assert_allclose(getattr(bn, stat).double().numpy(), getattr(ref, stat).double().numpy(),
                                   rtol=1e-5, atol=1e-6)
    if batches == 0 and alpha == 1.0:  # nothing trained since the snapshot: the consensus, bit for bit
        assert torch.equal(bn.running_mean, torch.full((3,), 0.25))


def test_a_running_variance_stays_positive_where_the_plain_delta_goes_negative():
    # The snapshot's variance (about 4, from the warm batches of std 2) far above the
    # consensus (0.1): the plain delta, consensus + (live - snapshot), would be about
    # 0.1 + (0.9^4 * 4 + small) - 4 < 0; the decayed delta is 0.9^4 * 0.1 + small > 0.
    bn, _, _, _ = _adopted_bn(0.1, 4, consensus_mean=0.0, consensus_var=0.1)
    assert bool((bn.running_var > 0).all()), bn.running_var
