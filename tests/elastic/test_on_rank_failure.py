"""``--on-rank-failure``: the default and the refusals, decided from the config and the launcher's environment
(`flodl_mpi.training.recovery.resolve_on_rank_failure`); no MPI started."""

from __future__ import annotations

import pytest

from flodl_mpi.config import TrainConfig
from flodl_mpi.errors import InputError
from flodl_mpi.runtime import elastic
from flodl_mpi.training import recovery

pytestmark = pytest.mark.quick


@pytest.fixture
def ulfm(monkeypatch):
    """As under ``mpiexec --with-ft ulfm`` with the Open MPI wheel."""
    monkeypatch.setattr(elastic, "fault_tolerance", lambda: None)


def test_the_default_shrinks_where_it_can(ulfm):
    """Under Open MPI with --with-ft ulfm the default is shrink (issue 21 item 2), as asked explicitly."""
    for cfg in (TrainConfig(), TrainConfig(on_rank_failure="shrink")):
        mode, note = recovery.resolve_on_rank_failure(cfg)
        assert mode == "shrink" and note.startswith("on a rank's death: shrink (Open MPI with --with-ft ulfm)")


def test_an_explicit_stop_is_honoured(ulfm):
    assert recovery.resolve_on_rank_failure(TrainConfig(on_rank_failure="stop")) == ("stop", None)


@pytest.mark.parametrize(
    "options, named",
    [
        ({"policy": "async"}, "--policy async"),
        ({"outer": "slowmo"}, "--outer slowmo"),
        ({"node_reduce": "shm"}, "--node-reduce shm"),
        ({"hierarchical": "on"}, "--hierarchical on"),
        ({"wire": "int8-delta"}, "--wire int8-delta"),
    ],
)
def test_shrink_is_refused_for_what_it_is_not_built_for(ulfm, options, named):
    with pytest.raises(InputError) as exc:
        recovery.resolve_on_rank_failure(TrainConfig(on_rank_failure="shrink", **options))
    assert str(exc.value) == f"--on-rank-failure shrink: shrinking is not built for {named}: use --on-rank-failure stop"
    assert exc.value.exit_code == 2
    # the default falls back to stop, and says why in train.log
    mode, note = recovery.resolve_on_rank_failure(TrainConfig(**options))
    assert mode == "stop" and named in note


def test_the_python_api_is_refused(ulfm):
    with pytest.raises(InputError, match=r"shrinking is not built for the Python API \(fit, the Averager\)"):
        recovery.resolve_on_rank_failure(TrainConfig(on_rank_failure="shrink"), api=True)
    assert recovery.resolve_on_rank_failure(TrainConfig(), api=True)[0] == "stop"


def test_without_fault_tolerance_the_default_is_stop_silently(monkeypatch):
    line = "Open MPI was launched without fault tolerance: start the job with 'mpiexec --with-ft ulfm', or ..."
    monkeypatch.setattr(elastic, "fault_tolerance", lambda: line)
    assert recovery.resolve_on_rank_failure(TrainConfig()) == ("stop", None)  # today's behaviour, nothing to say
    with pytest.raises(InputError, match="^--on-rank-failure shrink: Open MPI was launched without fault"):
        recovery.resolve_on_rank_failure(TrainConfig(on_rank_failure="shrink"))


def test_a_bad_value_is_refused():
    with pytest.raises(ValueError, match="^--on-rank-failure .respawn.: must be one of stop, shrink$"):
        TrainConfig(on_rank_failure="respawn")
