"""report --out with a matplotlib font cache that lacks matplotlib's own fonts: no findfont warnings."""

import logging
import os

import pytest

pytest.importorskip("matplotlib")


def test_a_font_cache_without_the_bundled_fonts_prints_no_findfont_warning(caplog, tmp_path):
    import matplotlib
    from matplotlib import font_manager
    from matplotlib.figure import Figure

    from flodl_mpi.cli.plots import _bundled_fonts

    fm = font_manager.fontManager
    saved = list(fm.ttflist)
    data = os.path.realpath(os.path.join(matplotlib.get_data_path(), "fonts"))
    try:  # as a cache written by another install: system fonts only
        fm.ttflist[:] = [f for f in saved if not os.path.realpath(f.fname).startswith(data)]
        fm._findfont_cached.cache_clear()

        def draw(name):
            fig = Figure()
            fig.add_subplot().semilogy([1, 10, 100])  # log ticks: mathtext
            fig.savefig(tmp_path / name)

        with caplog.at_level(logging.WARNING, logger="matplotlib.font_manager"):
            draw("before.png")
        assert any("STIXGeneral" in r.getMessage() for r in caplog.records)  # the fault is reproduced
        caplog.clear()
        _bundled_fonts()
        with caplog.at_level(logging.WARNING, logger="matplotlib.font_manager"):
            draw("after.png")
        assert [r.getMessage() for r in caplog.records if "findfont" in r.getMessage()] == []
    finally:
        fm.ttflist[:] = saved
        fm._findfont_cached.cache_clear()
