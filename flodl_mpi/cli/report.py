"""``flodl-mpi report RUN_DIR [RUN_DIR ...]``: a run's summary and plots; several runs side by side.

Invariant: a report only reads (SWMR, so it works while the run writes), never
initialises MPI and never imports torch; matplotlib is imported only to draw
(the ``plot`` extra), tensorboard only for ``--tensorboard`` (the ``tensorboard``
extra). The numbers come from metrics.h5 as documented in docs/file-formats.rst.

Example::

    flodl-mpi report runs/20260101-120000                # summary + runs/.../plots/*.png
    flodl-mpi report runs/A runs/B --out ab/             # A/B: same axes, a side-by-side table
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flodl_mpi.outputs.metrics import GUARD_VERDICTS
from flodl_mpi.outputs.run_reader import NOT_OPTIONS, Run, RunError, load_run
from flodl_mpi.cli.run_events import change_words
from flodl_mpi.cli.time_budget import AVERAGING, NAMES, averaging_seconds, rank_seconds, time_parts
from flodl_mpi.policy.registry import blocking, describe, lookup

__all__ = ["add_parser", "describe_membership", "describe_policy", "describe_world", "differing_options",
           "format_comparison", "format_summary", "main", "plural", "rank_seconds", "summarize"]


def _last(col: np.ndarray | None) -> float:
    return float(col[-1]) if col is not None else math.nan


def _last_finite(col: np.ndarray | None) -> float:
    """The last measured value (an epoch that was not evaluated has NaN test columns)."""
    if col is None or not np.isfinite(col).any():
        return math.nan
    return float(col[np.flatnonzero(np.isfinite(col))[-1]])


def _or_zero(col: np.ndarray | None) -> np.ndarray:
    return np.zeros(0) if col is None else col


def describe_policy(run: Run) -> str:
    """When the run's ranks averaged, in the policy's own words: its registry entry's, the words
    of train.log's header (`flodl_mpi.policy.registry.describe`; an own loop counts ``step()`` calls)."""
    policy = run.attrs.get("policy", run.config.get("policy", "?"))
    return describe(policy, run.config, "step() call" if run.own_loop else "batch")


def plural(n: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``, ``0 ranks``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def describe_world(run: Run) -> str:
    """The world sizes over the run, from ``world_size_history`` and the membership changes: ``2 ranks``,
    or after a resume at another size ``2 ranks, then 1 from round 10 (resumed)``, or after a rank died
    ``3 ranks, then 2 from round 20 (1 left)``."""
    history = run.world_size_history
    text = plural(history[0][1], "rank")
    steps = [(first, w, "resumed") for first, w in history[1:]]
    for c in run.membership:  # a rank died or joined: one change of the world in place (SPEC §9)
        why = " and ".join(f"{len(ids)} {verb}" for ids, verb in ((c.left, "left"), (c.joined, "joined")) if ids)
        steps.append((c.round, c.world_size, why))
    for first, w, why in sorted(steps, key=lambda t: t[0]):
        text += f", then {w} from round {first} ({why})"
    return text


def describe_membership(run: Run) -> list[str]:
    """The report's lines on the run's membership changes (`Run.membership`), none without one:
    a summary of what they cost (detection, recovery: mean and largest, ms; the steps lost, in all),
    then one line per change (`flodl_mpi.cli.run_events.change_words`)."""
    changes = run.membership
    if not changes:
        return []
    det, rec = [c.detection_ms for c in changes], [c.recovery_ms for c in changes]
    left, joined = sum(len(c.left) for c in changes), sum(len(c.joined) for c in changes)
    lost = sum(c.total_steps_lost for c in changes)
    lines = [f"  membership    {plural(len(changes), 'change')} ({left} left, {joined} joined): detection "
             f"{sum(det) / len(det):.0f} ms mean, {max(det):.0f} largest; recovery {sum(rec) / len(rec):.0f} ms "
             f"mean, {max(rec):.0f} largest; {plural(lost, 'step')} lost in all (never averaged)"]
    return lines + [f"    {change_words(c)}" for c in changes]


def _last_by_name(run: Run, evaluated: bool) -> tuple[dict[str, float], int | None]:
    """The ``scalars`` table's values of the last epoch that has any: evaluation metrics
    (``eval/<name>``, the prefix dropped) or the train step's ``record_scalar`` values."""
    epochs, names, values = (run.column("scalars", c) for c in ("epoch", "name", "value"))
    if epochs is None or names is None or values is None:
        return {}, None
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    rows = [i for i, n in enumerate(names) if n.startswith("eval/") == evaluated]
    if not rows:
        return {}, None
    last = int(max(epochs[i] for i in rows))
    return {names[i].removeprefix("eval/"): float(values[i]) for i in rows if epochs[i] == last}, last


def _validation(run: Run, acc: np.ndarray | None) -> dict[str, Any]:
    """The summary's validation figures (``--val-fraction``): ``val_metric`` (the run's ``--keep-best``
    metric, else ``val_loss``; None: no validation set), ``val_last``, ``val_best`` and ``val_best_epoch``
    (1-based) of it, and ``test_epoch``: the epoch the test set was last evaluated in (None: never)."""
    out: dict[str, Any] = {"val_metric": None, "val_last": math.nan, "val_best": math.nan, "val_best_epoch": None,
                           "test_epoch": None}
    if acc is not None and np.isfinite(acc).any():
        out["test_epoch"] = int(np.flatnonzero(np.isfinite(acc))[-1]) + 1
    metric = run.config.get("keep_best") or "val_loss"
    col = run.column("epochs", metric)
    if col is None or not np.isfinite(col).any():
        return out
    best = int(np.nanargmin(col) if metric.endswith("loss") else np.nanargmax(col))
    out.update(val_metric=metric, val_last=_last_finite(col), val_best=float(col[best]), val_best_epoch=best + 1)
    return out


def summarize(run: Run) -> dict[str, Any]:
    """The numbers of a run's text summary, from its tables (absent columns give NaN/None).

    Returns:
        dict with ``epochs`` (rows of the epochs table) and ``epochs_planned``
        (None for an own loop: it plans none); ``own_loop``; ``loss_name``;
        ``test_accuracy``, ``test_loss`` of the last epoch evaluated, ``train_loss``
        of the last epoch (NaN when not measured); ``test_metrics`` ``{name: value}`` and
        ``test_metrics_epoch``: the user's evaluation metrics of the last epoch
        evaluated (``eval/<name>`` rows of the ``scalars`` table); ``scalars``
        and ``scalars_epoch``: the ``record_scalar`` values of the last epoch;
        ``best_test_accuracy`` and ``best_epoch`` (1-based; NaN and None for a run with a validation
        set: its model is chosen on that, `_validation`'s ``val_*`` and ``test_epoch``); ``rounds``,
        ``skipped_rounds``; ``elapsed_s`` (the later of the last epoch's and
        round's ``time_s``); ``bytes_per_rank`` (sum of ``rounds/bytes``);
        ``world``: ``[(first round, world size)]`` (`Run.world_size_history`);
        W below is the widest world size; a per-rank figure reads only the rows
        whose world had the rank (`Run.per_rank`). ``time_pct`` (W, P): per
        rank, 100 * each of `flodl_mpi.cli.time_budget.PARTS` / the seconds the rank
        was in the run (`rank_seconds`: elapsed, for a run at one world size); a
        row adds up to 100; ``averaging_pct`` (W,): the sum of its `AVERAGING`
        parts (snapshot, the round's phases or async's wait, adoption);
        ``throughput`` (W,) samples/s of compute + data wait (metrics.h5's
        ``per_rank_throughput``: the time in rounds, evaluation and waits for
        peers left out), mean over the epochs the rank recorded; ``wall_throughput`` (W,) samples /
        the rank's epoch wall time (``per_rank_samples`` / ``per_rank_epoch_ms``),
        mean over epochs: what the rank achieved; None when not in the file;
        ``busbw``, ``link_bytes``, ``link_ranks``: the params reduce against its link (`_link`);
        ``throughput_total``, ``wall_throughput_total``: the cohort's, per epoch
        the sum over its ranks, mean over epochs (None when not in the file);
        ``batch_share`` (W,): the rank's batches done / all batches done (not
        the policy's allocation, ``epochs/per_rank_batch_share``); ``guard``:
        verdict name -> rounds (non-stable verdicts only); ``quarantined``: rank ->
        rounds it was quarantined in, from a ``rounds/quarantined`` column when the
        file has one (ranks never quarantined left out); ``stops``: "stopped on
        request" lines in train.log; ``resumes``; ``last_log``: train.log's last line;
        ``anchor``: (first, last, largest) of ``rounds/anchor``, or None;
        ``anchor`` is given for the balanced policies (cadence, async) only;
        ``overlap``: ``max(0, 1 - Σ wait_ms / Σ bridge_ms)`` over every rank and round, the
        fraction of the bridge's round time the training thread did not wait for,
        for async only (a blocking policy waits for every round: it hides nothing),
        or None.
    """
    ep, W = run.tables.get("epochs", {}), run.width
    acc = run.column("epochs", "test_accuracy")
    time_e, time_r = run.column("epochs", "time_s"), run.column("rounds", "time_s")
    elapsed = max(_last(time_e) if time_e is not None else 0.0, _last(time_r) if time_r is not None else 0.0)
    own_loop = run.own_loop
    policy = run.attrs.get("policy", run.config.get("policy"))
    s: dict[str, Any] = {
        "epochs": len(next(iter(ep.values()))) if ep else 0,
        "epochs_planned": None if own_loop else run.config.get("epochs"),
        "own_loop": own_loop, "loss_name": run.loss_name,
        "test_accuracy": _last_finite(acc),
        "test_loss": _last_finite(run.column("epochs", "test_loss")),
        "train_loss": _last(run.column("epochs", "avg_loss")),
        "best_test_accuracy": math.nan, "best_epoch": None,
        "rounds": len(run.column("rounds", "round")) if run.column("rounds", "round") is not None else 0,
        "skipped_rounds": int(np.sum(_or_zero(run.column("rounds", "skipped")))),
        "elapsed_s": elapsed,
        "bytes_per_rank": int(np.sum(_or_zero(run.column("rounds", "bytes")))),
        "averaging_pct": None, "throughput": None, "wall_throughput": None, "batch_share": None,
        "throughput_total": None, "wall_throughput_total": None, "world": run.world_size_history,
        "guard": {}, "quarantined": {}, "resumes": run.resumes, "anchor": None, "overlap": None,
        "stops": sum("stopped on request" in line for line in run.log_lines),
        "last_log": run.log_lines[-1] if run.log_lines else "",
    }
    s["test_metrics"], s["test_metrics_epoch"] = _last_by_name(run, evaluated=True)
    s["scalars"], s["scalars_epoch"] = _last_by_name(run, evaluated=False)
    s.update(_validation(run, acc))
    if acc is not None and np.isfinite(acc).any() and s["val_metric"] is None:  # (with a validation set: not chosen on test)
        best = int(np.nanargmax(acc))
        s["best_test_accuracy"], s["best_epoch"] = float(acc[best]), best + 1
    # Per-rank figures read only the rows whose world had the rank (a resume at another
    # world size pads the others with NaN / -1: Run.per_rank masks both).
    in_run = rank_seconds(run)
    parts = time_parts(run)
    s["time_pct"] = None
    if parts is not None and elapsed > 0:
        with np.errstate(invalid="ignore", divide="ignore"):
            s["time_pct"] = np.where(in_run[:, None] > 0, 100.0 * parts / np.where(in_run > 0, in_run, 1.0)[:, None],
                                     np.nan)
            s["averaging_pct"] = np.where(in_run > 0, 100.0 * averaging_seconds(parts)
                                          / np.where(in_run > 0, in_run, 1.0), np.nan)
    thr = run.per_rank("epochs", "per_rank_throughput")
    samples, epoch_ms = run.per_rank("epochs", "per_rank_samples"), run.per_rank("epochs", "per_rank_epoch_ms")
    rate = None
    if samples is not None and epoch_ms is not None and samples.shape == epoch_ms.shape:
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where((samples >= 0) & (epoch_ms > 0), samples / np.where(epoch_ms > 0, epoch_ms, 1.0) * 1e3,
                            np.nan)
    for key, per_epoch in (("throughput", thr), ("wall_throughput", rate)):
        if per_epoch is None:
            continue
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a rank never recorded: NaN, "not recorded"
            s[key] = np.nanmean(per_epoch, axis=0)
            finite = np.isfinite(per_epoch)
            totals = np.where(finite, per_epoch, 0.0).sum(axis=1)[finite.any(axis=1)]
            s[f"{key}_total"] = float(totals.mean()) if len(totals) else math.nan
    batches = run.per_rank("epochs", "per_rank_batches")
    if batches is not None and np.nansum(batches) > 0:
        s["batch_share"] = np.nansum(batches, axis=0) / np.nansum(batches)
    guard = run.column("rounds", "guard")
    if guard is not None:
        for name, code in GUARD_VERDICTS.items():
            n = int(np.sum(guard == code))
            if n and name != "stable":
                s["guard"][name] = n
    quarantined = run.column("rounds", "quarantined")
    if quarantined is not None and quarantined.ndim == 2:
        s["quarantined"] = {r: int(n) for r, n in enumerate(np.sum(quarantined != 0, axis=0)) if n}
    anchor = run.column("rounds", "anchor")
    spec = lookup(policy)
    if anchor is not None and len(anchor) and spec is not None and spec.quotas:
        s["anchor"] = (int(anchor[0]), int(anchor[-1]), int(anchor.max()))
    wait, bridge = run.column("rounds", "wait_ms"), run.column("rounds", "bridge_ms")
    if wait is not None and bridge is not None and not blocking(policy):
        ok = np.isfinite(wait) & np.isfinite(bridge)
        if ok.any() and bridge[ok].sum() > 0:
            # The wait also holds the hand-off after the bridge finished: never below 0.
            s["overlap"] = max(0.0, float(1.0 - wait[ok].sum() / bridge[ok].sum()))
    s.update(_link(run))
    for key in ("throughput", "wall_throughput"):
        if W and s[key] is not None and len(s[key]) != W:
            s[key] = s[f"{key}_total"] = None  # a file whose per-rank width disagrees with its history: say nothing
    return s


def _link(run: Run) -> dict[str, Any]:
    """The params reduce against its link (issue 25 item 4): ``busbw`` the median over rounds of rank 0's
    ``rounds/busbw_gbs`` (GB/s; rank 0 is a node leader: its exchange is the link's), NaN when the file has
    none (an older file, a world of one, no round moved); ``link_bytes`` and ``link_ranks`` of the last round
    that has them (None when none has)."""
    out: dict[str, Any] = {"busbw": math.nan, "link_bytes": None, "link_ranks": None}
    busbw = run.per_rank("rounds", "busbw_gbs")
    if busbw is not None and busbw.ndim == 2 and busbw.shape[1]:
        col = busbw[:, 0]
        if np.isfinite(col).any():
            out["busbw"] = float(np.nanmedian(col))
    nbytes, ranks = run.column("rounds", "link_bytes"), run.column("rounds", "link_ranks")
    if nbytes is not None and ranks is not None:
        have = np.flatnonzero((nbytes > 0) & (ranks > 0))
        if len(have):
            out["link_bytes"], out["link_ranks"] = int(nbytes[have[-1]]), int(ranks[have[-1]])
    return out


def _link_line(s: dict[str, Any]) -> str | None:
    """``  link          busbw 0.71 GB/s (median over rounds, rank 0) ...``; None when the file has none."""
    if math.isnan(s["busbw"]):
        return None
    what = (f"; S = {_fmt_bytes(s['link_bytes'])} per rank over {plural(s['link_ranks'], 'rank')}"
            if s["link_bytes"] is not None else "")
    return (f"  link          busbw {s['busbw']:.3f} GB/s (median over rounds, rank 0: S / t · 2(W−1)/W of the "
            f"params reduce{what}; compare with the link's rate)")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def _fmt(x: float, spec: str = ".4f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _per_rank(values, spec: str) -> str:
    if values is None:
        return "-"
    return "  ".join(f"r{r} {format(float(v), spec) if np.isfinite(v) else 'not recorded'}"
                     for r, v in enumerate(values))


def _metric_words(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in values.items())


def _unfinished(run_dir: Path) -> str:
    """What a run with epochs left is: from its lock (`flodl_mpi.outputs.run_dir_lock`) and train.log's last line."""
    from flodl_mpi.outputs import run_dir_lock

    if run_dir_lock.in_use(run_dir):
        return "running"
    try:
        lines = [ln for ln in (run_dir / "train.log").read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    last = lines[-1] if lines else ""
    if " stopped, not done" in last:
        return "stopped"
    if " failed: " in last:
        return "not running: failed (train.log's last line says why)"
    if not (run_dir / run_dir_lock.LOCK_NAME).exists():
        return "running or stopped"  # a run of an older flodl-mpi, without the lock: cannot tell
    return "not running: ended without a final record (crashed or killed)"


def format_summary(run: Run) -> str:
    """The text summary of one run: several lines, no trailing newline."""
    s = summarize(run)
    cfg = run.config
    planned = s["epochs_planned"]
    if s["own_loop"]:
        epochs = f"  epochs        {s['epochs']} (end_epoch() calls of your own loop; it plans no count)"
    else:
        status = "finished" if planned is not None and s["epochs"] >= planned else _unfinished(Path(run.path))
        epochs = f"  epochs        {s['epochs']} of {planned if planned is not None else '?'} ({status})"
    lines = [f"run {run.path}  ({describe_world(run)}, {describe_policy(run)}, gamma {cfg.get('gamma', '?')})",
             epochs]
    # What the run measured, no more: accuracy only when there is one, the user's metrics by their names.
    if s["val_metric"] is not None:  # each number says its set: chosen on validation, the test set at the end
        kept = " (kept in checkpoints/best/)" if cfg.get("keep_best") else ""
        lines.append(f"  validation    {s['val_metric']} {_fmt(s['val_last'])} (last)   best {_fmt(s['val_best'])} "
                     f"at epoch {s['val_best_epoch']}{kept}")
        if not math.isnan(s["test_accuracy"]):
            lines.append(f"  test accuracy {_fmt(s['test_accuracy'])} (test set, epoch {s['test_epoch']}: the model "
                         "of that epoch)")
    elif not math.isnan(s["test_accuracy"]) or not math.isnan(s["best_test_accuracy"]):
        lines.append(f"  test accuracy {_fmt(s['test_accuracy'])} (last)   best {_fmt(s['best_test_accuracy'])}"
                     + (f" at epoch {s['best_epoch']}" if s["best_epoch"] else ""))
    shown = ({"loss"} if not math.isnan(s["test_loss"]) else set()) | \
        ({"accuracy"} if not math.isnan(s["test_accuracy"]) else set())
    extra = {k: v for k, v in s["test_metrics"].items() if k not in shown}
    if extra:
        lines.append(f"  test metrics  {_metric_words(extra)} (epoch {s['test_metrics_epoch']})")
    if s["scalars"]:
        lines.append(f"  scalars       {_metric_words(s['scalars'])} (train, epoch {s['scalars_epoch']})")
    lines += [
        (f"  loss          train {_fmt(s['train_loss'])}   test {_fmt(s['test_loss'])} (last evaluated)   "
         f"[{s['loss_name']}]"),
        (f"  rounds        {s['rounds']} ({s['skipped_rounds']} skipped) in {s['elapsed_s']:.1f} s;"
        f" {_fmt_bytes(s['bytes_per_rank'])} on the wire per rank"),
        f"  averaging     {_per_rank(s['averaging_pct'], '.1f')} % of wall time (snapshot, the round, adoption)",
        _time_line(s["time_pct"]),
        (f"  throughput    {_per_rank(s['wall_throughput'], '.0f')} samples/s of epoch wall time; compute "
         f"{_per_rank(s['throughput'], '.0f')} samples/s of compute + data wait (means over epochs)"
         if s["throughput"] is None or np.isfinite(s["throughput"]).any() else
         "  throughput    not recorded (an own loop's step() calls gave no samples=)"),
        f"  batches done  {_per_rank(s['batch_share'], '.3f')} (share of all batches done)",
        f"  stops {s['stops']}, resumes {s['resumes']}; guard "
        + (", ".join(f"{k} {v}" for k, v in s["guard"].items()) or "stable in every round"),
    ]
    link = _link_line(s)
    if link is not None:
        lines.append(link)
    lines += describe_membership(run)
    if s["anchor"] is not None:
        first, last, top = s["anchor"]
        lines.append(f"  anchor        {first} first, {last} last, {top} largest"
                     + (f"; {100 * s['overlap']:.0f} % of the round time hidden behind compute"
                        if s["overlap"] is not None else ""))
    if s["quarantined"]:
        lines.append("  quarantined   "
                     + ", ".join(f"{run.rank_name(r)} in {n} round(s)" for r, n in s["quarantined"].items()))
    if s["last_log"]:
        lines.append(f"  last log line {s['last_log']}")
    return "\n".join(lines)


def _time_line(pct: np.ndarray | None) -> str:
    """``  wall time     compute 40.1 %, ...`` (mean over ranks), the parts that add up to 100 %."""
    if pct is None or not np.isfinite(pct).any():
        return "  wall time     - (no per-rank epoch times in the file)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(pct, axis=0)
    avg = {NAMES.index(n) for n in AVERAGING}
    words = [f"{NAMES[j]} {v:.1f}" for j, v in enumerate(mean) if j not in avg and np.isfinite(v)]
    words.insert(2, f"averaging {sum(mean[j] for j in avg):.1f}")
    return "  wall time     " + ", ".join(words) + " % (mean rank; adds up to 100)"


def _shown(run: Run, key: str) -> Any:
    """A config value as a comparison shows it: ``"n/a"`` for an option the run lists as not
    applicable, a built model or optimizer (a Python API run's record) by its class, lr and size."""
    if key in (run.config.get("not_applicable") or ()):
        return "n/a"
    value = run.config.get(key)
    if isinstance(value, dict) and "class" in value:
        name = str(value["class"]).rsplit(":", 1)[-1]
        if "parameters" in value:
            return f"{name} ({value['parameters']} params)"
        lrs = [g.get("lr") for g in value.get("param_groups", []) if isinstance(g, dict)]
        return f"{name} (lr {', '.join(format(x, 'g') if isinstance(x, float) else str(x) for x in lrs)})"
    return value


def differing_options(runs: Sequence[Run]) -> dict[str, list[Any]]:
    """Options whose values differ between the runs: option -> value per run.

    Compares every config key (``run_dir`` and ``resume`` excepted: they name the
    run) and the world size (``"2 then 1"`` for a run resumed at another one); a key absent from a run's config counts as ``None``,
    one the run lists in ``not_applicable`` as ``"n/a"``; a Python API run's model
    and optimizer records are shown by class (parameters, learning rates).
    Keys use the command line's spelling (``batch-size``).
    """
    keys = sorted({k for r in runs for k in r.config} - set(NOT_OPTIONS))
    out = {}
    for k in keys:
        values = [_shown(r, k) for r in runs]
        if any(v != values[0] for v in values):
            out[k.replace("_", "-")] = values
    # A run resumed at another world size: its sizes in order ("2 then 1").
    sizes = [[w for _, w in r.world_size_history] for r in runs]
    sizes = [ws[0] if len(ws) == 1 else " then ".join(map(str, ws)) for ws in sizes]
    if any(v != sizes[0] for v in sizes):
        out["world size (mpiexec -n)"] = sizes
    return out


def _flag(key: str) -> str:
    """``--batch-size`` for an option of ``flodl-mpi train``; a record's own key (``api``, ``loss``) as it is."""
    from flodl_mpi.config import TrainConfig

    return f"--{key}" if key.replace("-", "_") in TrainConfig.field_names() else key


def format_comparison(runs: Sequence[Run]) -> str:
    """A side-by-side table of several runs' summaries, headed by the options that differ."""
    sums = [summarize(r) for r in runs]
    differ = differing_options(runs)
    lines = []
    if differ:
        lines.append("options that differ: " + "; ".join(
            f"{_flag(k)} " + " vs ".join(repr(v) for v in vals) if not k.startswith("world")
            else f"{k} " + " vs ".join(str(v) for v in vals) for k, vals in differ.items()))
    else:
        lines.append("options that differ: none (same options; differences are run to run noise)")
    rows: list[tuple[str, list[str]]] = [
        ("epochs", [str(s["epochs"]) for s in sums]),
        ("test accuracy (last)", [_fmt(s["test_accuracy"]) for s in sums]),
        ("test accuracy (best)", [_fmt(s["best_test_accuracy"]) for s in sums]),
        ("test loss (last)", [_fmt(s["test_loss"]) for s in sums]),
        ("train loss (last)", [_fmt(s["train_loss"]) for s in sums]),
        ("rounds", [str(s["rounds"]) for s in sums]),
        ("wall time (s)", [_fmt(s["elapsed_s"], ".1f") for s in sums]),
        ("averaging (% wall, mean rank)",
         [_fmt(float(np.nanmean(s["averaging_pct"])), ".1f") if s["averaging_pct"] is not None
          and np.isfinite(s["averaging_pct"]).any() else "-" for s in sums]),
        ("bytes per rank", [_fmt_bytes(s["bytes_per_rank"]) for s in sums]),
        ("bus bandwidth (GB/s, median, rank 0)", [_fmt(s["busbw"], ".3f") for s in sums]),
        ("throughput (samples/s of wall time, sum)",
         [_fmt(s["wall_throughput_total"], ".0f") if s["wall_throughput_total"] is not None else "-"
          for s in sums]),
        ("compute throughput (samples/s of compute + data wait, sum)",
         [_fmt(s["throughput_total"], ".0f") if s["throughput_total"] is not None else "-" for s in sums]),
    ]
    rows[:0] = [(k if k.startswith("world") else _flag(k), [str(v) for v in vals]) for k, vals in differ.items()]
    labels = [r.label for r in runs]
    w0 = max(len(name) for name, _ in rows)
    widths = [max(len(lab), *(len(v[i]) for _, v in rows)) for i, lab in enumerate(labels)]
    lines.append(" " * w0 + "  " + "  ".join(lab.rjust(w) for lab, w in zip(labels, widths)))
    for name, vals in rows:
        lines.append(name.ljust(w0) + "  " + "  ".join(v.rjust(w) for v, w in zip(vals, widths)))
    return "\n".join(lines)


def _with_option_labels(runs: Sequence[Run]) -> list[Run]:
    """Runs labelled for legends with the options that differ: ``A [window 1]``, ``B [window 4]``.

    Up to three options; with more, the directory names alone (the table lists them).
    """
    differ = differing_options(runs)
    if not differ or len(differ) > 3:
        return list(runs)
    names = {k: ("W" if k.startswith("world") else k) for k in differ}
    return [dataclasses.replace(r, label=f"{r.label} [" + ", ".join(f"{names[k]} {v[i]}" for k, v in differ.items())
                                + "]") for i, r in enumerate(runs)]


def _labels(paths: Sequence[str]) -> list[str]:
    """Legend labels: the directory names, made unique (``A``, ``A (2)``)."""
    names = [Path(p).resolve().name if not Path(p).is_file() else Path(p).resolve().parent.name for p in paths]
    out = []
    for i, n in enumerate(names):
        out.append(n if names.count(n) == 1 else f"{n} ({names[:i + 1].count(n)})")
    return out


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``report`` on the ``flodl-mpi`` sub-parsers."""
    p = sub.add_parser("report", help="summarize and plot runs (compare several)", allow_abbrev=False,
                       description="Summarize and plot one run, or compare several on the same axes. "
                                   "Works while a run is still writing.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or their metrics.h5)")
    p.add_argument("--out", metavar="DIR", help="where the PNGs go (default: RUN_DIR/plots for one run, "
                                                "./plots-compare for several); given, plots are required "
                                                "(exit 2 without matplotlib)")
    p.add_argument("--no-plots", action="store_true", help="text only (no matplotlib needed)")
    p.add_argument("--tensorboard", metavar="DIR", help="also write the metrics as TensorBoard event files "
                                                        "(one sub-directory per run; needs the tensorboard extra)")
    return p


def run(args: argparse.Namespace) -> int:
    """``flodl-mpi report``; returns the exit status.

    0: the summary was printed (without matplotlib, plots are skipped with one line
    saying how to get them); 2: an unreadable run, or ``--out``/``--tensorboard``
    asked for output whose extra is not installed.
    """
    try:
        runs = [load_run(p, label) for p, label in zip(args.runs, _labels(args.runs))]
    except RunError as exc:
        print(f"flodl-mpi report: error: {exc}", file=sys.stderr)
        return 2
    for r in runs:
        print(format_summary(r))
    if len(runs) > 1:
        print()
        print(format_comparison(runs))
    if not args.no_plots:
        try:
            from flodl_mpi.cli import plots
        except ImportError as exc:
            if args.out:  # plots asked for by name: without them the command did not do its job
                print(f"flodl-mpi report: error: --out {args.out}: plots need matplotlib ({exc}); "
                      "pip install 'flodl-mpi[plot]'", file=sys.stderr)
                return 2
            # The summary is the report; the plots are an extra the quick start does not install.
            print("plots: not drawn: they need matplotlib (pip install 'flodl-mpi[plot]'); --no-plots skips them")
            return _tensorboard(args, runs)
        out = Path(args.out) if args.out else (runs[0].path / "plots" if len(runs) == 1 else Path("plots-compare"))
        written = plots.write_plots(_with_option_labels(runs), out)
        print(f"plots: {', '.join(str(p) for p in written)}" if written else "plots: none yet (no rows to draw)")
        for line in plots.not_drawn(runs):
            print(f"plots: {line}")
    return _tensorboard(args, runs)


def _tensorboard(args: argparse.Namespace, runs: list[Run]) -> int:
    if args.tensorboard:
        from flodl_mpi.cli import tensorboard_export

        try:
            dirs = tensorboard_export.write_events(runs, Path(args.tensorboard))
        except ImportError as exc:
            print(f"flodl-mpi report: error: --tensorboard needs tensorboard ({exc}); "
                  "pip install 'flodl-mpi[tensorboard]'", file=sys.stderr)
            return 2
        print(f"tensorboard: {', '.join(str(d) for d in dirs)}  (tensorboard --logdir {args.tensorboard})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m flodl_mpi.cli.report RUN_DIR ...`` (the same as ``flodl-mpi report``)."""
    parser = argparse.ArgumentParser(prog="flodl-mpi")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["report", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    from flodl_mpi.cli.main import unix_pipe

    unix_pipe()
    sys.exit(main())

