"""``python SCRIPT ARGV`` at a world of 1 in a forked child of the pytest process (tests/conftest.py's
:func:`fork_python`), as plain ``python`` ends a script: an uncaught exception goes to ``sys.excepthook``
(the one flodl_mpi installs: its ``flodl-mpi: error:`` line and exit status), and the script may run in
another working directory. For the API tests whose point needs no peer."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tests.conftest import fork_python

#: What the forked child runs: the script as ``__main__`` in ``cwd``, an uncaught exception to
#: ``sys.excepthook`` (fork_python's child would print it itself, skipping the hook the product installs).
_WRAPPER = '''
import os, runpy, sys
cwd, script, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
if cwd:
    os.chdir(cwd)
sys.argv = [script, *argv]
sys.path[0] = os.path.dirname(os.path.abspath(script))
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    raise
except BaseException:
    sys.excepthook(*sys.exc_info())
    sys.exit(1)
'''


def fork_script(script: str | os.PathLike, *argv: str, cwd: str | os.PathLike | None = None,
                timeout: float = 300.0, env: dict | None = None):
    """``python SCRIPT ARGV`` (in ``cwd``) at a world of 1, forked: a ``subprocess.CompletedProcess``."""
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = Path(tmp) / "run_as_main.py"
        wrapper.write_text(_WRAPPER)
        return fork_python(wrapper, str(cwd or ""), str(script), *argv, timeout=timeout, env=env)
