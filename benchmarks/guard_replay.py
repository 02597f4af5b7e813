"""Replay the divergence guard over real runs' round records: would NudgeDown fire on healthy runs? (issue 6)

Reads ``rounds/divergence`` and ``rounds/mass`` of each metrics.h5 given (a run's, or the copies
``benchmarks/async_adoption.py --keep-metrics DIR`` keeps), takes each round's largest divergence
over the ranks that contributed mass (what the bridge feeds the guard), and feeds the sequence to
``flodl_mpi.protocol.divergence.TrendGuard`` with its defaults (threshold 0.05, ring of 5) and with the
rate-based NudgeDown candidates below. Prints per run: rounds, the divergence's range and median,
and how many rounds each guard answers SuppressGrowth / NudgeDown::

    python benchmarks/async_adoption.py --keep-metrics /tmp/runs ...
    python benchmarks/guard_replay.py /tmp/runs/*.h5

The replay ignores what the verdicts would have done to the anchor (the divergences are those of the
anchors the run really had); it answers only whether the rule fires on these sequences.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flodl_mpi.protocol.divergence import TrendGuard, Verdict  # noqa: E402
from flodl_mpi.outputs.metrics import read_table  # noqa: E402

#: name -> TrendGuard keyword arguments.
GUARDS = {
    "default": {},
    "level 0.1": {"nudge_above": 0.1},
    "rising 5": {"nudge_rising": True},
    "rising 5, x1.5": {"nudge_rising": True, "nudge_ratio": 1.5},
    "rising 5, x2": {"nudge_rising": True, "nudge_ratio": 2.0},
    "rising 5, x3": {"nudge_rising": True, "nudge_ratio": 3.0},
}


def max_divergences(path: Path) -> np.ndarray:
    """float64 ``(rounds,)``: each round's largest divergence over the ranks with mass > 0 (0.0: none)."""
    rd = read_table(path, "rounds")
    div, mass = np.asarray(rd["divergence"], dtype=np.float64), np.asarray(rd["mass"], dtype=np.float64)
    out = np.zeros(len(div))
    for i, (d, m) in enumerate(zip(div, mass)):
        d = d[m > 0]
        out[i] = float(np.nanmax(d)) if d.size and np.isfinite(d).any() else 0.0
    return out


def replay(values: np.ndarray, **kwargs) -> dict[str, int]:
    guard = TrendGuard(**kwargs)
    verdicts = [guard.observe(float(v)) for v in values]
    return {"suppress": sum(v == Verdict.SUPPRESS_GROWTH for v in verdicts),
            "nudge": sum(v == Verdict.NUDGE_DOWN for v in verdicts)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", nargs="+", type=Path, help="metrics.h5 files")
    args = p.parse_args()
    print(f"{'run':<32} {'rounds':>6} {'min':>6} {'median':>6} {'max':>6}  "
          + "  ".join(f"{name} (S/N)" for name in GUARDS))
    for path in args.metrics:
        values = max_divergences(path)
        counts = [replay(values, **kw) for kw in GUARDS.values()]
        name = path.parent.name if path.stem == "metrics" else path.stem
        print(f"{name:<32} {len(values):>6} {values.min():>6.3f} {np.median(values):>6.3f} {values.max():>6.3f}  "
              + "  ".join(f"{c['suppress']}/{c['nudge']}".rjust(len(name) + 6) for name, c in zip(GUARDS, counts)))


if __name__ == "__main__":
    main()
