"""The 2-rank quarantine run that ``test_non_finite`` and ``test_quarantine_loss`` share: one launch, two faults.

``mpiexec -n 2 flodl-mpi train --epochs 1 --batch-size 64`` (1437 digits samples: 23 batches, 12 rounds at
window 1) with rank 1's parameters made NaN before round `NAN_ROUND` (the ``nan`` fault, tests/faults.py) and
its losses NaN in round `NANLOSS_ROUND`'s window (``nanloss``): each round quarantines rank 1 alone, and it
comes back in the next. Was two launches with one fault each (``nan@1:5`` in test_non_finite, ``nanloss@1:5``
in both modules, the same command twice). ``tests/hooked_flodl.py`` takes one ``--fault``, so the ranks run
`_TWO_FAULTS`, which installs both on the product's hooks as that wrapper does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import launch_argv, launch_env

#: The round whose start finds rank 1's parameters NaN (``nan@1:NAN_ROUND``).
NAN_ROUND = 5
#: The round whose window gives rank 1 NaN losses (``nanloss@1:NANLOSS_ROUND``): not next to `NAN_ROUND`, so
#: that rank 1 trained finite rounds in between.
NANLOSS_ROUND = 9

#: ``flodl-mpi ARGV[2:]`` with the faults ARGV[1] (comma-separated ``KIND@RANK:ROUND``) installed.
_TWO_FAULTS = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})  # tests/, for faults.py (as tests/hooked_flodl.py imports it, run as a script)
from faults import install, parse_fault
from flodl_mpi.cli.main import main
for spec in sys.argv[1].split(","):
    install(parse_fault(spec))
sys.exit(main(sys.argv[2:]))
"""

_CACHE: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}


def two_fault_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The shared run (trained on first use): its run dir and its finished launcher."""
    if "run" not in _CACHE:
        root = tmp_path_factory.mktemp("quarantine")
        script = root / "two_faults.py"
        script.write_text(_TWO_FAULTS.format(tests=str(Path(__file__).resolve().parents[1])))
        run_dir = root / "r"
        faults = f"nan@1:{NAN_ROUND},nanloss@1:{NANLOSS_ROUND}"
        proc = subprocess.run(launch_argv(2, sys.executable, str(script), faults, "train", "--epochs", "1",
                                          "--batch-size", "64", "--run-dir", str(run_dir)),
                              capture_output=True, text=True, timeout=400, check=False, env=launch_env())
        _CACHE["run"] = (run_dir, proc)
    return _CACHE["run"]
