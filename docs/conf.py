"""Sphinx configuration of flodl-mpi's documentation (``pip install -e '.[docs]'``, then
``sphinx-build -W -n -b html docs docs/_build/html``; .ci/run builds it so)."""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # the checkout's flodl_mpi, not another installed one
sys.path.insert(0, str(DOCS))

import flodl_mpi  # noqa: E402

project = "flodl-mpi"
author = "the flodl-mpi authors"
copyright = "2026, the flodl-mpi authors"
release = version = flodl_mpi.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",          # the CLI reference, from flodl_mpi.cli.main.build_parser
    "figures",                # docs/figures.py: the explanation's figures, drawn at build time
    "exit_codes",             # docs/exit_codes.py: the exit-code table, from flodl_mpi/errors.py
]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
nitpicky = True
# Names the docstrings use that no page documents: third-party types, and the package's internal
# classes named in signatures (documented where they live, in the code).
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|np|numpy|nn|h5py|MPI|mpi4py|argparse|collections|os|typing|pathlib)\..*"),
    (r"py:.*", r"(Tensor|Module|Optimizer|ndarray|PathLike|Path|Callable|Iterable|Iterator|Sequence|Mapping|Any)"),
    (r"py:.*", r"flodl_mpi\.(protocol|policy|transport|training|outputs|runtime|cli|api|config)\..*"),
    (r"py:.*", r"(TrainConfig|RunReader|Comm|optional|_Boundary|ScalarBook\..*|ModelSpecError)"),
]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"flodl-mpi {release}"
html_static_path = []
html_extra_path = ["_generated/extra"]  # favicon.ico, drawn by figures.py
html_favicon = "_generated/favicon.png"  # drawn by figures.py at builder-inited
html_show_sourcelink = False
