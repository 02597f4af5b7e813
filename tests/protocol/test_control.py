"""The control row's named layout."""

import numpy as np
import pytest

from flodl_mpi.protocol.control import ACK, ROUND, ROUND_HEAD, Columns


def test_row_and_read_by_name():
    cols = Columns("steps", "window", "batch_ms")
    row = cols.row(steps=3, batch_ms=12.5)
    np.testing.assert_array_equal(row[[0, 2]], [3.0, 12.5])
    assert np.isnan(row[1])  # a column not given is "no value"
    matrix = np.stack([row, cols.row(steps=5, window=2, batch_ms=1.0)])  # what a gather of two ranks returns
    got = cols.read(matrix)
    np.testing.assert_array_equal(got["steps"], [3.0, 5.0])
    np.testing.assert_array_equal(got["window"][1:], [2.0])


def test_the_round_row_is_its_head_then_the_ack():
    assert ROUND.names == ROUND_HEAD.names + ACK.names
    assert ROUND.index("divergence") == len(ROUND_HEAD)
    row = np.arange(len(ROUND), dtype=np.float64)
    assert ACK.read(row[None, :], offset=len(ROUND_HEAD))["divergence"][0] == len(ROUND_HEAD)


def test_unknown_and_repeated_names():
    with pytest.raises(KeyError):
        Columns("a").row(b=1.0)
    with pytest.raises(ValueError, match="unique"):
        Columns("a", "a")
