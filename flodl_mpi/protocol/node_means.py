"""The leaders' exchange across nodes: each node's float32 mean and float64 mass, combined in node order.

Concept (issue 25 item 4): in a hierarchical round each node leader holds its
node's float64 partial sum ``S_k = Σ_{r∈k} W·m_r·θ_r`` and mass
``M_k = Σ_{r∈k} W·m_r``. Instead of the float64 sums (8 bytes a value), the
leaders exchange the node's mean ``μ_k = float32(S_k / M_k)`` (4 bytes a value,
or bfloat16 on ``--bf16-wire``) and ``M_k`` as float64, then every leader
combines ``Σ_k M_k·μ_k`` in float64, in node order, and the round's one divide by
``Σ_k M_k`` rounds the consensus to float32 once (:func:`~flodl_mpi.protocol.wire.unpack_piece`).

Invariants:

* a value every rank holds alike comes back unchanged, bit for bit (issue 26
  item 5): ``S_k / M_k`` errs by a few 2^-53 relative, far below half a float32
  ulp, so ``μ_k`` is that value exactly; so is the float64 combine's quotient;
* every leader computes the same bits: the same gathered means and masses,
  the same float64 operations in the same (node) order;
* a node of mass 0 (every rank idle or quarantined) is skipped, true zeros
  (SPEC §1): whatever its mean holds does not reach the consensus.

The cost against the float64 sums: one extra float32 rounding per node, so the
consensus differs from the float64 reference ``Σ m_r·θ_r / Σ m_r`` by at most
about ``(1 + 1/2)`` float32 ulps of the largest node mean (half an ulp from each
``μ_k``, weighted by ``M_k / Σ M``, plus half an ulp from the final rounding).
Pure numpy: no MPI, no threads (the exchange itself is
:class:`flodl_mpi.transport.leaders.LeaderMeans`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flodl_mpi.protocol.wire import reciprocal

__all__ = ["combine_means", "node_mean", "total_mass"]


def node_mean(summed: np.ndarray, mass: float, out: np.ndarray) -> np.ndarray:
    """A node's mean ``out = float32(summed / mass)``, rounded once; ``-0.0`` everywhere for mass 0.

    Args:
        summed: float64 ``(k,)``, the node's partial sum of piece (tensor
            elements only, no mass slot).
        mass: the node's float64 mass ``M_k`` (``Σ W·m_r`` over its ranks, >= 0).
        out: float32 ``(>= k,)``; its first ``k`` elements receive the mean.

    Returns:
        ``out[:k]``. The quotient is the float64 sum times
        :func:`~flodl_mpi.protocol.wire.reciprocal` (a divide where that is 0.0),
        as the round's own divide, rounded to float32 once. A node of mass 0
        sends true zeros (``-0.0``, the identity of IEEE sums): the combine
        skips it anyway, the zeros keep the wire deterministic.
    """
    k = summed.shape[0]
    dst = out[:k]
    m = float(mass)
    if m == 0.0:
        dst[:] = -0.0
        return dst
    inv = reciprocal(m)
    if inv:
        np.multiply(summed, inv, out=dst, casting="same_kind")
    else:
        np.divide(summed, m, out=dst, casting="same_kind")
    return dst


def total_mass(masses: Sequence[float]) -> float:
    """``Σ_k M_k`` in float64, in node order: the round's divisor, the same bits on every leader."""
    total = 0.0
    for m in masses:
        total += float(m)
    return total


def combine_means(means: Sequence[np.ndarray], masses: Sequence[float], out: np.ndarray, tmp: np.ndarray) -> None:
    """``out = Σ_k M_k·μ_k`` in float64, node order; the nodes of mass 0 skipped; ``-0.0`` if none is left.

    Args:
        means: the nodes' float32 means of one piece, ``K`` arrays of ``(k,)``,
            in node order (the leaders' communicator's rank order).
        masses: ``K`` float64 node masses, the same order.
        out: float64 ``(k,)``: the combined (not yet divided) piece; the
            caller divides by :func:`total_mass` (the round's one divide).
        tmp: float64 scratch ``(>= k,)``.

    Raises:
        ValueError: ``means`` and ``masses`` differ in length.
    """
    if len(means) != len(masses):
        raise ValueError(f"combine_means: {len(means)} means but {len(masses)} masses")
    k = out.shape[0]
    first = True
    for mu, m in zip(means, masses):
        m = float(m)
        if m == 0.0:
            continue  # true zeros: a NaN in an idle node's mean must not survive
        if first:
            np.multiply(mu[:k], m, out=out, dtype=np.float64)
            first = False
        else:
            np.add(out, np.multiply(mu[:k], m, out=tmp[:k], dtype=np.float64), out=out)
    if first:
        out[:] = -0.0
