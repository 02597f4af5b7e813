"""The wire options (issue 9): validated at construction, refused with one line naming the option."""

import pytest

from flodl_mpi.config import ConfigError, TrainConfig
from flodl_mpi.transport.reduce import WireOptions


def test_defaults_are_auto_and_float32():
    assert (TrainConfig().node_reduce, TrainConfig().hierarchical, TrainConfig().bf16_wire) == ("auto", "auto", False)
    assert WireOptions() == WireOptions("auto", "auto", False)


@pytest.mark.parametrize("kw, msg", [
    (dict(node_reduce="tcp"), "--node-reduce 'tcp': must be one of auto, shm, mpi"),
    (dict(hierarchical="yes"), "--hierarchical 'yes': must be one of auto, on, off"),
    (dict(bf16_wire=1), "--bf16-wire 1: must be true or false"),
    (dict(bf16_wire=True, node_reduce="mpi", hierarchical="on"),
     "--bf16-wire with --node-reduce mpi --hierarchical on is not implemented"),
])
def test_config_refuses_bad_wire_options(kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
        TrainConfig(**kw)


def test_wire_options_refuse_bad_values():
    with pytest.raises(ValueError, match="node_reduce must be one of auto, shm, mpi, got 'x'"):
        WireOptions("x")
    with pytest.raises(ValueError, match="hierarchical must be one of auto, on, off, got 'x'"):
        WireOptions("shm", "x")
    with pytest.raises(TypeError, match="bf16 must be True or False, got 1"):
        WireOptions("shm", "auto", 1)
    WireOptions("auto", "on", True)  # auto resolves to shm where /dev/shm has room: allowed
