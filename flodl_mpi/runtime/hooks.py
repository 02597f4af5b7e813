"""Named points in a rank's run where registered callables are called: extension points, empty by default.

Invariant: nothing is registered unless the process's own code registers it (the
product never does, and reads nothing from the environment for it), and a point
with nothing registered changes nothing (one dictionary lookup). The tests use
these points to inject faults (``tests/faults.py``); a hook may raise, and its
error travels the same way as any error at that point would.

Points, and the arguments a hook receives:

- ``"round_start"`` ``(trainer)``: on every rank, after its window's batches, before
  the round's snapshot (the `flodl_mpi.training.worker.Trainer`; ``trainer.bridge.version``
  is the round about to run, counted from 0).
- ``"batch"`` ``(trainer)``: in each training step, after the batch reached the
  device, before the loss.
- ``"loss"`` ``(loss, trainer)``: the step's loss tensor, before ``backward``; the hook
  returns the loss to use (:func:`fold`).
- ``"bridge_stage"`` ``(bridge, stage)``: the bridge enters a stage of a round
  (``"params reduce"`` and the like; ``bridge.version`` is the round).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["POINTS", "register", "call", "fold", "registered"]

POINTS = ("round_start", "batch", "loss", "bridge_stage")

_hooks: dict[str, list[Callable]] = {}


def _check(point: str) -> None:
    if point not in POINTS:
        raise ValueError(f"hook point must be one of {', '.join(POINTS)}, got {point!r}")


def register(point: str, fn: Callable) -> Callable[[], None]:
    """Call ``fn`` at ``point`` from now on (after the ones registered before); returns its remover.

    Args:
        point: one of :data:`POINTS`.
        fn: called with the point's arguments (see the module docstring).

    Returns:
        A callable that unregisters ``fn`` (idempotent).

    Raises:
        ValueError: an unknown ``point``.
    """
    _check(point)
    _hooks.setdefault(point, []).append(fn)

    def remove() -> None:
        hooks = _hooks.get(point, [])
        if fn in hooks:
            hooks.remove(fn)
        if not hooks:
            _hooks.pop(point, None)

    return remove


def registered(point: str) -> tuple[Callable, ...]:
    """The callables registered at ``point``, in calling order (empty by default)."""
    _check(point)
    return tuple(_hooks.get(point, ()))


def call(point: str, *args) -> None:
    """Call every hook registered at ``point`` with ``args``, in order; a hook's error propagates."""
    hooks = _hooks.get(point)
    if hooks:
        for fn in tuple(hooks):
            fn(*args)


def fold(point: str, value, *args):
    """``value`` passed through every hook at ``point`` (``value = fn(value, *args)``); ``value`` itself if none."""
    hooks = _hooks.get(point)
    if hooks:
        for fn in tuple(hooks):
            value = fn(value, *args)
    return value
