"""flodl-mpi report --tensorboard: the metrics read back from the event files."""

from __future__ import annotations

import numpy as np
import pytest

from flodl_mpi.cli.report import main
from flodl_mpi.outputs.run_reader import load_run
from tests._runs import write_synthetic

pytest.importorskip("tensorboard", reason="tensorboard is an optional extra")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_event_files_hold_the_metrics(tmp_path, capsys):
    run_dir = write_synthetic(tmp_path / "A", world_size=2, rounds=20, epochs=3)
    assert main([str(run_dir), "--no-plots", "--tensorboard", str(tmp_path / "tb")]) == 0
    assert "tensorboard --logdir" in capsys.readouterr().out
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb" / "A"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"epoch/test_accuracy", "epoch/throughput_rank1", "round/divergence_rank0", "round/allreduce_ms"} <= tags
    events = acc.Scalars("epoch/test_accuracy")
    assert [e.step for e in events] == [1, 2, 3]
    np.testing.assert_allclose([e.value for e in events], [0.5, 0.9, 0.8], rtol=1e-6)   # float32 in the file
    div = acc.Scalars("round/divergence_rank1")
    run = load_run(run_dir)
    np.testing.assert_allclose([e.value for e in div], run.column("rounds", "divergence")[:, 1], rtol=1e-6)
