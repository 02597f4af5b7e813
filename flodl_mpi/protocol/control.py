"""The control row: the named float64 columns every rank sends in a round's control gather (SPEC §2 step 2).

Invariant: a column is read and written by its name only, through one :class:`Columns`
layout, so the bridge, the policy and the recorder agree on what each slot holds without
sharing indices; every rank builds the same layouts, so the gathered ``(W, k)`` matrix
means the same on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

__all__ = ["ACK", "NON_FINITE_LOSS", "NON_FINITE_TENSORS", "ROUND", "ROUND_HEAD", "Columns"]


class Columns:
    """A fixed, named layout of one float64 row.

    Args:
        names: the column names, in row order; unique.

    Raises:
        ValueError: a repeated name.

    Example::

        ROW = Columns("steps", "window")
        row = ROW.row(steps=3, window=4)          # float64 (2,)
        cols = ROW.read(comm_gathered_matrix)     # name -> float64 (W,) view
    """

    def __init__(self, *names: str) -> None:
        if len(set(names)) != len(names):
            raise ValueError(f"column names must be unique, got {names!r}")
        self.names = tuple(names)
        self._index = {n: i for i, n in enumerate(self.names)}

    def __len__(self) -> int:
        return len(self.names)

    def __add__(self, other: Columns) -> Columns:
        return Columns(*self.names, *other.names)

    def index(self, name: str) -> int:
        """The slot of ``name`` (KeyError for an unknown one)."""
        return self._index[name]

    def row(self, values: Mapping[str, float] | None = None, **kw: float) -> np.ndarray:
        """A float64 row ``(len(self),)``; a column not given is NaN ("no value").

        Raises:
            KeyError: an unknown column name.
        """
        # A list, then one array: a few rows a round, so the per-call cost is the point (np.full
        # and item assignment cost more than the values; issue 26 item 10, a world of one).
        out, index = [math.nan] * len(self.names), self._index
        for given in (values or {}, kw):  # kw last: it wins, as in {**values, **kw}
            for name, v in given.items():
                out[index[name]] = v
        return np.array(out, dtype=np.float64)

    def read(self, matrix: np.ndarray, offset: int = 0) -> dict[str, np.ndarray]:
        """Columns of a gathered float64 ``(W, >= offset + len(self))`` matrix by name (views)."""
        return {n: matrix[:, offset + i] for i, n in enumerate(self.names)}


#: What a rank says about the window it just trained (the round's own facts).
#: ``batch_ms``: mean wall ms per batch of the window (data wait + compute; NaN for no
#: batch), the balancer's speed reading — user epoch callbacks and evaluation are
#: outside every batch, so they never read as slowness (SPEC §5). ``quota`` and
#: ``anchor``: the plan this window ran under. ``ending`` and ``calls`` (the own loop's,
#: :class:`flodl_mpi.Averager`; NaN elsewhere): ``ending`` is 1 when the rank sends the
#: row from ``end_epoch()``, 2 from ``close()``, NaN from a round; ``calls`` its ``step()``
#: calls in the epoch so far, so a rank that ends its epoch while another still steps is
#: seen in the same gather by both (``bridge.boundary_verdict``). ``snapshot_ms``: the
#: training thread's copy of this round's values into the staging (`Bridge.add_training_ms`).
#: ``joined`` (the own loop's, :meth:`flodl_mpi.Averager.join`; NaN elsewhere): 1 when the rank's
#: loop is out of data and it takes part as an idle rank, 0 while it still steps; the round in
#: which every rank sends 1 ends the join on every rank (`RoundUpdate.all_joined`).
ROUND_HEAD = Columns("steps", "window", "stop", "non_finite", "batch_ms", "quota", "anchor", "ending", "calls",
                     "snapshot_ms", "joined")

#: The ack of a rank's previous round (SPEC §2 step 9); it rides the next gather.
#: ``control_ms``: the control gather, its wait for the slowest rank included.
#: ``round_ms``: wall ms of the round after its control gather (reduces, divergence,
#: outer step): the balancer's overhead reading, free of the wait for the slowest rank.
#: ``bridge_ms``: the bridge thread's whole time in the round (pre-round check, control
#: gather with its wait for the slowest rank, reduces). ``wait_ms``: how long the training
#: thread was blocked waiting for that round's consensus (blocking policies: about
#: ``bridge_ms``; async: the part compute did not hide, so ``1 - wait_ms / bridge_ms`` is
#: the overlap). ``adopt_ms``: the training thread's copy of that round's consensus into
#: the live values (`Bridge.add_training_ms`; NaN: nothing adopted).
#: ``link_bytes``, ``link_ranks``, ``link_ms``, ``busbw_gbs`` (issue 25 item 4): the params reduce's payload
#: per rank on its exchange and the ranks of that exchange (`flodl_mpi.transport.reduce.Reducer.link`), its
#: wall time on this rank, and the bus bandwidth of the three (`flodl_mpi.protocol.round_profile.bus_bandwidth`).
ACK = Columns("divergence", "pre_norm", "post_norm", "pack_ms", "allreduce_ms", "unpack_ms", "outer_ms", "bytes",
              "control_ms", "round_ms", "bridge_ms", "wait_ms", "adopt_ms",
              "link_bytes", "link_ranks", "link_ms", "busbw_gbs")

#: The whole row of a round's control gather.
ROUND = ROUND_HEAD + ACK

#: Bits of the ``non_finite`` column: what this rank found not finite before the round.
NON_FINITE_LOSS, NON_FINITE_TENSORS = 1, 2
