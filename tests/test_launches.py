"""The suite's own plugin (tests/_launches.py): which tests start processes is found from their code."""

from __future__ import annotations

import pytest

from tests import _launches


#: Sample tests, compiled apart so that this module's own tests name no launcher (and stay in --quick).
SAMPLES = """
import subprocess
from tests.conftest import run_flodl


def _helper_that_launches():
    return run_flodl(2, "train")


def _helper_that_does_not():
    return sum(range(3))


class _Runs:
    def __init__(self):
        subprocess.run(["true"], check=False)


def direct():
    run_flodl(2, "train")


def through_a_helper():
    return _helper_that_launches()


def in_a_comprehension():
    return [_helper_that_launches() for _ in range(2)]


def through_a_class():
    return _Runs()


def importing_it_locally():
    from tests.conftest import start_flodl

    return start_flodl


def a_shared_run_imported_inside(tmp_path_factory):
    from tests._runs import session_run_a

    return session_run_a(tmp_path_factory)


def plain():
    return _helper_that_does_not() + len("run_flodl")  # a string is no call
"""


@pytest.fixture(scope="module")
def samples():
    scope = {"__name__": "tests.launches_samples"}
    exec(compile(SAMPLES, "<samples>", "exec"), scope)
    return scope


def test_a_test_that_names_a_launcher_helper_starts_processes(samples):
    for name in ("direct", "through_a_helper", "in_a_comprehension", "through_a_class", "importing_it_locally",
                 "a_shared_run_imported_inside"):
        assert _launches.starts_processes(samples[name]), name


def test_a_test_that_names_none_starts_nothing(samples):
    assert not _launches.starts_processes(samples["plain"])
    assert not _launches.starts_processes(samples["_helper_that_does_not"])


def test_the_quick_runs_are_tests_of_the_suite():
    """Each of QUICK_RUNS names a test that exists and starts a run (a renamed one would drop out of --quick
    silently)."""
    import importlib

    for nodeid in _launches.QUICK_RUNS:
        path, name = nodeid.split("::")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        func = getattr(module, name.split("[")[0])
        assert _launches.starts_processes(func), nodeid
        marks = [m for m in getattr(func, "pytestmark", []) if m.name == "parametrize"]
        if "[" in name:
            values = [str(v) for m in marks for v in m.args[1]]
            assert name.split("[")[1].rstrip("]") in values, nodeid


@pytest.mark.parametrize("marker", ["launch", "quick"])
def test_the_markers_are_declared(request, marker):
    assert any(line.split(":")[0].strip() == marker for line in request.config.getini("markers"))
