"""metrics.h5's per-round bus bandwidth of the params reduce (issue 25 item 4): ``rounds/busbw_gbs`` is
``link_bytes / link_ms · 2(W − 1)/W`` (nccl-tests' busbw) recomputed from the same file's other columns,
and ``flodl-mpi report`` shows its median."""

import h5py
import numpy as np
import pytest

from flodl_mpi.cli.report import format_comparison, format_summary, summarize
from flodl_mpi.outputs.run_reader import load_run
from flodl_mpi.protocol.round_profile import bus_bandwidth
from tests._runs import session_run_a, write_synthetic


@pytest.mark.slow
def test_busbw_is_bytes_over_time_times_2_w_minus_1_over_w_in_a_real_run(tmp_path_factory):
    run_dir = session_run_a(tmp_path_factory)  # 2 ranks on one host: the node's shared-memory reduce
    with h5py.File(run_dir / "metrics.h5", "r") as f:
        r = f["rounds"]
        nbytes, ranks = r["link_bytes"][()], r["link_ranks"][()]
        ms, busbw, skipped = r["link_ms"][()], r["busbw_gbs"][()], r["skipped"][()]
    moved = ~skipped
    assert moved.sum() > 10
    assert (ranks[moved] == 2).all()
    assert len(set(nbytes[moved].tolist())) == 1 and nbytes[moved][0] > 0  # planned once: the same every round
    want = nbytes[moved, None] / (ms[moved] / 1e3) / 1e9 * (2 * (ranks[moved, None] - 1) / ranks[moved, None])
    assert np.isfinite(busbw[moved]).all()
    np.testing.assert_allclose(busbw[moved], want, rtol=1e-12)
    assert np.isnan(busbw[skipped]).all()  # nothing moved: no bandwidth
    s = summarize(load_run(run_dir))
    assert s["busbw"] == pytest.approx(float(np.median(busbw[moved, 0])), rel=1e-12)


def test_bus_bandwidth_by_hand():
    # 64 MB in 0.5 s is 0.128 GB/s of algbw; at 2 ranks 2(W-1)/W = 1, at 4 ranks 1.5
    assert bus_bandwidth(64e6, 500.0, 2) == pytest.approx(0.128, rel=1e-15)
    assert bus_bandwidth(64e6, 500.0, 4) == pytest.approx(0.192, rel=1e-15)
    for args in ((0, 500.0, 2), (64e6, 500.0, 1), (64e6, 0.0, 2), (64e6, float("nan"), 2)):
        assert np.isnan(bus_bandwidth(*args))


def test_report_shows_the_median_busbw(tmp_path):
    a = load_run(write_synthetic(tmp_path / "a"))  # 8 MB over 2 ranks in 20 ms: 0.4 GB/s every round
    text = format_summary(a)
    line = next(x for x in text.splitlines() if x.strip().startswith("link"))
    assert "busbw 0.400 GB/s" in line and "8.0 MB per rank over 2 ranks" in line, line
    table = format_comparison([a, a])
    row = next(x for x in table.splitlines() if x.startswith("bus bandwidth"))
    assert row.split()[-2:] == ["0.400", "0.400"]
