"""flodl_mpi.runtime.world's agreed setup step in one process: a fake communicator plays the other ranks.

`agree` is what turns a refusal on any rank into the same one line on every rank; the multi-rank proof
(real ranks, one failing) is tests/transport/test_bridge.py::test_agree_turns_one_rank_failure_into_an_error_everywhere
(under ``--with-mpi``), and the launched "every rank, one line, exit 2" is tests/cli/test_cli.py's. Here:
each way the message is composed, and the watchdog's bracketing, without starting MPI.
"""

from __future__ import annotations

import pytest

from flodl_mpi.errors import CohortError, InputError
from flodl_mpi.runtime.world import agree


class FakeComm:
    """Rank ``rank`` of a world whose other ranks' step outcomes are ``others`` (rank -> error tuple or None)."""

    def __init__(self, rank: int, size: int, others: dict[int, tuple[str, str] | None] | None = None):
        self.rank, self.size, self.others, self.gathers = rank, size, others or {}, 0

    def allgather(self, value):
        self.gathers += 1
        return [value if r == self.rank else self.others.get(r) for r in range(self.size)]


class FakeWatchdog:
    def __init__(self):
        self.events = []

    def begin(self, what):
        self.events.append(("begin", what))

    def round_started(self, what):
        self.events.append(("done", what))

    def round_finished(self):
        self.events.append(("finished",))


def _refuse():
    raise ValueError("--data 'x.h5': no such file\nsecond line dropped")


def test_a_step_that_passes_everywhere_returns_this_ranks_result_after_one_gather():
    comm = FakeComm(1, 3)
    assert agree(comm, "data", lambda: 41 + comm.rank) == 42
    assert comm.gathers == 1  # one collective, on every rank alike


def test_a_refusal_on_every_rank_alike_is_its_one_line_unprefixed():
    comm = FakeComm(0, 3, {1: ("input", "--data 'x.h5': no such file"), 2: ("input", "--data 'x.h5': no such file")})
    with pytest.raises(InputError) as err:
        agree(comm, "data", _refuse)
    assert str(err.value) == "--data 'x.h5': no such file"  # first line only, no rank list


def test_a_refusal_on_some_ranks_names_them_and_reaches_a_rank_that_passed():
    comm = FakeComm(0, 4, {2: ("input", "no room"), 3: ("input", "no room")})
    with pytest.raises(InputError) as err:
        agree(comm, "run dir", lambda: None)  # this rank passed: it raises what the others said
    assert str(err.value) == "rank(s) 2, 3: no room"


def test_a_step_only_rank_0_does_says_its_line_without_ranks():
    comm = FakeComm(1, 2, {0: ("input", "the run dir is in use")})
    with pytest.raises(InputError) as err:
        agree(comm, "lock", lambda: None, name_ranks=False)
    assert str(err.value) == "the run dir is in use"


def test_different_refusals_are_each_named_with_their_rank():
    comm = FakeComm(1, 3, {0: ("input", "shape (3,) differs"), 2: ("input", "dtype differs")})
    with pytest.raises(InputError) as err:
        agree(comm, "model", lambda: (_ for _ in ()).throw(OSError("disk gone")))
    assert str(err.value) == "rank 0: shape (3,) differs; rank 1: disk gone; rank 2: dtype differs"


def test_a_bug_anywhere_is_a_cohort_error_that_names_the_step():
    comm = FakeComm(0, 2, {1: ("input", "bad file")})

    def bug():
        raise KeyError("w")

    with pytest.raises(CohortError) as err:  # not every failure was bad input: a cohort error
        agree(comm, "bind", bug)
    assert str(err.value) == "rank 0: bind: KeyError: 'w'; rank 1: bad file"
    assert not isinstance(err.value, InputError)


def test_an_error_whose_message_says_it_all_is_that_line_alone():
    class Full(RuntimeError):
        plain = True

    comm = FakeComm(0, 1)

    def full():
        raise Full("/runs/x: no space left on device")

    with pytest.raises(CohortError, match=r"^/runs/x: no space left on device$"):
        agree(comm, "metrics writer", full)


def test_the_watchdog_sees_the_step_begin_this_ranks_part_end_and_the_wait_finish():
    watchdog, comm = FakeWatchdog(), FakeComm(0, 2)
    agree(comm, "data", lambda: None, watchdog)
    assert watchdog.events == [("begin", "setup step 'data'"), ("done", "setup step 'data'"), ("finished",),
                               ("begin", "setup after setup step 'data'")]
