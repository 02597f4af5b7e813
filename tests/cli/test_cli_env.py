"""The CLI checks its environment variables as the API does, before MPI starts."""

import time

import pytest

from flodl_mpi.errors import EXIT_INPUT
from flodl_mpi.runtime.session import START_TIMEOUT_VAR, start_timeout
from tests.conftest import run_flodl


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_a_bad_start_timeout_is_refused_by_the_cli_in_the_apis_words(tmp_path, value):
    """``FLODL_MPI_START_TIMEOUT=abc`` was ignored by the CLI (exit 0); now: exit 2, the API's one line, once,
    within the time bound, and no run dir made (refused before MPI starts)."""
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
