"""The explanation pages' figures, drawn with matplotlib (Agg) when the site builds.

A Sphinx extension (``conf.py`` lists it): at ``builder-inited`` it writes each figure of :data:`FIGURES`
to ``docs/_generated/<name>.png``, which the pages show with ``.. image::``. What a figure shows is computed
by the package's own code where it has one (the masses: :func:`flodl_mpi.protocol.realized_work.relative_masses`;
the quotas: :class:`flodl_mpi.policy.elche.ElChe`), so a change there changes the picture.
"""

from __future__ import annotations

from pathlib import Path

OUT = Path(__file__).resolve().parent / "_generated"


def masses(path: Path) -> None:
    """Each rank's share of the consensus, ``m_r / Σ m``, for steps (12, 6, 3, 0) and four gammas."""
    import matplotlib.pyplot as plt

    from flodl_mpi.protocol.realized_work import relative_masses

    steps = [12, 6, 3, 0]
    gammas = [1.0, 0.5, 0.0, -1.0]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=110)
    width = 0.2
    for k, gamma in enumerate(gammas):
        rel = relative_masses(steps, gamma)
        share = [m / sum(rel) for m in rel]
        ax.bar([r + (k - 1.5) * width for r in range(len(steps))], share, width, label=f"gamma = {gamma:g}")
    ax.set_xticks(range(len(steps)), [f"rank {r}\n{n} steps" for r, n in enumerate(steps)])
    ax.set_ylabel("share of the consensus")
    ax.set_title("weight = steps ** gamma, divided by the total (an idle rank: 0)")
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def timelines(path: Path) -> None:
    """Two ranks, rank 1 twice as slow, over the same wall time: sync, cadence and async."""
    import matplotlib.pyplot as plt

    from flodl_mpi.policy.elche import ElChe

    ms = [10.0, 20.0]  # ms per batch
    round_ms = 8.0
    anchor = 4
    balancer = ElChe(world_size=2, anchor=anchor)
    balancer.observe(ms)
    q = balancer.quotas()
    horizon = 200.0
    fig, axes = plt.subplots(3, 1, figsize=(8, 4.6), dpi=110, sharex=True)
    colors = {"compute": "#4c72b0", "wait": "#dddddd", "round": "#dd8452"}

    def lane(ax, y, spans):
        for kind, start, length in spans:
            ax.broken_barh([(start, length)], (y - 0.35, 0.7), color=colors[kind], edgecolor="white", linewidth=0.5)

    # sync: a round after every batch; the fast rank waits for the slow one each time
    ax = axes[0]
    t = 0.0
    lanes = [[], []]
    while t < horizon:
        for r in range(2):
            lanes[r].append(("compute", t, ms[r]))
            if ms[r] < max(ms):
                lanes[r].append(("wait", t + ms[r], max(ms) - ms[r]))
            lanes[r].append(("round", t + max(ms), round_ms))
        t += max(ms) + round_ms
    for r in range(2):
        lane(ax, r, lanes[r])
    ax.set_title("sync: a round after every batch (rank 0 waits for rank 1)", fontsize=9, loc="left")
    # cadence: quotas make both ranks arrive together
    ax = axes[1]
    t = 0.0
    lanes = [[], []]
    while t < horizon:
        for r in range(2):
            for b in range(q[r]):
                lanes[r].append(("compute", t + b * ms[r], ms[r]))
            lanes[r].append(("round", t + q[r] * ms[r], round_ms))
        t += q[1] * ms[1] + round_ms
    for r in range(2):
        lane(ax, r, lanes[r])
    ax.set_title(f"cadence: quotas {q[0]} and {q[1]} batches (anchor {anchor}): both arrive together",
                 fontsize=9, loc="left")
    # async: the round runs in the bridge thread while the next window trains
    ax = axes[2]
    lanes = [[], []]
    window = q[1] * ms[1]
    t = 0.0
    while t < horizon:
        for r in range(2):
            for b in range(q[r]):
                lanes[r].append(("compute", t + b * ms[r], ms[r]))
            lanes[r].append(("round", t + window, round_ms))
        t += window
    for r in range(2):
        lane(ax, r, [s for s in lanes[r] if s[0] == "compute"])
        ax.broken_barh([(s[1], s[2]) for s in lanes[r] if s[0] == "round"], (r + 0.38, 0.22), color=colors["round"])
    ax.set_title("async: the round (thin bar, bridge thread) runs while the next window trains",
                 fontsize=9, loc="left")
    for ax in axes:
        ax.set_yticks([0, 1], ["rank 0", "rank 1 (2x slower)"])
        ax.set_ylim(-0.6, 1.7)
        ax.invert_yaxis()
    axes[-1].set_xlim(0, horizon)
    axes[-1].set_xlabel("wall time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["training a batch", "waiting for a peer", "round"], loc="lower center", ncol=3,
               frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def favicon(path: Path) -> None:
    """The site's icon (conf.py's html_favicon): without one the browser's request for /favicon.ico is a 404."""
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(0.32, 0.32), dpi=100)
    fig.patch.set_facecolor("#4c72b0")
    fig.savefig(path, facecolor=fig.get_facecolor())
    plt.close(fig)
    # and /favicon.ico at the site's root (conf.py's html_extra_path), which browsers ask for regardless
    from PIL import Image

    (path.parent / "extra").mkdir(exist_ok=True)
    Image.open(path).save(path.parent / "extra" / "favicon.ico")


#: name -> the function that draws it into a path
FIGURES = {"masses": masses, "timelines": timelines, "favicon": favicon}


def draw_all(out: Path = OUT) -> list[Path]:
    """Draw every figure of :data:`FIGURES` into ``out``; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(exist_ok=True)
    written = []
    for name, draw in FIGURES.items():
        path = out / f"{name}.png"
        draw(path)
        written.append(path)
    return written


def setup(app):
    draw_all()  # at load, before the config's html_extra_path (favicon.ico) is read
    return {"parallel_read_safe": True, "parallel_write_safe": True}
