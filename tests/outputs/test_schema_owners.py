"""A metrics.h5 column has its owners in step (docs/architecture.rst, "Adding a metric column").

The schema (`flodl_mpi.outputs.metrics.table_schema`) is the source of truth; the round's control
row (`flodl_mpi.protocol.control`) carries what a rank measured; the recorder stores every ack
under its own name; docs/file-formats.rst explains every column. A column added in one place and
forgotten in another fails here, naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from flodl_mpi.outputs.metrics import table_schema
from flodl_mpi.outputs.recorder import COHORT_ACKS, Recorder
from flodl_mpi.protocol.control import ACK, ROUND_HEAD

DOC = Path(__file__).resolve().parents[2] / "docs" / "file-formats.rst"
#: What a rank says in the control gather that is not stored as a column of its own: the stop
#: request, the non-finite bits (stored as ``quarantined``), and the own loop's boundary and join facts.
CONTROL_ONLY = {"stop", "non_finite", "ending", "calls", "joined"}


def test_every_column_of_every_table_is_explained_in_file_formats():
    doc = DOC.read_text()
    documented = set(re.findall(r"^``([a-z_]+)``", doc, flags=re.M))
    missing = [f"{table}/{col}" for table, cols in table_schema(2).items() for col in cols if col not in documented]
    assert not missing, f"columns without their line in {DOC.name}: {missing}"


def test_every_control_column_a_rank_measures_is_a_rounds_column():
    rounds = table_schema(3)["rounds"]
    for name in ROUND_HEAD.names + ACK.names:
        if name in CONTROL_ONLY:
            continue
        assert name in rounds, f"control column {name!r} has no rounds column"
    for name in ACK.names:  # the recorder's rule: per rank, unless one value for the cohort
        assert rounds[name][1] == (() if name in COHORT_ACKS else (3,)), name


def test_the_recorder_stores_every_ack_under_its_name():
    # a hand-made gathered ack matrix: each column a distinct value per rank
    W = 2
    acks = {name: np.array([10.0 * i + r for r in range(W)]) for i, name in enumerate(ACK.names)}
    rows = []

    class Writer:
        def append_held(self, table, row):
            rows.append((table, row))

    rec = Recorder(Writer())
    rec.round(round=1)
    rec.acks(acks, None)
    (table, row), = rows
    assert table == "rounds" and row["guard"] == 0 and row["round"] == 1
    for i, name in enumerate(ACK.names):
        if name in COHORT_ACKS:
            assert row[name] == 10.0 * i   # rank 0's: every rank sends the same
        else:
            np.testing.assert_array_equal(row[name], [10.0 * i, 10.0 * i + 1])
