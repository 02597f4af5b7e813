"""Rank 0's checkpoint duty (flodl_mpi.outputs.saver): a Saver on rank 0 with a writer, a NoSaver elsewhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flodl_mpi.outputs.checkpoint_contents import CheckpointContents
from flodl_mpi.outputs.saver import NoSaver, Saver, saver_for


class _Writer:
    writes = True
    checkpoint_dir = Path("/runs/x/checkpoints")

    def __init__(self) -> None:
        self.saved = []

    def save(self, contents) -> None:
        self.saved.append(contents)


def _contents() -> CheckpointContents:
    return CheckpointContents(params={"w": np.zeros(2, np.float32)}, buffers={}, order=["w"], epoch=2, round=9,
                              reason="checkpoint", world_size=1, config={}, guard={}, ranks={0: ({}, {})})


def test_only_rank_0_with_a_writer_saves():
    writer = _Writer()
    assert type(saver_for(0, writer)) is Saver
    assert type(saver_for(1, writer)) is NoSaver and type(saver_for(0, None)) is NoSaver


def test_a_saver_queues_the_contents_and_says_where_they_go():
    writer = _Writer()
    contents = _contents()
    assert Saver(writer).save(lambda: contents) == Path("/runs/x/checkpoints/ckpt-e000002-r000009.h5")
    assert writer.saved == [contents]


def test_a_nosaver_builds_nothing():
    def build():
        raise AssertionError("built on a rank that saves nothing")

    assert NoSaver().save(build) is None
    NoSaver().check(Path("/nowhere"), build, None, 3, 1)


def test_the_save_check_writes_the_contents_and_refuses_what_cannot_be_stored(tmp_path):
    Saver(_Writer()).check(tmp_path, _contents, None, 3, 1)
    assert list(tmp_path.iterdir()) == []  # the trial file is removed
    bad = _contents()
    bad.extra = {"note": object()}  # a meta value the format cannot store
    with pytest.raises(ValueError, match="cannot be saved in a checkpoint"):
        Saver(_Writer()).check(tmp_path, lambda: bad, None, 3, 1)
