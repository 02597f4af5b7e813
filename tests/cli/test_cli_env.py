"""The CLI checks its environment variables as the API does, before MPI starts."""

import time

import pytest

from flodl_mpi.errors import EXIT_INPUT, InputError
from flodl_mpi.runtime.session import START_TIMEOUT_VAR, start_timeout
from tests.conftest import run_flodl


BAD_VALUES = ["abc", "0", "-5", "inf", "nan"]


def test_a_bad_start_timeout_is_refused_by_the_cli_in_the_apis_words(tmp_path):
    """``FLODL_MPI_START_TIMEOUT=abc`` was ignored by the CLI (exit 0); now: exit 2, the API's one line, once,
    within the time bound, and no run dir made (refused before MPI starts).

    Was one launch per value of `BAD_VALUES`: the launch is now one ("abc"), and the other values are
    refused by the same check in one process (`test_every_bad_start_timeout_is_refused_in_the_apis_words`)."""
    value = "abc"
    with pytest.raises(Exception) as api:  # the API's words, the reference
        start_timeout({START_TIMEOUT_VAR: value})
    t0 = time.monotonic()
    proc = run_flodl(2, "train", "--epochs", "1", "--run-dir", str(tmp_path / "r"), timeout=120,
                     env={START_TIMEOUT_VAR: value})
    assert time.monotonic() - t0 < 120
    assert proc.returncode == EXIT_INPUT, proc.stderr[-2000:]
    assert proc.stderr.count(str(api.value)) == 1
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value", BAD_VALUES)
def test_every_bad_start_timeout_is_refused_in_the_apis_words(value):
    """Was test_a_bad_start_timeout_is_refused_by_the_cli_in_the_apis_words[value] (a launch each): the check
    the CLI and the API share refuses each value with one line naming the variable and the value (the launch
    above shows the CLI prints it once and exits 2)."""
    with pytest.raises(InputError) as info:
        start_timeout({START_TIMEOUT_VAR: value})
    assert str(info.value) == f"flodl-mpi: error: {START_TIMEOUT_VAR}={value!r}: must be a number of seconds > 0"
    assert start_timeout({START_TIMEOUT_VAR: "30"}) == 30.0  # a good value is taken as given
