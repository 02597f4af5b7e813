"""What a ``--model`` spec (``module:factory`` or ``path/to/file.py:factory``) names, checked without running it.

Invariant: imports neither torch nor the user's code (a spec is looked up, not imported),
so the CLI's checks before MPI starts (:mod:`flodl_mpi.cli.precheck`) and the model
loader (:mod:`flodl_mpi.training.models`) give the same line for the same mistake.
"""

from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["model_spec_problem"]


def model_spec_problem(spec: str | None, find: bool = True, look: bool = True) -> str | None:
    """What is wrong with a ``--model`` spec that can be told without running its code, or None.

    The form (``module:factory`` or ``path/to/file.py:factory``); with ``look`` a ``.py``
    file that is not there, and with ``find`` too a top-level module that is nowhere on the
    import path (looked up, not imported: a package's ``__init__`` would run the user's code).
    """
    if spec is None:
        return None
    module, _, attr = spec.rpartition(":")  # the last colon: a Windows path C:\nets\m.py:make parses
    if not module or not attr:
        return f"--model {spec!r}: expected 'module:factory' or 'path/to/file.py:factory'"
    if not look:
        return None
    if module.endswith(".py"):
        return None if os.path.isfile(module) else f"--model {spec!r}: no such file {module!r}"
    if not find:
        return None
    top = module.split(".")[0]
    path = sys.path if (os.getcwd() in sys.path or "" in sys.path) else [os.getcwd(), *sys.path]
    old, sys.path[:] = list(sys.path), path  # as the ranks import it (flodl_mpi.training.models: the working directory too)
    try:
        found = top in sys.modules or importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path[:] = old
    if found:
        return None
    return f"--model {spec!r}: cannot import module {module!r}: ModuleNotFoundError: No module named {top!r}"
