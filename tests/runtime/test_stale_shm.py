"""MPICH shared memory left by an earlier Slurm step under this step's name (flodl_mpi/runtime/stale_shm.py).

No Slurm and no MPI needed: the step is an environment, ``/dev/shm`` a temporary
directory. The real thing (a slab left by killed ranks, and a job that starts in
spite of it) is checked under a real Slurm by ``tests/slurm/check.sh``.
"""

from __future__ import annotations

import os
import time

import pytest

from flodl_mpi.cli import main as cli
from flodl_mpi.runtime import stale_shm
from flodl_mpi.runtime.stale_shm import clear_stale_segments, fnv1a32, kvs_name, process_start_time, segment_prefixes

STEP = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "PMI_RANK": "0", "PMI_JOBID": "1.0", "PMI_FD": "11"}


def test_fnv1a32_reference_values():
    # Published FNV-1a 32-bit test vectors (Fowler/Noll/Vo reference code).
    assert fnv1a32("") == 0x811C9DC5
    assert fnv1a32("a") == 0xE40C292C
    assert fnv1a32("foobar") == 0xBF9CF968


def test_names_match_what_mpich_made_under_srun():
    # Names MPICH 5.0.2 (the wheel) left in /dev/shm for jobs 1, 3 and 4, step 0, under
    # `srun --mpi=pmi2` on Slurm 22.05 (ranks killed, so the slabs stayed).
    assert segment_prefixes("1.0") == ("mpich_shm_eb421bf2_", "mpich_vci_eb421bf2_")
    assert segment_prefixes("3.0")[0] == "mpich_shm_c141a9dc_"
    assert segment_prefixes("4.0")[0] == "mpich_shm_a620f805_"


@pytest.mark.parametrize("env, expected", [
    (STEP, "1.0"),
    ({**STEP, "PMI_JOBID": "12.3"}, "12.3"),  # Slurm's own name wins
    ({k: v for k, v in STEP.items() if k != "PMI_JOBID"} | {"SLURM_STEP_ID": "2"}, "1.2"),
    ({**STEP, "HYDI_CONTROL_FD": "5"}, None),  # Hydra inside an allocation names its KVS uniquely
    ({**STEP, "MPI_LOCALNRANKS": "2"}, None),
    ({k: v for k, v in STEP.items() if k not in ("PMI_RANK", "PMI_JOBID", "PMI_FD")} | {"PMIX_RANK": "0"}, None),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, None),  # not a Slurm step
    ({}, None),
])
def test_kvs_name(env, expected):
    assert kvs_name(env) == expected


def _slab(shm, name):
    path = shm / name
    path.write_bytes(b"\0" * 64)
    return path


def _later():
    """A step start after every file made so far (their times are before it)."""
    return time.time() + 1.0


def test_removes_only_stale_slabs_of_this_step(tmp_path):
    stale = _slab(tmp_path, "mpich_shm_eb421bf2_0")
    stale_vci = _slab(tmp_path, "mpich_vci_eb421bf2_1")
    other_job = _slab(tmp_path, "mpich_shm_c141a9dc_0")  # job 3's: not ours to judge
    other_file = _slab(tmp_path, "sm_segment.vm.0.13c00000.0")
    found = clear_stale_segments(STEP, shm_dir=tmp_path, step_start=_later())
    assert [(s.path, s.removed, s.error) for s in found] == [(stale, True, None), (stale_vci, True, None)]
    assert not stale.exists() and not stale_vci.exists()
    assert other_job.exists() and other_file.exists()


def test_keeps_a_slab_made_by_this_step(tmp_path):
    # A faster rank of the same step created it after the step began: in use.
    start = time.time() - 10
    fresh = _slab(tmp_path, "mpich_shm_eb421bf2_0")
    assert clear_stale_segments(STEP, shm_dir=tmp_path, step_start=start) == []
    assert fresh.exists()
    # The status-change time counts too: an old modification time does not make it stale.
    os.utime(fresh, (start - 3600, start - 3600))
    assert clear_stale_segments(STEP, shm_dir=tmp_path, step_start=start) == []
    assert fresh.exists()


def test_outside_a_slurm_pmi_step_nothing_is_touched(tmp_path):
    stale = _slab(tmp_path, "mpich_shm_eb421bf2_0")
    for env in ({}, {**STEP, "HYDI_CONTROL_FD": "5"}):
        assert clear_stale_segments(env, shm_dir=tmp_path, step_start=_later()) == []
    assert stale.exists()


def test_a_slab_that_cannot_be_removed_is_reported(tmp_path):
    # A directory stands in for another user's slab (unlink fails, also for root).
    blocked = tmp_path / "mpich_shm_eb421bf2_0"
    blocked.mkdir()
    [seg] = clear_stale_segments(STEP, shm_dir=tmp_path, step_start=_later())
    assert seg.path == blocked and not seg.removed and seg.error and seg.uid == os.getuid()


def test_step_start_defaults_to_the_process_start():
    # Outside slurmstepd, the step starts with this process: before now, after boot.
    start = process_start_time()
    assert start is not None and time.time() - 3600 * 24 * 365 < start <= time.time()
    assert process_start_time(999_999_999) is None  # no such process


def test_cli_removes_and_says_so(tmp_path, monkeypatch, capsys):
    stale = _slab(tmp_path, "mpich_shm_eb421bf2_0")
    blocked = tmp_path / "mpich_vci_eb421bf2_0"
    blocked.mkdir()
    monkeypatch.setattr(stale_shm, "SHM_DIR", tmp_path)
    monkeypatch.setattr(stale_shm, "_step_start_time", _later)
    for k, v in STEP.items():
        monkeypatch.setenv(k, v)
    cli._clear_stale_shm()
    err = capsys.readouterr().err
    assert not stale.exists()
    assert f"flodl-mpi: removed {stale}: MPICH shared memory left by an earlier Slurm step" in err
    assert f"flodl-mpi: warning: cannot remove {blocked}" in err and f"rm {blocked}" in err


def test_cli_leaves_other_mpis_alone(tmp_path, monkeypatch, capsys):
    # The names are MPICH's: under Open MPI (srun --mpi=pmix) nothing is looked at.
    stale = _slab(tmp_path, "mpich_shm_eb421bf2_0")
    monkeypatch.setattr(stale_shm, "SHM_DIR", tmp_path)
    monkeypatch.setattr(stale_shm, "_step_start_time", _later)
    for k, v in STEP.items():
        monkeypatch.setenv(k, v)
    cli._clear_stale_shm("Open MPI v5.0.11")
    assert stale.exists() and capsys.readouterr().err == ""
    cli._clear_stale_shm("MPICH Version: 5.0.2")
    assert not stale.exists()
