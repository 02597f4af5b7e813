"""What a resuming rank takes back from a checkpoint's contents: the one per-rank restore.

Invariant: the CLI's and ``fit``'s `flodl_mpi.training.worker.Trainer` and the own loop's
``Averager`` restore a rank from a `flodl_mpi.outputs.checkpoint_contents.CheckpointContents`
here and only here: its own state (`restore_rank`: optimizer, step count, integer buffers,
RNG), the cohort's counters its bridge keeps (`restore_bridge`: round, policy or guard,
outer optimizer, clock) and a delta ``--wire``'s state (`restore_wire`: the reference, the
rank's error feedback). The consensus parameters are loaded before, on every rank alike
(`flodl_mpi.training.train.resume_point`). What a front end does with the epoch it resumes
in (a cut-short epoch's reports, its loop's place) stays the front end's.

Another world size (W_old -> W): new rank r takes the state of old rank ``r mod W_old`` (so
rank r < W_old keeps its own); its RNG is not restored (old streams cannot be split or merged),
and a delta wire's error feedback starts at zero (the residuals of W_old ranks do not map onto
W ranks; the reference, the same on every rank, is restored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flodl_mpi.outputs.checkpoint_contents import CheckpointContents
from flodl_mpi.training import rank_state

__all__ = ["RestoredRank", "restore_rank", "restore_bridge", "restore_wire"]


@dataclass(frozen=True)
class RestoredRank:
    """What `restore_rank` took back.

    Attributes:
        source: the old rank whose state this rank took (``rank mod W_old``).
        same_world: the world size is the checkpoint's (the RNG was restored).
        global_step: the rank's optimizer steps in the run, as saved.
        attrs: the source rank's saved attributes (JSON values).
    """

    source: int
    same_world: bool
    global_step: int
    attrs: dict[str, Any]


def restore_rank(contents: CheckpointContents, rank: int, world_size: int, optimizer: torch.optim.Optimizer | None,
                 model: torch.nn.Module) -> RestoredRank:
    """Restore this rank's own state from ``contents`` (SPEC §6).

    The optimizer state (when ``optimizer`` is given and the state holds one: an own loop
    may have run without), the step count, the integer buffers (BatchNorm's
    ``num_batches_tracked`` counts this rank's batches) and, on the same world size, the
    torch CPU RNG.

    Args:
        contents: the checkpoint; its ``ranks`` must hold (or its file give) the source rank's state.
        rank, world_size: this rank in this run.
        optimizer: the rank's optimizer, or None.
        model: the model whose integer buffers take the saved ones.

    Raises:
        ValueError: the checkpoint holds no state for the source rank, or state of another
            optimizer class or parameter layout, or integer buffers that do not fit ``model``.
    """
    old_size = contents.world_size
    source = rank % old_size
    if source not in contents.ranks:
        raise ValueError(f"checkpoint {contents.path}: no state read for rank {source}")
    arrays, attrs = contents.ranks[source]
    same = old_size == world_size
    if optimizer is not None and "optimizer_class" in attrs:
        step = rank_state.restore(optimizer, arrays, attrs, rng=same)
    else:
        if same and "rng/torch" in arrays:
            torch.set_rng_state(torch.from_numpy(np.array(arrays["rng/torch"], dtype=np.uint8)))
        step = int(attrs.get("global_step", 0))
    rank_state.restore_integer_buffers(model, arrays)
    return RestoredRank(source=source, same_world=same, global_step=step, attrs=dict(attrs))


def restore_bridge(contents: CheckpointContents, bridge) -> None:
    """Put the cohort's counters back into ``bridge`` (`flodl_mpi.transport.bridge.Bridge`), the same on every rank.

    The round count (``bridge.version``), the policy's state when the checkpoint holds this
    policy's (else the divergence guard's: `CheckpointContents.policy_state`), the outer
    optimizer's state (``/cohort``, when the bridge steps one) and the run's clock.

    Raises:
        CheckpointError: the outer optimizer's state does not read back.
    """
    bridge.version = contents.round
    kind, state = contents.policy_state(bridge.policy.name)
    if kind == "policy":
        bridge.policy.load_state_dict(state)  # the balancer and the guard
    else:
        bridge.guard.load_state_dict(state)
    outer = getattr(bridge, "outer", None)
    if outer is not None and outer.kind != "avg":
        outer.load_state_dict(*contents.cohort_state())
    bridge.resume_clock(contents.elapsed_s)


def restore_wire(contents: CheckpointContents, bridge, rank: int, world_size: int) -> str:
    """Put a delta ``--wire``'s state back into ``bridge`` (`flodl_mpi.transport.bridge.Bridge.load_wire_state`).

    The same world size: the reference (``/cohort``, the same on every rank) and this rank's error
    feedback (``wire/error/<plane>`` in its ``/ranks/<r>``), so the run goes on bit for bit as if never
    stopped. Another world size: the reference, error feedback zero (the old ranks' residuals do not
    map one to one onto the new ranks; what they held, at most one quantisation step per value and
    rank, is not sent). A checkpoint without the state (written by an older flodl-mpi or another
    ``--wire``): nothing is restored and the first round is the exact float64 Allreduce, as a fresh
    run's. Every rank decides alike (from the one file and the world sizes).

    Args:
        contents: the checkpoint; ``contents.ranks`` holds the state of old rank ``rank mod W_old``.
        bridge: the run's bridge.
        rank, world_size: this rank in this run.

    Returns:
        One line for train.log saying what came back; "" on the other wires.

    Raises:
        CheckpointError: the cohort state does not read back.
        ValueError: the state is for another quantisation or size.
    """
    if bridge.wire_kind is None:
        return ""
    arrays, _ = contents.ranks[rank % contents.world_size]
    wire = f"--wire {bridge.wire_kind}-delta"
    if not any(key.startswith("wire/error/") for key in arrays):
        bridge.load_wire_state(None, None, None)
        return (f"{wire}: the checkpoint holds no delta-wire state (an older flodl-mpi's or another --wire): the "
                "first round after the resume is the exact float64 Allreduce, so the run is not bit-identical "
                "to an uninterrupted one")
    cohort, attrs = contents.cohort_state()
    same = contents.world_size == world_size
    bridge.load_wire_state(cohort, attrs, arrays if same else None)
    if same:
        return f"{wire}: the reference and each rank's error feedback restored from the checkpoint"
    return (f"{wire}: world size {contents.world_size} -> {world_size}: the reference restored, each rank's error "
            "feedback started at zero (the old ranks' residuals do not map onto the new ranks)")
