"""The delta wires' quantisation (``--wire bf16-delta``, ``--wire int8-delta``): pure math, no MPI.

Invariant: what a rank sends is ``q = Q(d)`` of ``d = θ − c + e`` (its parameters minus
the float32 consensus ``c`` every rank holds bit for bit, plus its error feedback ``e``),
and it keeps ``e ← d − deq(q)``: whatever the rounding dropped this round is sent with
the next one, so rounding errors do not accumulate over rounds (error feedback: Seide et
al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD", arXiv
1901.09847). The published low-precision averaging results send such deltas, not the
parameters (INTELLECT-1's int8 pseudo-gradients, arXiv 2412.01152; Streaming DiLoCo,
arXiv 2501.18512).

- bf16: ``q = bf16(d)`` (round to nearest even, torch's conversion); ``deq(q)`` widens
  exactly, so ``e = d − deq(q)`` is exact in float32 (the dropped low bits).
- int8: one scale per tensor agreed by every rank, ``s = max_r max|d_r| / 127`` (a
  max-abs Allreduce before the pieces travel, so every rank's ``q`` shares the grid and
  no value clips); ``q = rint(d / s)`` in ``[-127, 127]``, ``deq(q) = q · s`` in float64;
  ``s = 0`` (a tensor no rank moved) sends zeros.
"""

from __future__ import annotations

import numpy as np

from flodl_mpi.protocol.wire import from_bf16, to_bf16

__all__ = ["INT8_LEVELS", "int8_dequantize", "int8_quantize", "int8_scale", "quantize_bf16"]

#: The int8 grid's largest level: ``q`` in ``[-127, 127]`` (symmetric; -128 unused).
INT8_LEVELS = 127


def quantize_bf16(d: np.ndarray, bits: np.ndarray, err: np.ndarray, widened: np.ndarray) -> None:
    """``bits = bf16(d)`` (uint16), ``err = d − float32(bits)`` (exact); ``widened`` float32 scratch of ``d``'s length."""
    to_bf16(d, bits)
    from_bf16(bits, widened)
    np.subtract(d, widened, out=err)


def int8_scale(maxabs: float) -> float:
    """The int8 grid step of a tensor whose largest ``|d|`` over the ranks is ``maxabs`` (float64; 0 for 0)."""
    return float(maxabs) / INT8_LEVELS if maxabs > 0 else 0.0


def int8_quantize(d: np.ndarray, scale: float, q: np.ndarray, err: np.ndarray, tmp64: np.ndarray) -> None:
    """``q = rint(d / scale)`` (int8, in ``[-127, 127]``) and ``err = d − q · scale`` (float32).

    ``tmp64``: float64 scratch of ``d``'s length. ``scale == 0`` (no rank moved the tensor):
    ``q = 0`` and ``err = d`` (then ``d`` is 0 on every rank that agreed the scale).
    """
    if scale == 0.0:
        q[:] = 0
        np.copyto(err, d)
        return
    np.divide(d, scale, out=tmp64, dtype=np.float64)
    np.rint(tmp64, out=tmp64)
    np.clip(tmp64, -INT8_LEVELS, INT8_LEVELS, out=tmp64)  # |d| <= maxabs: only float rounding could pass 127
    np.copyto(q, tmp64, casting="unsafe")
    np.multiply(tmp64, scale, out=tmp64)
    np.subtract(d, tmp64, out=err, casting="same_kind")


def int8_dequantize(q: np.ndarray, scale: float, out: np.ndarray) -> np.ndarray:
    """``out = q · scale`` in ``out``'s dtype (float64 on the wire's sum)."""
    return np.multiply(q, scale, out=out, dtype=out.dtype)
