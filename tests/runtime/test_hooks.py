"""The product's hook points (flodl_mpi.runtime.hooks): empty by default, called in order, removable."""

import pytest

from flodl_mpi.runtime import hooks


def test_nothing_is_registered_by_default():
    assert all(hooks.registered(point) == () for point in hooks.POINTS)
    hooks.call("batch", object())  # nothing happens
    assert hooks.fold("loss", 1.5, object()) == 1.5


def test_hooks_run_in_order_and_are_removed(run_hook):
    calls = []
    remove = hooks.register("round_start", lambda t: calls.append(("a", t)))
    run_hook("round_start", lambda t: calls.append(("b", t)))
    hooks.call("round_start", 7)
    assert calls == [("a", 7), ("b", 7)]
    remove()
    remove()  # idempotent
    hooks.call("round_start", 8)
    assert calls[2:] == [("b", 8)]


def test_fold_passes_the_value_through_each_hook(run_hook):
    run_hook("loss", lambda v, t: v * 2)
    run_hook("loss", lambda v, t: v + t)
    assert hooks.fold("loss", 3, 1) == 7  # (3 * 2) + 1


def test_an_unknown_point_is_refused():
    with pytest.raises(ValueError, match="hook point must be one of round_start, batch, loss, bridge_stage, got 'epoch'"):
        hooks.register("epoch", print)


def test_a_hooks_error_propagates(run_hook):
    def boom(bridge, stage):
        raise MemoryError(stage)

    run_hook("bridge_stage", boom)
    with pytest.raises(MemoryError, match="params reduce"):
        hooks.call("bridge_stage", None, "params reduce")


def test_the_fault_kinds_fire_at_their_points_only(inject_fault):
    """tests/faults.py, in process: ``step@1:3`` raises on rank 1 in round 3 only, at the "batch" point."""
    from types import SimpleNamespace

    from tests.faults import InjectedFault

    inject_fault("step@1:3")
    inject_fault("nanloss@0:2")
    trainer = SimpleNamespace(rank=1, bridge=SimpleNamespace(version=2))
    hooks.call("batch", trainer)  # round 2: nothing
    hooks.call("round_start", trainer)  # another point: nothing
    trainer.bridge.version = 3
    with pytest.raises(InjectedFault, match=r"injected fault in the training step \(rank 1, round 3\)"):
        hooks.call("batch", trainer)
    assert hooks.fold("loss", 1.0, trainer) == 1.0  # nanloss is rank 0's
    trainer.rank, trainer.bridge.version = 0, 2
    value = hooks.fold("loss", 1.0, trainer)
    assert value != value  # NaN
