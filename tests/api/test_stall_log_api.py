"""The Python API's train.log ends with a stall's verdict, as the CLI's (tests/runtime/test_watchdog.py)."""

import re
import subprocess
import sys
import textwrap
import time

from flodl_mpi.errors import EXIT_STALL
from tests.conftest import launch_argv, launch_env


def test_an_own_loop_that_stalls_ends_its_train_log_with_the_verdict(tmp_path):
    run_dir = tmp_path / "r"
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(f"""
        import time
        import flodl_mpi, torch
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with flodl_mpi.Averager(model, optimizer=opt, run_dir={str(run_dir)!r}, stall_timeout=4) as avg:
            for i in range(6):
                if i == 3 and avg.rank == 1:
                    print("rank 1 hangs", flush=True)
                    time.sleep(600)
                opt.zero_grad()
                model(torch.randn(8, 4)).sum().backward()
                opt.step()
                avg.step()
    """))
    t0 = time.monotonic()
    proc = subprocess.run(launch_argv(2, sys.executable, str(script)), capture_output=True, text=True,
                          timeout=400, env=launch_env(), check=False)
    elapsed = time.monotonic() - t0
    assert "rank 1 hangs" in proc.stdout  # the stall is the one this script made
    assert proc.returncode == EXIT_STALL, proc.stderr[-3000:]
    assert elapsed < 300  # no 600 s hang (generous: a loaded machine)
    # The cohort's verdict (rank 0 prints it), or, on a loaded machine, rank 0's own when its
    # heartbeat exchange ran over first (it decided alone); searched, not matched at a line's
    # start: the launcher may interleave the other rank's stack dump into rank 0's line.
    printed = re.search(r"flodl-mpi: ((?:rank 0: )?watchdog: .*?); (?:every rank's )?stacks follow", proc.stderr)
    assert printed is not None, proc.stderr[-3000:]
    verdict = printed.group(1)
    if not verdict.startswith("rank 0: "):
        assert "rank 1 working on" in verdict and "rank 0 waited for it" in verdict, verdict
    last = (run_dir / "train.log").read_text().splitlines()[-1]
    assert re.fullmatch(r"\d\d:\d\d:\d\d run failed: " + re.escape(verdict), last), last
