"""PNG plots of one or several runs (matplotlib, the ``plot`` extra), for ``flodl-mpi report``.

Invariant: every figure is drawn on a stand-alone ``matplotlib.figure.Figure``
rendered by the Agg canvas — no pyplot, no global backend switch, no display — so
it works on a login node and leaves a user's own matplotlib state alone. Columns
are looked up by name; a figure whose columns are absent is not drawn. Several
runs share the axes: the A/B comparison is read off one picture.

Each ``*_figure`` function returns the Figure, or None when it has nothing to
draw; `write_plots` saves them atomically (temporary name, then rename).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from flodl_mpi.cli import time_budget
from flodl_mpi.outputs.metrics import GUARD_VERDICTS
from flodl_mpi.cli.run_events import epoch_ends, events, round_epochs, rounds_to_epochs
from flodl_mpi.outputs.run_reader import Run
from flodl_mpi.policy.registry import get as policy_spec
from flodl_mpi.policy.registry import names as policy_names

__all__ = [
    "FIGURES",
    "cadence_figure",
    "divergence_figure",
    "eval_metrics",
    "not_drawn",
    "quota_policies",
    "ranks_figure",
    "round_times_figure",
    "time_figure",
    "time_parts",
    "training_figure",
    "write_plots",
]

_STYLES = ("-", "--", ":", "-.")
_FIGSIZE = (11, 4.5)


def _color(i: int) -> str:
    return f"C{i % 10}"


def _series_style(runs: Sequence[Run], i_run: int, rank: int) -> dict:
    """One run: a color per rank. Several: a color per run, a line style per rank."""
    if len(runs) == 1:
        return {"color": _color(rank), "linestyle": "-"}
    return {"color": _color(i_run), "linestyle": _STYLES[rank % len(_STYLES)]}


def _label(runs: Sequence[Run], run: Run, what: str) -> str:
    return what if len(runs) == 1 else f"{run.label}: {what}"


def _title(runs: Sequence[Run], what: str) -> str:
    """``what — A vs B``, with the run directories' names (legends carry the options)."""
    names = [r.label.split(" [")[0] for r in runs]
    return f"{what} — " + " vs ".join(names)


#: How each kind of `flodl_mpi.cli.run_events.Event` is drawn (a vertical line, its gid ``event:<kind>``).
_EVENT_STYLE = {"stop": {"color": "red", "linestyle": "--"}, "resume": {"color": "green", "linestyle": "-."},
                "world": {"color": "purple", "linestyle": "-"},
                "membership": {"color": "darkorange", "linestyle": ":"}}


def _round_axis(runs: Sequence[Run]) -> str:
    """``"epoch"`` for several runs that all have an epoch axis (their round counts differ with
    their windows: rounds do not compare), else ``"round"``."""
    if len(runs) > 1 and all(round_epochs(r) is not None for r in runs):
        return "epoch"
    return "round"


def _round_x(run: Run, axis: str) -> np.ndarray | None:
    """Each round's place on ``axis``: its number, or its epoch (`round_epochs`)."""
    return round_epochs(run) if axis == "epoch" else run.column("rounds", "round")


_AXIS_LABEL = {"round": "round", "epoch": "epoch (a round at the share of its epoch's batches done by then)"}


def _mark_events(ax, runs: Sequence[Run], axis: str) -> None:
    """A vertical line at each stop, resume, world-size and membership change of each run (`run_events.events`):
    on a round axis between the last round before it and the first after, on an epoch axis
    where the rounds done by then end. Each line's gid is ``event:<kind>``."""
    for i, run in enumerate(runs):
        x = round_epochs(run) if axis == "epoch" else None
        seen = set()
        for ev in events(run):
            pos = ev.rounds - 0.5 if axis == "round" else rounds_to_epochs(run, ev.rounds, x)
            if pos is None:
                continue
            style = dict(_EVENT_STYLE[ev.kind])
            if len(runs) > 1:
                style["color"] = _color(i)
            line = ax.axvline(pos, linewidth=1.2, alpha=0.8, gid=f"event:{ev.kind}",
                              label=_label(runs, run, ev.kind) if ev.kind not in seen else "_nolegend_", **style)
            line.event_label = ev.label  # what it marks, for a reader of the figure object
            seen.add(ev.kind)


def _epoch_axis(run: Run) -> np.ndarray | None:
    e = run.column("epochs", "epoch")
    return e  # metrics.h5 counts epochs from 1, as the log does


def _smooth(y: np.ndarray, k: int) -> np.ndarray:
    """Moving average of ``k`` points ('valid' part padded at the start with a shorter mean),
    over the finite points only: a NaN (not measured) neither spreads nor counts."""
    if k <= 1 or len(y) < k:
        return y
    finite = np.isfinite(y)
    c = np.cumsum(np.insert(np.where(finite, y, 0.0), 0, 0.0))
    n = np.cumsum(np.insert(finite.astype(np.float64), 0, 0.0))
    sums = np.concatenate([c[1:k], c[k:] - c[:-k]])
    counts = np.concatenate([n[1:k], n[k:] - n[:-k]])
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.where(counts > 0, counts, 1.0), np.nan)


def _rank_mean(y: np.ndarray) -> np.ndarray:
    """Per row, the mean over the ranks that row's world had (``y`` from `Run.per_rank`: NaN elsewhere)."""
    finite = np.isfinite(y)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(finite.any(axis=1), np.where(finite, y, 0.0).sum(axis=1) / finite.sum(axis=1), np.nan)


def _smoothing(runs: Sequence[Run]) -> int:
    n = max(len(r.column("rounds", "round")) if r.column("rounds", "round") is not None else 0 for r in runs)
    return max(1, n // 100)


def _loss_label(runs: Sequence[Run]) -> str:
    """The loss axis's label: the runs' recorded loss (cross-entropy in nats for the CLI's task)."""
    names = {r.loss_name for r in runs}
    if names == {"cross-entropy"}:
        return "cross-entropy loss (nats)"
    return names.pop() if len(names) == 1 else "loss (as each run names it)"


def eval_metrics(run: Run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The user's evaluation metrics per epoch, ``{name: (epochs, values)}`` (``eval/<name>`` rows
    of the ``scalars`` table; ``loss`` left out: the loss panel has it)."""
    epochs, names, values = (run.column("scalars", c) for c in ("epoch", "name", "value"))
    if epochs is None or names is None or values is None:
        return {}
    names = np.array([n.decode() if isinstance(n, bytes) else str(n) for n in names])
    out = {}
    for name in dict.fromkeys(n for n in names if n.startswith("eval/") and n != "eval/loss"):
        rows = names == name
        out[name.removeprefix("eval/")] = (epochs[rows], values[rows])
    return out


def _has_accuracy(run: Run) -> bool:
    acc = run.column("epochs", "test_accuracy")
    return acc is not None and bool(np.isfinite(acc).any())


def training_figure(runs: Sequence[Run]) -> Figure | None:
    """Loss (train and test) per epoch, and the test accuracy per epoch (1 line per run) or,
    for runs that measured no accuracy, their own evaluation metrics (1 line per metric);
    one panel when no run measured either."""
    if not any(_epoch_axis(r) is not None for r in runs):
        return None
    accuracy = any(_has_accuracy(r) for r in runs)
    metrics = {id(r): eval_metrics(r) for r in runs}
    second = accuracy or any(metrics.values())
    fig = Figure(figsize=_FIGSIZE, layout="constrained")
    ax_loss, ax_acc = fig.subplots(1, 2) if second else (fig.subplots(), None)
    for i, run in enumerate(runs):
        x = _epoch_axis(run)
        if x is None:
            continue
        c = _color(i)
        for col, style, what in (("avg_loss", "-", "train loss"), ("test_loss", "--", "test loss")):
            y = run.column("epochs", col)
            if y is not None and np.isfinite(y).any():
                ax_loss.plot(x, y, color=c, linestyle=style, marker="o", markersize=3, label=_label(runs, run, what))
        if accuracy:
            acc = run.column("epochs", "test_accuracy")
            if acc is not None:
                ax_acc.plot(x, 100 * acc, color=c, marker="o", markersize=3, label=_label(runs, run, "test accuracy"))
        elif ax_acc is not None:
            for j, (name, (e, v)) in enumerate(metrics[id(run)].items()):
                ax_acc.plot(e, v, marker="o", markersize=3, label=_label(runs, run, f"test {name}"),
                            **_series_style(runs, i, j))
    ax_loss.set(title="Loss per epoch", xlabel="epoch", ylabel=_loss_label(runs))
    if accuracy:
        ax_acc.set(title="Test accuracy per epoch (consensus model)", xlabel="epoch", ylabel="top-1 accuracy (%)")
    elif ax_acc is not None:
        ax_acc.set(title="Test metrics per epoch (consensus model)", xlabel="epoch",
                   ylabel="value (Σ sum / Σ count over the test set)")
    for ax in (a for a in (ax_loss, ax_acc) if a is not None):
        _mark_events(ax, runs, "epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(_title(runs, "Training"))
    return fig


def ranks_figure(runs: Sequence[Run]) -> Figure | None:
    """Per-rank throughput (samples/s) per epoch, and the share of each epoch's batches each rank
    did (``per_rank_batches`` / the epoch's batches; dotted: the policy's allocation,
    ``per_rank_batch_share``): W + 2W lines per run."""
    cols = ("per_rank_throughput", "per_rank_batches", "per_rank_batch_share")
    if not any(_epoch_axis(r) is not None and any(r.column("epochs", c) is not None for c in cols) for r in runs):
        return None
    fig = Figure(figsize=_FIGSIZE, layout="constrained")
    ax_thr, ax_share = fig.subplots(1, 2)
    for i, run in enumerate(runs):
        x = _epoch_axis(run)
        if x is None:
            continue
        thr, done = run.per_rank("epochs", cols[0]), run.per_rank("epochs", cols[1])
        alloc = run.per_rank("epochs", cols[2])
        if done is not None:
            with np.errstate(invalid="ignore", divide="ignore"):
                total = np.nansum(done, axis=1, keepdims=True)
                done = np.where(total > 0, done / np.where(total > 0, total, 1.0), np.nan)
        for r in range(run.width):
            style = _series_style(runs, i, r)
            if thr is not None:
                ax_thr.plot(x, thr[:, r], marker="o", markersize=3, label=_label(runs, run, run.rank_name(r)), **style)
            if done is not None:
                ax_share.plot(x, 100 * done[:, r], marker="o", markersize=3, gid="batches done",
                              label=_label(runs, run, f"{run.rank_name(r)}: done"), **style)
            if alloc is not None:
                ax_share.plot(x, 100 * alloc[:, r], linewidth=1, alpha=0.7, gid="allocation",
                              label=_label(runs, run, f"{run.rank_name(r)}: policy's allocation"),
                              **{**style, "linestyle": ":"})
    ax_thr.set(title="Throughput per rank (samples / s of compute + data wait)", xlabel="epoch", ylabel="samples / s")
    ax_share.set(title="Share of the epoch's batches done per rank\n"
                       "(dotted: the policy's allocation at the epoch's end)",
                 xlabel="epoch", ylabel="% of the epoch's batches")
    for ax in (ax_thr, ax_share):
        _mark_events(ax, runs, "epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax_thr.set_ylim(bottom=0)
    fig.suptitle(_title(runs, "Ranks"))
    return fig


def time_parts(run: Run) -> np.ndarray | None:
    """`flodl_mpi.cli.time_budget.time_parts`: per rank, seconds of each of its ``PARTS``, float64 ``(W, P)``."""
    return time_budget.time_parts(run)


def time_figure(runs: Sequence[Run]) -> Figure | None:
    """Where each rank's wall time went: one stacked bar per (run, rank), the parts of
    `flodl_mpi.cli.time_budget.PARTS` (a part that is 0 for every bar is left out of the
    legend), which add up to the seconds the rank was in the run; each part's
    definition is printed under the axes."""
    parts = [(run, time_parts(run)) for run in runs]
    parts = [(run, p) for run, p in parts if p is not None]
    if not parts:
        return None
    labels, rows = [], []
    for run, p in parts:
        for r in range(p.shape[0]):
            labels.append(run.rank_name(r) if len(runs) == 1 else f"{run.label}: {run.rank_name(r)}")
            rows.append(p[r])
    data = np.array(rows)
    shown = [j for j in range(data.shape[1]) if np.any(np.abs(data[:, j]) > 0)]
    fig = Figure(figsize=(_FIGSIZE[0] + 2, max(2.5, 1.2 + 0.45 * len(rows)) + 0.22 * len(shown)), layout="constrained")
    ax = fig.subplots()
    y = np.arange(len(rows))[::-1]
    left = np.zeros(len(rows))
    for j in shown:
        width = np.maximum(data[:, j], 0.0)  # a rest below 0 (clocks that disagree) is not drawn
        ax.barh(y, width, left=left, color=_color(j), hatch="//" if j >= 10 else None,
                label=time_budget.NAMES[j], gid=time_budget.NAMES[j])
        left += width
    ax.set_yticks(y, labels)
    ax.set(title=_title(runs, "Where each rank's wall time went (the parts add up to its wall time)"),
           xlabel="time (s)")
    ax.grid(alpha=0.3, axis="x")
    fig.legend(*ax.get_legend_handles_labels(), fontsize="small", loc="outside right upper")
    definitions = "\n".join(f"{time_budget.PARTS[j][0]}: {time_budget.PARTS[j][1]}" for j in shown)
    ax.set_xlabel("time (s)\n\n" + definitions, fontsize="small", loc="left")
    return fig


def divergence_figure(runs: Sequence[Run]) -> Figure | None:
    """Divergence ‖θ_r − consensus‖ / ‖consensus‖ per round per rank: W lines per run.

    A line joins the rounds where the rank contributed mass; a round where it was idle
    (``rounds/mass`` 0: no batch in that window, as at an epoch's end) is an ``x`` of its
    own (gid ``idle``): its distance from a consensus it did not join. An epoch's last
    round is a dotted vertical line (gid ``epoch end``); rounds where the trend guard did
    not answer ``stable`` are marked; stops, resumes and world-size changes are lines
    (`_mark_events`). Several runs: on an epoch axis.
    """
    if not any(r.column("rounds", "divergence") is not None for r in runs):
        return None
    axis = _round_axis(runs)
    fig = Figure(figsize=_FIGSIZE, layout="constrained")
    ax = fig.subplots()
    positive = True
    for i, run in enumerate(runs):
        x, y = _round_x(run, axis), run.per_rank("rounds", "divergence")
        if x is None or y is None:
            continue
        positive &= bool(np.all(y[np.isfinite(y)] > 0))  # NaN: a rank the round's world did not have
        mass = run.per_rank("rounds", "mass")
        idle = (mass == 0) if mass is not None and mass.shape == y.shape else np.zeros(y.shape, dtype=bool)
        for r in range(y.shape[1]):
            style = _series_style(runs, i, r)
            ax.plot(x, np.where(idle[:, r], np.nan, y[:, r]), linewidth=1, label=_label(runs, run, run.rank_name(r)),
                    **style)
            if idle[:, r].any():
                ax.plot(x[idle[:, r]], y[idle[:, r], r], "x", color=style["color"], markersize=4, linestyle="none",
                        gid="idle", label=_label(runs, run, f"{run.rank_name(r)} idle (mass 0)"))
        first = True
        for k in epoch_ends(run):
            ax.axvline(x[k], color="gray" if len(runs) == 1 else _color(i), linestyle=":", linewidth=0.8, alpha=0.6,
                       gid="epoch end", label=_label(runs, run, "an epoch's last round") if first else "_nolegend_")
            first = False
        guard = run.column("rounds", "guard")
        if guard is not None and np.any(guard != GUARD_VERDICTS["stable"]):
            hit = x[guard != GUARD_VERDICTS["stable"]]
            ax.plot(hit, np.full(len(hit), np.nanmax(y)), "v", color=_color(i), markersize=5, linestyle="none",
                    label=_label(runs, run, "guard: not stable"))
    _mark_events(ax, runs, axis)
    if positive:
        ax.set_yscale("log")
    ax.set(title=_title(runs, "Divergence of each rank from the consensus, per round\n"
                              "(x: a rank idle in that round, mass 0; dotted: an epoch's last round)"),
           xlabel=_AXIS_LABEL[axis], ylabel="‖θ_r − consensus‖ / ‖consensus‖ (ratio)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return fig


def round_times_figure(runs: Sequence[Run]) -> Figure | None:
    """Time per round phase (pack, allreduce, unpack), mean over ranks, smoothed: 3 lines per run; and, on a
    second axis, rank 0's bus bandwidth of the params reduce (``rounds/busbw_gbs``) where the file has it."""
    phases = [p for p in ("pack_ms", "allreduce_ms", "unpack_ms")
              if any(r.column("rounds", p) is not None for r in runs)]
    if not phases:
        return None
    k = _smoothing(runs)
    fig = Figure(figsize=_FIGSIZE, layout="constrained")
    ax = fig.subplots()
    axis = _round_axis(runs)
    for i, run in enumerate(runs):
        x = _round_x(run, axis)
        for j, p in enumerate(phases):
            y = run.per_rank("rounds", p)
            if x is None or y is None:
                continue
            style = {"color": _color(j), "linestyle": "-"} if len(runs) == 1 else \
                {"color": _color(i), "linestyle": _STYLES[j % len(_STYLES)]}
            ax.plot(x, _smooth(_rank_mean(y), k), linewidth=1.2, label=_label(runs, run, p[:-3]), **style)
    ax.set_ylim(bottom=0)
    avg = f" (moving average over {k} rounds)" if k > 1 else ""
    _mark_events(ax, runs, axis)
    ax.set(title=_title(runs, f"Time per round phase, mean over ranks{avg}"), xlabel=_AXIS_LABEL[axis],
           ylabel="time (ms)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    busbw = [(i, run, run.per_rank("rounds", "busbw_gbs")) for i, run in enumerate(runs)]
    busbw = [(i, run, y) for i, run, y in busbw if y is not None and np.isfinite(y).any()]
    if busbw:  # the params reduce's bus bandwidth (issue 25 item 4), on its own axis
        bx = ax.twinx()
        for i, run, y in busbw:
            x = _round_x(run, axis)
            if x is not None:
                bx.plot(x, _smooth(y[:, 0], k), color="0.3" if len(runs) == 1 else _color(i), linestyle=":",
                        linewidth=1.2, label=_label(runs, run, "busbw (rank 0)"))
        bx.set_ylim(bottom=0)
        bx.set_ylabel("bus bandwidth of the params reduce (GB/s)")
        h2, l2 = bx.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize="small")
    return fig


def quota_policies() -> tuple[str, ...]:
    """The policies that plan quotas per rank (an anchor that moves; registry entries with ``quotas``):
    the cadence figure is theirs."""
    return tuple(n for n in policy_names() if policy_spec(n).quotas)


def _policy(run: Run) -> str:
    return str(run.attrs.get("policy", run.config.get("policy", "?")))


def cadence_figure(runs: Sequence[Run]) -> Figure | None:
    """Anchor and per-rank window (batches) per round, for the runs whose policy plans quotas
    (`quota_policies`): 1 + W lines per such run; None when no run has one (`not_drawn` says
    why). Several runs: on an epoch axis."""
    runs_q = [r for r in runs if _policy(r) in quota_policies()
              and (r.column("rounds", "anchor") is not None or r.column("rounds", "window") is not None)]
    drawn = {id(r) for r in runs_q}
    if not runs_q:
        return None
    axis = _round_axis(runs)
    fig = Figure(figsize=_FIGSIZE, layout="constrained")
    ax = fig.subplots()
    for i, run in enumerate(runs):
        x = _round_x(run, axis)
        if x is None or id(run) not in drawn:
            continue
        anchor, window = run.column("rounds", "anchor"), run.per_rank("rounds", "window")
        if anchor is not None:
            ax.step(x, anchor, where="post", color="black" if len(runs) == 1 else _color(i), linewidth=2,
                    alpha=0.6, label=_label(runs, run, "anchor"))
        if window is not None:
            for r in range(window.shape[1]):
                ax.step(x, window[:, r], where="post", linewidth=1,
                        label=_label(runs, run, f"{run.rank_name(r)} window"), **_series_style(runs, i, r))
    _mark_events(ax, runs_q, axis)
    ax.set_ylim(bottom=0)
    ax.set(title=_title(runs_q, "Anchor and batches per rank in each window"), xlabel=_AXIS_LABEL[axis],
           ylabel="batches per window")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def not_drawn(runs: Sequence[Run]) -> list[str]:
    """One line per figure (or run) `write_plots` leaves out on purpose, saying why: the
    cadence figure for a run whose policy plans no quotas."""
    fixed = [r for r in runs if _policy(r) not in quota_policies()]
    if not fixed:
        return []
    which = ", ".join(f"{r.label.split(' [')[0]} (policy {_policy(r)})" for r in fixed) if len(runs) > 1 \
        else f"policy {_policy(fixed[0])}"
    head = "not drawn" if len(fixed) == len(runs) else "left out"
    return [f"cadence.png: {head}: {which} plans no quotas per rank (only {' and '.join(quota_policies())} do; "
            "a fixed policy's window is its --window option)"]


#: File stem -> figure function, in the order the report writes them.
FIGURES = {
    "training": training_figure,
    "ranks": ranks_figure,
    "time": time_figure,
    "divergence": divergence_figure,
    "round_times": round_times_figure,
    "cadence": cadence_figure,
}


def _bundled_fonts() -> None:
    """Make matplotlib's own fonts (mpl-data/fonts/ttf) known to its font manager if its cache lacks them.

    A font cache (``~/.cache/matplotlib/fontlist-*.json``) written by another
    matplotlib install can list only the system's fonts; log-scale tick labels are
    mathtext, whose STIX and Computer Modern fonts ship with matplotlib, and each
    missing one printed "findfont: Font family ['STIXGeneral'] not found". Added in
    this process only (the cache file is not rewritten); other warnings are untouched.
    """
    import matplotlib
    from matplotlib import font_manager

    known = {os.path.realpath(f.fname) for f in font_manager.fontManager.ttflist}
    for path in sorted((Path(matplotlib.get_data_path()) / "fonts" / "ttf").glob("*.ttf")):
        if os.path.realpath(path) not in known:
            font_manager.fontManager.addfont(str(path))


def write_plots(runs: Sequence[Run], out_dir: str | os.PathLike, dpi: int = 100) -> list[Path]:
    """Draw every figure that has data and save it as ``out_dir/<name>.png``.

    Each file is written under a temporary name and renamed, so a reader never
    sees half a PNG. Returns the paths written, in `FIGURES` order.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _bundled_fonts()
    written = []
    for name, draw in FIGURES.items():
        fig = draw(runs)
        if fig is None:
            continue
        path = out / f"{name}.png"
        tmp = out / f".{name}.png.tmp-{os.getpid()}"
        try:
            fig.savefig(tmp, format="png", dpi=dpi)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(path)
    return written
