"""Built-in models and the loader for a user's ``module:factory`` model.

Invariant: ``build_model`` returns an ``nn.Module`` with at least one parameter, all
parameters floating point, or raises ``ModelSpecError`` with one line saying why;
``module_structure``, ``model_signature`` and ``model_difference`` let ranks check
they all built the same module tree and tensor layout.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from flodl_mpi.errors import InputError
from flodl_mpi.training.model_spec import model_spec_problem

__all__ = ["ModelSpecError", "build_model", "check_model_output", "check_same_model", "check_training_step",
           "digits_mlp", "model_difference", "model_signature", "module_structure", "state_kept", "wide_tensor"]


class ModelSpecError(ValueError):
    """A ``--model`` spec that cannot give a usable model; the message is one line."""


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def digits_mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 128) -> nn.Module:
    """The built-in model: a 3-layer MLP with BatchNorm after the first layer.

    BatchNorm is there on purpose: its running mean/var are float buffers that ranks
    average, and ``num_batches_tracked`` is an int64 buffer the averaging must handle.

    Args:
        input_shape: shape of one sample, e.g. (64,); flattened to prod(input_shape).
        num_classes: number of output logits, >= 1.
        hidden: width of the two hidden layers, >= 1.

    Returns:
        ``nn.Sequential`` mapping float32 (B, *input_shape) to logits (B, num_classes).

    Raises:
        TypeError, ValueError: an argument of the wrong kind or out of range.
    """
    if not isinstance(input_shape, Sequence) or not input_shape:
        raise TypeError(f"input_shape must be a non-empty tuple of ints, got {input_shape!r}")
    for dim in input_shape:
        _positive_int(dim, "input_shape entries")
    _positive_int(num_classes, "num_classes")
    _positive_int(hidden, "hidden")
    return nn.Sequential(
        nn.Flatten(),  # (B, *input_shape) -> (B, prod(input_shape))
        nn.Linear(math.prod(input_shape), hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def _describe(exc: BaseException) -> str:
    """``Type: message`` on one line, so a user's multi-line message stays one line."""
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())


def _import(spec: str, module: str) -> object:
    """Import ``module``: a dotted name, or a path ending in .py (loaded from the file)."""
    if not module.endswith(".py"):
        # As `python -m` does: a module in the working directory is importable
        # from the console script too.
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            return importlib.import_module(module)
        except Exception as exc:  # user code: ImportError, SyntaxError, its own errors
            raise ModelSpecError(
                f"--model {spec!r}: cannot import module {module!r}: {_describe(exc)}"
            ) from exc
    # A private name, registered in sys.modules while it runs (as importlib's recipe
    # does) so that dataclasses and pickling inside the user's file work.
    name = "_flodl_mpi_user_model_" + os.path.splitext(os.path.basename(module))[0]
    mod_spec = importlib.util.spec_from_file_location(name, module)
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = mod
    try:
        mod_spec.loader.exec_module(mod)
    except Exception as exc:  # user code
        del sys.modules[name]
        raise ModelSpecError(
            f"--model {spec!r}: cannot import file {module!r}: {_describe(exc)}"
        ) from exc
    return mod


def _call_factory(factory: Callable, input_shape: tuple[int, ...], num_classes: int) -> object:
    """Call ``factory`` with those of ``input_shape``/``num_classes`` it accepts by keyword."""
    offered = {"input_shape": input_shape, "num_classes": num_classes}
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: offer both
        return factory(**offered)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return factory(**offered)
    by_keyword = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return factory(**{k: v for k, v in offered.items() if k in by_keyword})


def build_model(spec: str | None, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build the model named by ``--model``.

    Args:
        spec: ``None`` for ``digits_mlp``; else ``module:factory`` where module is a
            dotted import name (``mypkg.nets:make_net``) or a file path ending in .py
            (``path/to/file.py:make_net``; its directory is not added to sys.path).
            ``factory`` may be dotted (``Class.create``). It is called with only those of
            the keyword arguments ``input_shape`` (tuple of ints, one sample's shape) and
            ``num_classes`` (int) that its signature accepts (``**kwargs`` takes both).
        input_shape: shape of one sample, e.g. (64,).
        num_classes: number of classes.

    Returns:
        The model (on CPU, as the factory made it).

    Raises:
        ModelSpecError: malformed spec, module not importable, no such attribute, not
            callable, the factory raised, the result is not an ``nn.Module``, it has no
            parameters, or a parameter is not floating point.
        TypeError: ``spec`` is neither ``None`` nor a str.
    """
    input_shape = tuple(input_shape)
    if spec is None:
        return digits_mlp(input_shape, num_classes)
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str 'module:factory' or None, got {type(spec).__name__}")
    problem = model_spec_problem(spec, find=False)  # the form, a .py file that is not there
    if problem is not None:
        raise ModelSpecError(problem)
    module, _, attr = spec.rpartition(":")

    factory = _import(spec, module)
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ModelSpecError(f"--model {spec!r}: {module!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ModelSpecError(
            f"--model {spec!r}: {attr!r} is a {type(factory).__name__}, not callable"
        )

    try:
        model = _call_factory(factory, input_shape, num_classes)
    except Exception as exc:  # user code: report it in one line, keep the traceback chained
        raise ModelSpecError(
            f"--model {spec!r}: factory raised {_describe(exc)}"
        ) from exc
    if not isinstance(model, nn.Module):
        raise ModelSpecError(
            f"--model {spec!r}: factory returned {type(model).__name__}, not a torch.nn.Module"
        )
    params = list(model.named_parameters())
    if not params:
        raise ModelSpecError(f"--model {spec!r}: the model has no parameters")
    for name, p in params:
        if not p.is_floating_point():
            raise ModelSpecError(
                f"--model {spec!r}: parameter {name!r} has dtype {_dtype(p)}; "
                "all parameters must be floating point"
            )
    return model


def check_model_output(model: nn.Module, sample: torch.Tensor, num_classes: int, spec: str | None,
                       positions: tuple[int, ...] = ()) -> None:
    """Run one forward pass on real samples and check the logits fit the labels.

    Args:
        model: the built model, on ``sample``'s device.
        sample: a float32 batch of shape ``(k, *input_shape)``, k >= 1.
        num_classes: classes in the data (largest label + 1).
        spec: the ``--model`` text, for messages (None: the built-in model).
        positions: one sample's label shape: ``()`` for a label per sample,
            ``(T,)`` for a label per position (a sequence task's ``(N, T)`` labels).

    Raises:
        ModelSpecError: the forward pass fails, or does not return logits of
            shape ``(k, C, *positions)`` with ``C >= num_classes``.
    """
    name = f"--model {spec!r}" if spec is not None else "the built-in model"
    was_training = model.training
    model.eval()  # no BatchNorm statistics are touched, no dropout drawn
    try:
        with torch.no_grad():
            out = model(sample)
    except Exception as exc:  # user code
        raise ModelSpecError(
            f"{name}: forward pass on samples of shape {tuple(sample.shape)} failed: {_describe(exc)}"
        ) from exc
    finally:
        model.train(was_training)
    positions = tuple(positions)
    if (not isinstance(out, torch.Tensor) or out.ndim != 2 + len(positions) or out.shape[0] != sample.shape[0]
            or tuple(out.shape[2:]) != positions):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        want = "(batch, classes)" if not positions else f"(batch, classes, {', '.join(map(str, positions))})"
        per = "" if not positions else f" (the labels are per position, shape (N, {', '.join(map(str, positions))}))"
        raise ModelSpecError(f"{name}: must return logits of shape {want}, got {got} "
                             f"for a batch of {sample.shape[0]}{per}")
    if out.shape[1] < num_classes:
        raise ModelSpecError(f"{name}: outputs {out.shape[1]} logits per sample but the data has "
                             f"{num_classes} classes (labels 0..{num_classes - 1})")


@contextlib.contextmanager
def state_kept(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Put back everything a training step may change: values and identity of every
    parameter and buffer (running stats, ``num_batches_tracked``), gradients, each
    module's training flag, and the torch RNG (CPU, and ``device`` if CUDA)."""
    saved = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):  # what state_dict reads too
            for name, t in table.items():
                if t is not None:
                    saved.append((table, name, t, t.detach().to("cpu", copy=True), t.grad))
    for _, _, t, _, _ in saved:
        t.grad = None  # backward would accumulate into an existing gradient in place
    modes = [(m, m.training) for m in model.modules()]
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices):
            yield
    finally:
        with torch.no_grad():
            for table, name, t, value, grad in saved:
                table[name] = t  # the same object, in case forward re-assigned the attribute
                t.copy_(value)
                t.grad = grad
        for m, mode in modes:
            m.training = mode


def check_training_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, spec: str | None,
                        remedy: str) -> None:
    """Run one training-mode forward and backward, as the training step does, and undo it.

    Anything that would fail in a training step fails here, at setup, before any
    epoch: e.g. BatchNorm on a batch of 1 sample. Afterwards the model is exactly as
    before (parameters, buffers, gradients, modes, RNG; see ``state_kept``).

    Args:
        model: the built model, on ``x``'s device.
        x: float32 ``(k, *input_shape)``, k >= 1: the smallest batch the batch plan makes.
        y: int64 ``(k,)`` labels, or ``(k, T)`` per position.
        spec: the ``--model`` text, for messages (None: the built-in model).
        remedy: what the user can change, appended to the message (e.g. "raise --batch-size").

    Raises:
        ModelSpecError: the forward pass, the loss or the backward pass raised; one line
            naming the batch size, the reason and ``remedy``.
    """
    name = f"--model {spec!r}" if spec is not None else "the built-in model"
    k = int(x.shape[0])
    try:
        with state_kept(model, x.device):
            model.train()
            loss = nn.functional.cross_entropy(model(x), y)  # the loss Trainer uses
            loss.backward()
    except Exception as exc:  # user code
        text = str(exc)
        if "Expected more than 1 value per channel when training" in text:
            reason = "BatchNorm needs more than 1 value per channel"
        else:
            reason = _describe(exc)
        raise ModelSpecError(f"{name} fails on a training batch of {k} sample{'s' if k != 1 else ''} "
                             f"({reason}): {remedy}") from exc


def _dtype(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")  # torch.float32 -> "float32"


def model_signature(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of every parameter, then every buffer, in module order.

    dtype is the torch dtype without the ``torch.`` prefix (``"float32"``, ``"int64"``).
    Ranks compare (e.g. gather) these to check they all built the same model before
    any collective relies on the layout.
    """
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return [(name, tuple(t.shape), _dtype(t)) for name, t in tensors]


#: Floating dtypes the consensus (float32 on the wire, in the averaging buffers and in
#: checkpoints) holds exactly or within their own rounding: cast to float32 and back.
AVERAGED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def wide_tensor(model: nn.Module) -> str | None:
    """The first tensor the float32 consensus would round, or None: one line for the user.

    flodl_mpi averages parameters and floating buffers in float32 and stores them
    float32 in checkpoints; a float64 parameter or floating buffer would be rounded
    to float32 at every round (small updates lost), and a complex parameter cannot
    be held, so such a model is refused at start, not trained (a complex buffer is
    refused by the checkpoint's save check). float16 and bfloat16 are averaged in
    float32 and cast back (exact enough); integer and bool buffers are not averaged.

    Returns:
        e.g. ``parameter '0.weight' is float64: flodl_mpi averages and checkpoints
        in float32, ... cast the model to float32 first (model.float())``; None when
        every parameter and floating buffer is float32, float16 or bfloat16.
    """
    tensors = [("parameter", n, t) for n, t in model.named_parameters()]
    # A complex buffer is refused by the save check (`flodl_mpi.outputs.checkpoint`: floating, integer or bool).
    tensors += [("buffer", n, t) for n, t in model.named_buffers() if t.is_floating_point()]
    for kind, name, tensor in tensors:
        if tensor.is_complex():
            return (f"{kind} {name!r} is {_dtype(tensor)}: flodl_mpi averages and checkpoints real float32 "
                    "tensors; hold the real and imaginary parts as two float32 parameters")
        if tensor.dtype not in AVERAGED_DTYPES:
            return (f"{kind} {name!r} is {_dtype(tensor)}: flodl_mpi averages and checkpoints in float32, which "
                    "would round it at every round; cast the model to float32 first (model.float())")
    return None


def module_structure(model: nn.Module) -> list[tuple[str, str]]:
    """``(qualified name, class qualname)`` of every module, the model itself first (name ``""``).

    In ``model.named_modules()`` order, e.g. ``[("", "Sequential"), ("0", "Flatten"),
    ("1", "Linear"), ("2", "ReLU"), ...]``. Parameter-free layers (activations,
    pooling, dropout) are in it, so a ReLU on one rank and a Tanh on another differ
    here though `model_signature` matches. What ``forward()`` does with the modules
    is not: two ranks running different code over the same modules look alike.
    """
    return [(name, type(module).__qualname__) for name, module in model.named_modules()]


def _module_text(entry: tuple[str, str] | None) -> str:
    if entry is None:
        return "no further module"
    name, kind = entry
    return f"the model itself as {kind}" if name == "" else f"module {name!r} ({kind})"


def _first_difference(a: list, b: list) -> tuple:
    """The first pair of entries that differ, ``None`` padding the shorter list."""
    return next((x, y) for x, y in zip([*a, None], [*b, None]) if x != y)


def model_difference(gathered: Sequence[tuple[list[tuple[str, str]], list]]) -> str | None:
    """Whether the ranks built the same model, decided from every rank's gathered description.

    A pure function of the gathered values, so every rank decides alike.

    Args:
        gathered: row r is rank r's ``(module_structure(model), model_signature(model))``.

    Returns:
        None when every rank's equals rank 0's; else one line naming the first
        module (or tensor) where the first differing rank departs from rank 0,
        and every rank that departs alike, e.g. ``the model differs across ranks:
        module '2' is ReLU on rank 0 but Tanh on rank(s) 1 (...)``. The module tree
        is compared first, then the tensors' names, shapes and dtypes.
    """
    tail = " (every rank must build the same model)"
    for part in (0, 1):
        rows = [g[part] for g in gathered]
        differ = [r for r, row in enumerate(rows) if row != rows[0]]
        if not differ:
            continue
        alike = [r for r in differ if rows[r] == rows[differ[0]]]
        ranks = f"rank(s) {', '.join(str(r) for r in alike[:8])}{' and more' if len(alike) > 8 else ''}"
        x, y = _first_difference(rows[0], rows[differ[0]])
        has = "has" if len(alike) == 1 else "have"
        if part == 1:
            return f"the model differs across ranks: rank 0 has {x} where {ranks} {has} {y}{tail}"
        if x is not None and y is not None and x[0] == y[0]:
            what = "the model itself" if x[0] == "" else f"module {x[0]!r}"
            return f"the model differs across ranks: {what} is {x[1]} on rank 0 but {y[1]} on {ranks}{tail}"
        return (f"the model differs across ranks: rank 0 has {_module_text(x)} where {ranks} {has} "
                f"{_module_text(y)}{tail}")
    return None


def check_same_model(model: nn.Module, comm) -> None:
    """Every rank built the same module tree and tensors (`model_difference`), all of dtypes the
    float32 consensus keeps (`flodl_mpi.training.models.wide_tensor`); collective (one allgather).
    The CLI's, ``fit``'s and the ``Averager``'s start check (`flodl_mpi.training.setup.setup_rank`);
    ``comm``: an mpi4py intracommunicator.

    Raises:
        InputError: on every rank alike, naming the first difference and the ranks, or the
            first float64 (complex) parameter or floating buffer.
    """
    why = model_difference(comm.allgather((module_structure(model), model_signature(model))))
    if why is None:  # the same model on every rank: every rank decides alike
        why = wide_tensor(model)
    if why is not None:
        raise InputError(why)
