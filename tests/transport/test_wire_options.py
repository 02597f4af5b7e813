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


@pytest.mark.parametrize("kw, msg", [
    (dict(wire="int4"), "--wire 'int4': must be one of fp32, bf16, bf16-delta, int8-delta"),
    (dict(wire="int8-delta", bf16_wire=True), "--bf16-wire with --wire int8-delta: --bf16-wire is --wire bf16; "
                                              "give one of them"),
    (dict(wire="fp32", bf16_wire=True), "--bf16-wire with --wire fp32: --bf16-wire is --wire bf16"),
    (dict(wire="int8-delta", node_reduce="shm"), "--wire int8-delta travels over MPI (an Allgather of the quantised "
                                                 "deltas over the world); it does not run with --node-reduce shm: "
                                                 "use --node-reduce mpi or auto"),
    (dict(wire="bf16-delta", hierarchical="on"), "--wire bf16-delta is flat over the world (one Allgather of the "
                                                 "quantised deltas); --hierarchical on is not implemented with it: "
                                                 "use --hierarchical off or auto"),
    (dict(wire="bf16", node_reduce="mpi", hierarchical="on"),
     "--wire bf16 with --node-reduce mpi --hierarchical on is not implemented"),
])
def test_config_refuses_bad_wires(kw, msg):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**kw)
    assert str(info.value).startswith(msg) and "\n" not in str(info.value)


def test_the_wire_mode_honours_bf16_wire_as_its_alias():
    assert TrainConfig().wire_mode == "fp32"
    assert TrainConfig(bf16_wire=True).wire_mode == "bf16"
    assert TrainConfig(bf16_wire=True, wire="bf16").wire_mode == "bf16"
    assert TrainConfig(wire="int8-delta").wire_mode == "int8-delta"
    assert WireOptions("auto", "auto", delta="int8").delta == "int8"
    with pytest.raises(ValueError, match="delta must be 'off' or one of bf16, int8, got 'int4'"):
        WireOptions(delta="int4")
    with pytest.raises(ValueError, match="--wire bf16-delta travels over MPI"):
        WireOptions("shm", delta="bf16")
