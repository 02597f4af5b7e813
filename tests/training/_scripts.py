"""A test's script at a world of 1 in a forked child of pytest, as ``python SCRIPT ARGV`` runs it: with
its uncaught exception given to ``sys.excepthook``.

``tests.conftest.fork_python`` runs the script with :func:`runpy.run_path`; an exception the script does
not catch then reaches the child's own handler (a traceback, exit status 1) where ``python SCRIPT`` would
give it to ``sys.excepthook``: flodl_mpi's (:func:`flodl_mpi.runtime.world.install_excepthooks`, set by
``fit`` and ``Averager``) turns a refusal into one line and exit 2. :func:`fork_script` runs the script
through a wrapper that does what the interpreter does.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import fork_python

#: Runs ``sys.argv[1]`` as ``__main__`` with ``sys.argv[1:]`` as its argv; an uncaught exception goes to
#: ``sys.excepthook`` and exit status 1, as at the end of ``python SCRIPT``.
_WRAPPER = '''\
import runpy
import sys

sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
    raise
except BaseException:
    sys.excepthook(*sys.exc_info())
    sys.exit(1)
'''


def fork_script(script: Path, *argv: str, timeout: float = 300.0):
    """``python SCRIPT ARGV`` at a world of 1 in a fork (``fork_python``), uncaught exceptions as Python's;
    the wrapper is written beside the script (its folder is the script's ``sys.path[0]``)."""
    wrapper = Path(script).with_name("_as_python_main.py")
    wrapper.write_text(_WRAPPER)
    return fork_python(wrapper, str(script), *argv, timeout=timeout)
