"""Which tests start processes, and what the session's launchers cost (a pytest plugin; ``tests/conftest.py``
registers it for every run of the suite).

- At collection, every test whose code, or a tests' helper or fixture it reaches, names one of
  :data:`LAUNCH_NAMES` gets the ``launch`` marker; the tests of :data:`QUICK_RUNS` get ``quick``.
  ``tests/run.sh --quick`` runs ``-m "quick or not (slow or launch)"``: the tests that start no
  process, and one short run per front end.
- :func:`tests.conftest.launch_argv` records each launcher a test starts; the summary says how many
  (one line), and names any test that started one without the ``launch`` marker (a helper this
  module does not know: add its name to :data:`LAUNCH_NAMES`).
- With ``FLODL_TEST_CPU_LOG=FILE``, each test's wall and CPU seconds are appended to FILE
  (``nodeid<TAB>wall_s<TAB>cpu_s``; the CPU of the processes it started included): on a machine
  other jobs share, the CPU seconds say what a test costs where the wall time does not.
"""

from __future__ import annotations

import importlib
import inspect
import os
import resource
import time

import pytest

#: Names whose use in a test (or in a tests' helper or fixture it reaches) means the test starts a
#: process: a launcher (``tests/conftest.py``'s helpers) or any subprocess (a script run without one).
LAUNCH_NAMES = frozenset({"run_flodl", "fork_flodl", "fork_python", "start_flodl", "launch_argv", "launch_command", "subprocess", "Popen"})

#: The one short run per front end that ``tests/run.sh --quick`` keeps beside the tests that start
#: nothing: the CLI (the session's run A: 5 epochs at 2 ranks), ``fit`` and ``Averager`` (the
#: examples, at 2 ranks).
QUICK_RUNS = (
    "tests/cli/test_end_to_end.py::test_train_digits[2]",
    "tests/api/test_examples.py::test_trainer_api_example[2]",
    "tests/api/test_examples.py::test_own_loop_example[2]",
)


#: The modules of helpers a test may import inside itself (looked up by name when its module's globals
#: lack one).
SHARED_HELPERS = ("tests._runs", "tests.conftest")


def _names(code) -> set[str]:
    """Every global or attribute name a code object (and the code nested in it) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


def starts_processes(func, seen: set | None = None) -> bool:
    """Whether ``func`` names one of `LAUNCH_NAMES`, itself or through the tests' functions it calls."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    code = getattr(func, "__code__", None)
    seen = set() if seen is None else seen
    if code is None or code in seen:
        return False
    seen.add(code)
    names = _names(code)
    if names & LAUNCH_NAMES:
        return True
    scope = getattr(func, "__globals__", {})
    shared = [importlib.import_module(m) for m in SHARED_HELPERS]
    # a name not in the module's globals may be a shared helper imported inside the test
    found = [scope[name] if name in scope else next((getattr(m, name) for m in shared if hasattr(m, name)), None)
             for name in names]
    found += [m for c in found if inspect.isclass(c) and c.__module__.startswith("tests") for m in vars(c).values()]
    return any(inspect.isfunction(f) and f.__module__.startswith("tests") and starts_processes(f, seen)
               for f in found)


def _item_starts_processes(item) -> bool:
    if starts_processes(getattr(item, "function", None)):
        return True
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(d.func.__module__.startswith("tests") and starts_processes(d.func)
               for name in getattr(item, "fixturenames", ()) for d in defs.get(name, ()))


def pytest_collection_modifyitems(config, items):
    """The ``launch`` marker on every test that starts a process, ``quick`` on `QUICK_RUNS`."""
    for item in items:
        if _item_starts_processes(item):
            item.add_marker("launch")
        if item.nodeid in QUICK_RUNS:
            item.add_marker("quick")


class Launches:
    """The launchers this session started: per test, the rank count of each."""

    def __init__(self):
        self.item = None
        self.by_test: dict[str, list[int]] = {}
        self.unmarked: set[str] = set()

    def record(self, n: int) -> None:
        """A launcher of ``n`` ranks, started by the running test (outside a test: not counted)."""
        item = self.item
        if item is None:
            return
        if item.get_closest_marker("launch") is None:
            self.unmarked.add(item.nodeid)
        self.by_test.setdefault(item.nodeid, []).append(n)


LAUNCHES = Launches()


def _cpu_s() -> float:
    """CPU seconds used so far by this process and by every child it has waited for (a launcher's ranks too)."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                               resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    LAUNCHES.item = item
    t0, c0 = time.monotonic(), _cpu_s()
    try:
        yield
    finally:
        LAUNCHES.item = None
        log = os.environ.get("FLODL_TEST_CPU_LOG")
        if log:
            with open(log, "a") as fh:
                fh.write(f"{item.nodeid}\t{time.monotonic() - t0:.2f}\t{_cpu_s() - c0:.2f}\n")


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: the controller adds them up
        session.config.workeroutput["flodl_launches"] = (LAUNCHES.by_test, sorted(LAUNCHES.unmarked))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's
def pytest_testnodedown(node, error):
    by_test, unmarked = getattr(node, "workeroutput", {}).get("flodl_launches", ({}, []))
    LAUNCHES.by_test.update(by_test)
    LAUNCHES.unmarked.update(unmarked)


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """One line: the launchers started, by how many tests, per folder (and any test the marker missed).
    Under ``--with-mpi``, one line for the MPI instead of pytest-mpi's section of ~30 (its build options)."""
    mpi = [p for p in terminalreporter.config.pluginmanager.get_plugins() if type(p).__name__ == "MPIPlugin"]
    if any(getattr(p, "_is_testing_mpi", False) for p in mpi):
        for plugin in mpi:
            plugin._is_testing_mpi = False  # its summary's only switch (it prints that section when set)
        from mpi4py import MPI

        vendor, version = MPI.get_vendor()
        terminalreporter.write_line(f"MPI: {vendor} {'.'.join(map(str, version))}, {MPI.COMM_WORLD.size} ranks")
    by_test = LAUNCHES.by_test
    if by_test:
        folders: dict[str, int] = {}
        for nodeid, ns in by_test.items():
            folder = nodeid.split("/")[1] if nodeid.count("/") > 1 else "tests"
            folders[folder] = folders.get(folder, 0) + len(ns)
        per = ", ".join(f"{k} {v}" for k, v in sorted(folders.items(), key=lambda kv: -kv[1]))
        terminalreporter.write_line(f"launchers started: {sum(map(len, by_test.values()))} by {len(by_test)} tests, "
                                    f"{sum(map(sum, by_test.values()))} ranks in all ({per})")
    if LAUNCHES.unmarked:
        terminalreporter.write_line("started a launcher without the launch marker (add its helper to "
                                    "tests/_launches.py LAUNCH_NAMES): " + " ".join(sorted(LAUNCHES.unmarked)))
