"""The wire: a flat layout over named float32 tensors plus a trailing mass slot.

Invariant: the layout is planned once from the model's structure (never from a
rank-local fact), so every rank's buffer has the same length, the same tensor
offsets and the same chunk boundaries, and a frame always carries its tensors
and its mass together (SPEC §1, "the wire-scale trick").

Layout of a frame of ``n`` tensor elements: ``[W·m·t_0 …, W·m·t_{n-1}, W·m]``.
The pack multiplies by ``W·m`` while copying (one pass); the unpack divides by
the summed mass while copying back (one pass) and accumulates the float64 sums
of squares the divergence triple needs (SPEC §3) in the same pass.

A frame that MPI sums is float64 (:meth:`WireLayout.new_frame`), the tensors
float32: a value every rank holds alike must come back from the round
unchanged, bit for bit (issue 26 item 5), and a float32 sum of three equal
values already rounds. The float64 scale, sum and divide err far below half a
float32 ulp, so rounding the quotient to float32 once gives the value back, for
any masses. Why not float32 deltas against the last consensus (the same bytes
as today, exact only where a rank's value equals that reference): it needs a
copy of the model per rank, and values that move alike on every rank (weight
decay on rows no rank's gradient touched) would still drift. The cost is twice
the bytes on the MPI-summed paths only (``--node-reduce mpi``); the shared-memory
paths sum in float64 in cache, at the float32 bytes (``benchmarks/bench_round.py``),
and the node leaders' step across nodes sends float32 node means
(:mod:`flodl_mpi.protocol.node_means`). The pre-round
sum of squares is a pass of its own before the round (:func:`sum_squares_pieces`):
its finiteness decides, through the control gather, whether the rank is quarantined.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "WireLayout",
    "from_bf16",
    "pack_chunk",
    "pack_piece",
    "reciprocal",
    "sum_squares",
    "sum_squares_pieces",
    "to_bf16",
    "unpack_chunk",
    "unpack_piece",
]

#: Elements per piece: 1 MiB of float32. Cache-sized pieces reduce faster than one
#: big Allreduce on the machines we measured (DESIGN, "Where the time goes").
DEFAULT_CHUNK_ELEMS = 1 << 18


class WireLayout:
    """Plan of one frame: tensor offsets in a flat float32 buffer and its pieces.

    Args:
        shapes: the tensors' shapes, in wire order (``named_parameters()`` then
            ``named_buffers()`` order, fixed by the model's structure).
        chunk_elems: most elements in one piece (one Allreduce call), >= 1.

    Attributes:
        n: tensor elements; the mass slot is element ``n``.
        size: ``n + 1``, the frame length.
        chunks: ``(lo, hi)`` half-open pieces covering ``[0, size)`` in order;
            the last one holds the mass slot.

    Raises:
        ValueError: ``chunk_elems < 1`` or a negative dimension.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> None:
        if int(chunk_elems) < 1:
            raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems!r}")
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        if any(d < 0 for s in self.shapes for d in s):
            raise ValueError(f"shapes must have non-negative dimensions, got {self.shapes!r}")
        self.sizes = [math.prod(s) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).tolist()
        self.n = int(self.offsets[-1])
        self.size = self.n + 1
        self.chunk_elems = int(chunk_elems)
        self.chunks = [(lo, min(lo + self.chunk_elems, self.size)) for lo in range(0, self.size, self.chunk_elems)]

    def new_staging(self, pinned: bool = False) -> np.ndarray:
        """A zeroed float32 array of ``n`` elements: the tensors, no mass slot.

        ``pinned``: in page-locked host memory when CUDA is available, so the
        device-to-host snapshot and the upload of the consensus can run
        asynchronously (``copy_(..., non_blocking=True)``); pageable memory
        otherwise (a CPU-only torch cannot pin). The array keeps its torch
        storage alive (``ndarray.base``).
        """
        if pinned and torch.cuda.is_available():
            return torch.zeros(self.n, dtype=torch.float32, pin_memory=True).numpy()
        return np.zeros(self.n, dtype=np.float32)

    def new_scratch(self) -> np.ndarray:
        """An uninitialised float32 array of one piece: :func:`unpack_chunk`'s scratch."""
        return np.empty(min(self.chunk_elems, self.size), dtype=np.float32)

    def new_frame(self) -> np.ndarray:
        """A zeroed float64 array of ``size`` elements: the frame MPI sums (see the module docstring)."""
        return np.zeros(self.size, dtype=np.float64)

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """Views of ``flat`` (length >= ``n``) shaped as the tensors; no copies."""
        return [flat[o : o + k].reshape(s) for o, k, s in zip(self.offsets, self.sizes, self.shapes)]


def reciprocal(total: float) -> float:
    """``1 / total`` in float64: the round's one divide, applied as a multiply; 0.0 where it is not a normal float.

    A float64 sum times this reciprocal, rounded to float32 once, errs by at
    most a few 2^-53 relative before that rounding: far below half a float32
    ulp, so values every rank holds alike still come back bit for bit (issue
    26 item 5), and a multiply costs a fraction of a float64 divide (measured:
    ``benchmarks/bench_slice_pass.py``). Every path uses it, so every path
    rounds alike. 0.0 (a total that is not positive and finite, or whose
    reciprocal is subnormal or infinite) tells the caller to divide instead.
    """
    t = float(total)
    if not (t > 0.0 and math.isfinite(t)):
        return 0.0
    inv = 1.0 / t
    return inv if np.finfo(np.float64).tiny <= inv < math.inf else 0.0


def sum_squares(x: np.ndarray) -> float:
    """``sum(x ** 2)`` of a float32 piece, returned as a float64.

    torch's float32 dot keeps several partial sums (about 2e-7 relative error on
    a 1 MiB piece) and runs on torch's per-rank thread budget; the pieces' sums
    are then added in float64 by the caller, like the reference's per-tensor
    norms summed in float64 (SPEC §3). numpy's BLAS is avoided on purpose: its
    own thread pool fights the ranks and MPI's busy-wait for the same cores.

    The float32 dot is the fast path. A finite piece can still overflow it (a
    value near 1e19 squares past float32's 3.4e38), so a result that is not
    finite is recomputed in float64, which holds the square sum of any finite
    float32 piece. The result is therefore not finite only when the piece holds
    a NaN or an infinity (the recompute costs one extra pass, in that case only).
    """
    t = torch.from_numpy(x)
    s = float(torch.dot(t, t))
    if not math.isfinite(s):
        t = t.double()
        s = float(torch.dot(t, t))
    return s


def sum_squares_pieces(flat: np.ndarray, layout: WireLayout) -> float:
    """``sum(flat[:layout.n] ** 2)`` in float64, piece by piece (:func:`sum_squares`).

    The pre-round norm, taken before the round's control gather so that its
    finiteness (``math.isfinite`` of the result: no NaN or infinity in the
    tensors) rides the gather as the rank's non-finite flag (SPEC §2 step 2).
    """
    return sum(sum_squares(flat[lo:min(hi, layout.n)]) for lo, hi in layout.chunks if lo < layout.n)


def pack_chunk(staging: np.ndarray, frame: np.ndarray, lo: int, hi: int, scale: float) -> None:
    """Pack piece ``[lo, hi)`` of the frame: ``frame = scale · staging``, mass slot ``= scale``.

    ``scale`` is ``W · m_r``, applied in the frame's dtype (float64 for
    :meth:`WireLayout.new_frame`). An idle or quarantined rank (``scale == 0``)
    writes true zeros, never ``0 · θ``: a NaN in θ would survive the multiply
    (SPEC §1). They are ``-0.0``, the identity of IEEE addition (``+0.0`` would
    turn a sum of ``-0.0`` into ``+0.0``: a value every rank holds alike must
    come back bit for bit, issue 26 item 5).
    """
    n = staging.size
    t_hi = min(hi, n)
    if scale == 0.0:
        frame[lo:hi] = -0.0
    else:
        np.multiply(staging[lo:t_hi], frame.dtype.type(scale), out=frame[lo:t_hi], dtype=frame.dtype)
        if hi > n:
            frame[n] = scale


def unpack_chunk(
    frame: np.ndarray,
    staging: np.ndarray,
    lo: int,
    hi: int,
    total_mass: np.float32,
    scratch: np.ndarray,
) -> tuple[float, float]:
    """Unpack piece ``[lo, hi)``: ``staging = frame / total_mass``, the one divide.

    ``staging`` holds the rank's pre-round tensors on entry and the consensus on
    return (the quotient in the frame's dtype, rounded to float32 once);
    ``frame`` holds the summed piece and is left holding the consensus piece
    (float32-rounded); ``scratch`` (float32, one piece, from ``new_scratch``) receives
    ``pre - post``. Measured here, a cache-resident subtract plus dot costs half
    of ``torch.dist``.

    When the consensus piece is not finite (``post_sq`` is not), the staging
    keeps its pre-round values for this piece.

    Returns:
        ``(sum((pre - post) ** 2), sum(post ** 2))`` for this piece, as float64.
    """
    t_hi = min(hi, staging.size)
    if t_hi <= lo:
        return 0.0, 0.0
    inverse = reciprocal(total_mass) if frame.dtype == np.float64 else 0.0
    if inverse:  # as unpack_piece: every path rounds alike
        post = np.multiply(frame[lo:t_hi], inverse, out=frame[lo:t_hi])
    else:
        post = np.divide(frame[lo:t_hi], total_mass, out=frame[lo:t_hi])
    if post.dtype != np.float32:  # the float32 consensus, held in the frame: pre - post is 0 where they agree
        np.copyto(scratch[: t_hi - lo], post)
        np.copyto(post, scratch[: t_hi - lo])
    pre = staging[lo:t_hi]
    diff_sq = sum_squares(np.subtract(pre, post, out=scratch[: t_hi - lo]))
    post_sq = sum_squares(post)
    if math.isfinite(post_sq):  # a non-finite consensus piece never reaches the staging
        np.copyto(pre, post)
    return diff_sq, post_sq


def pack_piece(staging: np.ndarray, lo: int, hi: int, out: np.ndarray, scale: float) -> None:
    """Pack frame piece ``[lo, hi)`` into ``out`` (float32, ``hi - lo`` elements, any buffer).

    ``out[i - lo] = scale · staging[i]`` for tensor elements, ``scale`` at the
    mass slot (element ``staging.size``), in ``out``'s dtype (float64 on the
    wire MPI sums); an idle rank (``scale == 0``) writes true zeros, never
    ``0 · θ`` (SPEC §1; ``-0.0``, as :func:`pack_chunk`). The same arithmetic
    as :func:`pack_chunk`, into a piece-sized buffer: the wire needs one piece
    of memory, not a frame (the pieces are reduced one after another).
    """
    n = staging.size
    t_hi = min(hi, n)
    if scale == 0.0:
        out[: hi - lo] = -0.0
        return
    if t_hi > lo:
        np.multiply(staging[lo:t_hi], out.dtype.type(scale), out=out[: t_hi - lo], dtype=out.dtype)
    if hi > n:
        out[n - lo] = scale


def unpack_piece(
    summed: np.ndarray,
    staging: np.ndarray,
    lo: int,
    hi: int,
    total_mass: np.float32,
    post: np.ndarray,
    diff: np.ndarray,
) -> tuple[float, float]:
    """Unpack frame piece ``[lo, hi)`` from ``summed`` (its ``hi - lo`` summed elements).

    The one divide (``post = summed / total_mass``, into ``post``: float32
    scratch of one piece, or ``summed`` itself when that buffer is private and
    float32), ``diff = pre - post`` into ``diff`` (float32 scratch of one piece;
    it may alias ``summed``, read before), the two float64 sums of squares of
    the divergence triple, then ``staging[lo:hi] = post``; a non-finite
    consensus piece never reaches the staging (as :func:`unpack_chunk`).
    ``summed`` float64 (the float64 wire, or a float64 node sum): the quotient
    is float64 (the sum times :func:`reciprocal`), rounded to float32 once
    into ``post`` (issue 26 item 5: identical inputs come back unchanged, and
    their difference is exactly 0).

    Returns:
        ``(sum((pre - post) ** 2), sum(post ** 2))`` for this piece, float64.
    """
    t_hi = min(hi, staging.size)
    if t_hi <= lo:
        return 0.0, 0.0
    k = t_hi - lo
    inverse = reciprocal(total_mass) if summed.dtype == np.float64 else 0.0
    if inverse:
        p = np.multiply(summed[:k], inverse, out=post[:k])
    else:
        p = np.divide(summed[:k], total_mass, out=post[:k])
    pre = staging[lo:t_hi]
    diff_sq = sum_squares(np.subtract(pre, p, out=diff[:k]))
    post_sq = sum_squares(p)
    if math.isfinite(post_sq):
        np.copyto(pre, p)
    return diff_sq, post_sq


def _bf16_tensor(u16: np.ndarray) -> torch.Tensor:
    """A torch bfloat16 view of a uint16 numpy array (no copy)."""
    return torch.from_numpy(u16.view(np.int16)).view(torch.bfloat16)


def to_bf16(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round float32 ``x`` to bfloat16 bits in ``out`` (uint16, same length): round to nearest even.

    torch's float32 -> bfloat16 conversion is round-to-nearest-even and keeps a
    NaN a NaN (SPEC §7); numpy has no bfloat16, so the bits live in uint16.
    A finite value beyond bfloat16's largest (about 3.39e38) becomes an infinity.
    """
    _bf16_tensor(out).copy_(torch.from_numpy(x))
    return out


def from_bf16(u16: np.ndarray, out: np.ndarray) -> np.ndarray:
    """bfloat16 bits ``u16`` (uint16) widened exactly to float32 in ``out``."""
    torch.from_numpy(out).copy_(_bf16_tensor(u16))
    return out
