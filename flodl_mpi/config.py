"""One validated training config; saved with the run and every checkpoint (STYLE 28).

Invariant: every field is checked at construction, so a bad value is one clear
line before any rank trains; the same argv and config file give every rank the
same config.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flodl_mpi.policy.defaults import ADOPTION_DEFAULTS, BALANCER_DEFAULTS
from flodl_mpi.policy.registry import lookup as policy_spec
from flodl_mpi.policy.registry import names as policy_names
from flodl_mpi.policy.registry import refusal as policy_refusal
from flodl_mpi.policy.registry import taking

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["AMP_MODES", "ASYNC_ADOPTS", "AVERAGE_OPTIMIZER_STATE", "BEST_METRICS", "DATA_LOADING", "DEVICES", "HIERARCHICAL",
           "LR_GAMMA_DEFAULT", "LR_SCHEDULES", "NODE_REDUCES", "WIRES",
           "NOT_IN_FILE", "ON_NON_FINITE", "OPTIMIZERS", "OPTIMIZER_CLASSES", "OPTIMIZER_WEIGHT_DECAY", "OUTERS",
           "OUTPUT_OPTIONS", "PROGRESS", "RESUME_AUTO", "TASKS", "ConfigError", "TrainConfig", "check_fit_arguments",
           "check_int", "check_output_option", "config_key_text", "delta_refusal", "optimizer_class", "own_loop_config",
           "read_config_file", "value_problem"]

#: ``fit(task=...)``: None infers it from the targets' dtype (integer: classification).
TASKS = ("classification", "regression")

#: How ``async`` adopts a consensus (``--async-adopt``; flodl_mpi.training.replica.Replica.adopt).
ASYNC_ADOPTS = ("delta", "easgd")
OPTIMIZERS = ("sgd", "adam", "adamw")
#: The class each of `OPTIMIZERS` builds (flodl_mpi.training.task.make_optimizer).
OPTIMIZER_CLASSES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
#: Each of `OPTIMIZERS`' weight decay when ``--weight-decay`` is not given: torch.optim's own
#: defaults (``inspect.signature(torch.optim.AdamW).parameters["weight_decay"].default``; kept
#: here so the config and ``--help`` need no torch; tests/cli/test_config_messages.py compares them).
OPTIMIZER_WEIGHT_DECAY = {"sgd": 0.0, "adam": 0.0, "adamw": 0.01}
DEVICES = ("auto", "cpu", "cuda")
#: ``--data-loading``: the features read whole at start (``memory``), a rank's batches read as it trains
#: them (``stream``), or ``auto``: streamed when they would not fit (flodl_mpi.training.data.load_dataset).
DATA_LOADING = ("auto", "memory", "stream")
#: What a round does with a rank whose loss or parameters are NaN/Inf (``--on-non-finite``).
ON_NON_FINITE = ("quarantine", "stop")
#: ``--on-rank-failure``: a rank's death ends the job (``stop``), or the survivors go on (``shrink``, ULFM).
ON_RANK_FAILURE = ("stop", "shrink")
#: The ``--outer`` choices (flodl_mpi.protocol.outer; kept here so the config needs no numpy).
OUTERS = ("avg", "slowmo", "nesterov")
#: ``--node-reduce``: how the ranks of one node sum their frames (flodl_mpi.transport.reduce.WireOptions).
NODE_REDUCES = ("auto", "shm", "mpi")
#: ``--hierarchical``: node sums first, then the node leaders across nodes.
HIERARCHICAL = ("auto", "on", "off")
#: ``--wire``: what a round's frames carry (flodl_mpi.transport.reduce.WireOptions). fp32: the parameters (summed
#: in float64); bf16: the parameters as bfloat16 (``--bf16-wire``); bf16-delta, int8-delta: the quantised change
#: since the last consensus, with error feedback (flodl_mpi.transport.delta_reduce).
WIRES = ("fp32", "bf16", "bf16-delta", "int8-delta")
#: The ``--average-optimizer-state`` choices (flodl_mpi.protocol.optimizer_state).
AVERAGE_OPTIMIZER_STATE = ("auto", "off", "mean", "corrected")
#: ``--lr-schedule``: the learning rate's decay over the run's cohort steps (flodl_mpi.training.lr_schedule).
LR_SCHEDULES = ("constant", "cosine", "step", "linear")
#: ``--lr-gamma``'s default: ``step``'s factor per ``--lr-step-size`` cohort steps (torch.optim.lr_scheduler.StepLR's).
LR_GAMMA_DEFAULT = 0.1
#: ``--keep-best``: the validation metrics a best checkpoint is chosen by (lower loss, higher accuracy).
BEST_METRICS = ("val_loss", "val_accuracy")
#: ``--amp``: torch.autocast's dtype for the forward pass (fp16 adds a GradScaler); off: the model's own dtype.
AMP_MODES = ("off", "bf16", "fp16")
#: ``--progress``: rank 0's bar within an epoch, or one line per epoch (auto: a bar on a terminal).
PROGRESS = ("auto", "bar", "lines")
#: ``--resume auto`` (``resume = "auto"``, ``resume="auto"``): continue the run when it holds a checkpoint,
#: else start it (a requeued job's first start). A plain ``--resume`` (True) refuses a run dir with none.
RESUME_AUTO = "auto"
#: Keys a config file may set besides :class:`TrainConfig`'s fields: what rank 0 prints, not how the
#: run trains (so they are not saved with the run). Flags given on the command line override them.
OUTPUT_OPTIONS = ("verbose", "quiet", "progress")
#: Command-line flags a config file refuses, and why.
NOT_IN_FILE = {"config": "a config file cannot name another one (give one --config on the command line)",
               "version": "--version prints the version and exits; it is not a run option",
               "help": "--help prints the options and exits; it is not a run option"}


def delta_refusal(delta: str, node_reduce: str, hierarchical: str, bf16: bool) -> str:
    """The one line refusing the delta wire with an option it does not run with (the config and the reducer alike)."""
    wire = f"--wire {delta}-delta"
    if bf16:
        return f"{wire} with --bf16-wire: --bf16-wire is --wire bf16 (absolute values); give one --wire"
    if node_reduce == "shm":
        return (f"{wire} travels over MPI (an Allgather of the quantised deltas over the world); it does not run "
                "with --node-reduce shm: use --node-reduce mpi or auto")
    return (f"{wire} is flat over the world (one Allgather of the quantised deltas); --hierarchical on is not "
            "implemented with it: use --hierarchical off or auto")


class ConfigError(ValueError):
    """A bad config value: one line naming the option, the value and what is allowed.

    Attributes:
        option: the field whose own value is bad (``"batch_size"``), with ``value``
            and ``allowed`` (the words after "must be"); None for a refusal of a
            combination of options.
        problem: the words after the option's name: ``"'0.1' is a string: must be a
            finite number > 0 (without quotes)"``, or ``"3.5: must be an integer >= 1"``.
    """

    def __init__(self, message: str, option: str | None = None, value: Any = None, allowed: str | None = None):
        super().__init__(message)
        self.option, self.value, self.allowed = option, value, allowed
        self.problem = value_problem(value, allowed) if allowed is not None else message


def value_problem(value: Any, allowed: str) -> str:
    """``VALUE: must be ALLOWED``, naming the type when it is the problem (issue 26 item 9).

    A config file's ``lr = "0.1"`` is a string where a number belongs: the words say so,
    not only the range (``'0.1' is a string: must be a finite number > 0 (without quotes)``);
    so is ``true`` where a number belongs. Choices (``one of ...``) and flags' own values
    (argparse converts them) read as before.
    """
    numeric = allowed.startswith(("a finite number", "an integer", "a number", "<="))
    if numeric and isinstance(value, str):
        try:
            float(value)
            quoted = " (without quotes)"
        except ValueError:
            quoted = ""
        return f"{value!r} is a string: must be {allowed}{quoted}"
    if numeric and isinstance(value, bool):
        return f"{value!r} is a boolean: must be {allowed}"
    return f"{value!r}: must be {allowed}"


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; units in the comments. ``None`` means "the default".

    Raises:
        ConfigError: from construction, naming the option as the command line spells it.
    """

    data: str | None = None           # HDF5 file; None = built-in digits
    train_x: str = "train/x"          # dataset names inside --data
    train_y: str = "train/y"
    test_x: str = "test/x"
    test_y: str = "test/y"
    model: str | None = None          # module:factory; None = built-in MLP
    epochs: int = 10                  # passes over the training set
    batch_size: int = 32              # samples per batch, per rank
    drop_last: bool = False           # drop each epoch's short last batch (else a lone sample is folded in)
    data_loading: str = "auto"        # one of DATA_LOADING: how --data's features reach memory
    lr: float = 1e-3                  # learning rate
    optimizer: str = "adam"           # one of OPTIMIZERS; a Python API run's own optimizer: "module:Class"
    momentum: float = 0.9             # sgd only
    weight_decay: float | None = None  # None = the optimizer's own (OPTIMIZER_WEIGHT_DECAY; a resume: the run's)
    policy: str = "sync"              # a registered policy (flodl_mpi.policy.registry)
    window: int = 1                   # batches per rank between rounds (policy window)
    anchor: int | None = None         # cadence/async: the slowest rank's first window, batches (None: BALANCER_DEFAULTS)
    max_anchor: int | None = None     # cadence/async: the anchor's ceiling, batches (None: BALANCER_DEFAULTS)
    overhead_target: float | None = None  # cadence/async: round time / anchor window time to grow past (None: the same)
    divergence_guard: bool = True     # cadence/async: the divergence guard gates anchor growth (SPEC §3)
    replay_plan: str | None = None    # cadence/async: follow this metrics.h5's recorded quotas and anchors
    easgd_alpha: float | None = None  # async easgd: theta += alpha (consensus - theta_snapshot), (0, 1]; None: ADOPTION_DEFAULTS
    async_adopt: str | None = None    # async: "delta" (consensus + own steps since the snapshot) or "easgd"
    #                                   (pull); None = delta, or easgd when easgd_alpha is set
    gamma: float = 1.0                # params mass exponent (SPEC §1)
    seed: int = 0                     # data order and model init
    checkpoint_every: int = 1         # epochs between checkpoints (0 = only the last)
    keep_checkpoints: int = 3         # newest complete checkpoints kept
    run_dir: str | None = None        # None = runs/<UTC time>, chosen by rank 0
    resume: bool | str = False        # True: continue the run in run_dir from its newest checkpoint (refused
    #                                   when there is none); RESUME_AUTO: continue it, or start it when there is none
    device: str = "auto"              # one of DEVICES
    stall_timeout: float = 600.0      # seconds without progress on any rank before the watchdog aborts (exit 3)
    chunk_elems: int = 1 << 18        # float32 elements per Allreduce piece (1 MiB)
    node_reduce: str = "auto"         # one of NODE_REDUCES: shm (shared-memory node reduce) when it fits, else mpi
    hierarchical: str = "auto"        # one of HIERARCHICAL: per-node partial sums across nodes
    bf16_wire: bool = False           # params and float buffers travel as bfloat16 (SPEC §7): --wire bf16
    wire: str | None = None           # one of WIRES; None = fp32, or bf16 with bf16_wire (its alias)
    on_non_finite: str = "quarantine"  # one of ON_NON_FINITE: a rank with NaN/Inf loss or params
    on_rank_failure: str | None = None  # one of ON_RANK_FAILURE; None: shrink under Open MPI with --with-ft ulfm
    outer: str = "avg"                # one of OUTERS: the outer optimizer on the consensus (SPEC §7)
    outer_lr: float | None = None     # outer learning rate; None = the outer's default (0.7)
    outer_momentum: float | None = None  # outer momentum in [0, 1); None = 0.5 (protocol.outer.OUTER_DEFAULTS)
    outer_reset_inner: bool = False   # clear each rank's optimizer state after each outer step
    average_optimizer_state: str = "auto"  # one of AVERAGE_OPTIMIZER_STATE (flodl_mpi.protocol.optimizer_state)
    scale_lr: bool = False            # linear scaling rule: lr x world size (Goyal et al. 2017)
    warmup_steps: int = 0             # cohort steps of the linear warm-up: from 0 (scale_lr: from lr) to the peak
    lr_schedule: str = "constant"     # one of LR_SCHEDULES, over the cohort steps after the warm-up
    lr_step_size: int | None = None   # step: cohort steps between decays (needed by step, refused by the others)
    lr_gamma: float | None = None     # step: the factor per lr_step_size steps; None = LR_GAMMA_DEFAULT
    amp: str = "off"                  # one of AMP_MODES: mixed precision of the forward pass (torch.autocast)
    accumulate: int = 1               # micro-batches of batch_size per optimizer step (gradient accumulation)
    val_fraction: float | None = None  # share of the training set held out for validation, split once from seed
    test_every_epoch: bool = False    # with a validation set: evaluate the test set every epoch too (else at the end)
    keep_best: str | None = None      # one of BEST_METRICS: keep checkpoints/best.h5, the best epoch's
    early_stop: int | None = None     # stop after this many epochs without a better keep_best (or val_loss)
    clip_grad_norm: float | None = None  # max L2 norm of each rank's gradients before its step; None = off
    eval_batch_size: int = 1024       # samples per evaluation batch
    threads: int | None = None        # torch threads per rank; None = the rule in flodl_mpi.runtime.launcher

    def __post_init__(self) -> None:
        def need(cond: bool, option: str, value: Any, allowed: str) -> None:
            if not cond:
                raise ConfigError(f"--{option.replace('_', '-')} {value_problem(value, allowed)}", option, value,
                                  allowed)

        for name in ("epochs", "batch_size", "window", "keep_checkpoints", "chunk_elems", "eval_batch_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name, v, "an integer >= 1")
        for name in ("seed", "checkpoint_every"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, name, v, "an integer >= 0")
        need(self.threads is None or (isinstance(self.threads, int) and not isinstance(self.threads, bool)
                                      and self.threads >= 1), "threads", self.threads, "an integer >= 1")
        need(self.chunk_elems <= 2**31 - 1, "chunk_elems", self.chunk_elems, "<= 2**31 - 1 (the MPI count limit)")
        for name in ("lr", "stall_timeout"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0, name, v,
                 "a finite number > 0")
        for name in ("momentum", "weight_decay"):
            v = getattr(self, name)
            need((v is None and name == "weight_decay") or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                            and math.isfinite(v) and v >= 0),
                 name, v, "a finite number >= 0")
        need(isinstance(self.gamma, (int, float)) and math.isfinite(self.gamma), "gamma", self.gamma, "a finite number")
        need(self.optimizer in OPTIMIZERS or _is_class_path(self.optimizer), "optimizer", self.optimizer,
             f"one of {', '.join(OPTIMIZERS)}")
        need(self.policy in policy_names(), "policy", self.policy, f"one of {', '.join(policy_names())}")
        need(self.device in DEVICES, "device", self.device, f"one of {', '.join(DEVICES)}")
        need(self.data_loading in DATA_LOADING, "data_loading", self.data_loading, f"one of {', '.join(DATA_LOADING)}")
        need(self.on_rank_failure is None or self.on_rank_failure in ON_RANK_FAILURE, "on_rank_failure",
             self.on_rank_failure, f"one of {', '.join(ON_RANK_FAILURE)}")
        need(self.on_non_finite in ON_NON_FINITE, "on_non_finite", self.on_non_finite,
             f"one of {', '.join(ON_NON_FINITE)}")
        need(self.outer in OUTERS, "outer", self.outer, f"one of {', '.join(OUTERS)}")
        need(self.node_reduce in NODE_REDUCES, "node_reduce", self.node_reduce, f"one of {', '.join(NODE_REDUCES)}")
        need(self.hierarchical in HIERARCHICAL, "hierarchical", self.hierarchical,
             f"one of {', '.join(HIERARCHICAL)}")
        need(isinstance(self.bf16_wire, bool), "bf16_wire", self.bf16_wire, "true or false")
        need(self.wire is None or self.wire in WIRES, "wire", self.wire, f"one of {', '.join(WIRES)}")
        if self.bf16_wire and self.wire not in (None, "bf16"):
            raise ConfigError(f"--bf16-wire with --wire {self.wire}: --bf16-wire is --wire bf16; give one of them")
        if self.wire_mode == "bf16" and self.node_reduce == "mpi" and self.hierarchical == "on":
            raise ConfigError(f"--{'bf16-wire' if self.bf16_wire else 'wire bf16'} with --node-reduce "
                              f"{self.node_reduce} --hierarchical on is not implemented; use --node-reduce shm (or "
                              "--hierarchical off)")
        if self.wire_mode.endswith("-delta") and (self.node_reduce == "shm" or self.hierarchical == "on"):
            raise ConfigError(delta_refusal(self.wire_mode.removesuffix("-delta"), self.node_reduce,
                                            self.hierarchical, False))
        need(self.average_optimizer_state in AVERAGE_OPTIMIZER_STATE, "average_optimizer_state",
             self.average_optimizer_state, f"one of {', '.join(AVERAGE_OPTIMIZER_STATE)}")
        need(self.outer_lr is None or (isinstance(self.outer_lr, (int, float)) and not isinstance(self.outer_lr, bool)
                                       and math.isfinite(self.outer_lr) and self.outer_lr > 0),
             "outer_lr", self.outer_lr, "a finite number > 0")
        need(self.outer_momentum is None
             or (isinstance(self.outer_momentum, (int, float)) and not isinstance(self.outer_momentum, bool)
                 and 0 <= self.outer_momentum < 1), "outer_momentum", self.outer_momentum, "a number in [0, 1)")
        need(isinstance(self.outer_reset_inner, bool), "outer_reset_inner", self.outer_reset_inner, "true or false")
        if self.outer == "avg" and (self.outer_lr is not None or self.outer_momentum is not None
                                    or self.outer_reset_inner):
            raise ConfigError("--outer-lr, --outer-momentum and --outer-reset-inner take effect with --outer slowmo "
                              "or nesterov; --outer avg adopts the consensus as it is")
        self._check_balancer(need)
        need(isinstance(self.resume, bool) or self.resume == RESUME_AUTO, "resume", self.resume,
             f"true, false or {RESUME_AUTO!r}")
        need(isinstance(self.scale_lr, bool), "scale_lr", self.scale_lr, "true or false")
        need(isinstance(self.warmup_steps, int) and not isinstance(self.warmup_steps, bool) and self.warmup_steps >= 0,
             "warmup_steps", self.warmup_steps, "an integer >= 0")
        self._check_schedule(need)
        self._check_validation(need)
        need(self.amp in AMP_MODES, "amp", self.amp, f"one of {', '.join(AMP_MODES)}")
        need(isinstance(self.accumulate, int) and not isinstance(self.accumulate, bool) and self.accumulate >= 1,
             "accumulate", self.accumulate, "an integer >= 1")
        need(self.clip_grad_norm is None or (isinstance(self.clip_grad_norm, (int, float))
                                             and not isinstance(self.clip_grad_norm, bool)
                                             and math.isfinite(self.clip_grad_norm) and self.clip_grad_norm > 0),
             "clip_grad_norm", self.clip_grad_norm, "a finite number > 0")
        need(isinstance(self.drop_last, bool), "drop_last", self.drop_last, "true or false")
        if self.resume and self.run_dir is None:
            raise ConfigError("--resume needs --run-dir: the run directory to continue")

    def _check_schedule(self, need) -> None:
        """``--lr-schedule`` and the options it takes: ``step`` needs ``--lr-step-size``; ``--lr-step-size``
        and ``--lr-gamma`` are refused with another schedule (they would change nothing)."""
        need(self.lr_schedule in LR_SCHEDULES, "lr_schedule", self.lr_schedule, f"one of {', '.join(LR_SCHEDULES)}")
        need(self.lr_step_size is None or (isinstance(self.lr_step_size, int) and not isinstance(self.lr_step_size, bool)
                                           and self.lr_step_size >= 1), "lr_step_size", self.lr_step_size,
             "an integer >= 1")
        need(self.lr_gamma is None or (isinstance(self.lr_gamma, (int, float)) and not isinstance(self.lr_gamma, bool)
                                       and math.isfinite(self.lr_gamma) and 0 < self.lr_gamma <= 1),
             "lr_gamma", self.lr_gamma, "a number in (0, 1]")
        if self.lr_schedule == "step" and self.lr_step_size is None:
            raise ConfigError("--lr-schedule step needs --lr-step-size N: the cohort steps between decays by "
                              "--lr-gamma")
        if self.lr_schedule != "step" and (self.lr_step_size is not None or self.lr_gamma is not None):
            raise ConfigError(f"--lr-step-size and --lr-gamma take effect with --lr-schedule step; --lr-schedule "
                              f"{self.lr_schedule} does not decay in steps")

    def _check_validation(self, need) -> None:
        """``--val-fraction`` and what needs a validation set: ``--test-every-epoch``, ``--keep-best``,
        ``--early-stop``."""
        need(self.val_fraction is None or (isinstance(self.val_fraction, (int, float))
                                           and not isinstance(self.val_fraction, bool) and 0 < self.val_fraction < 1),
             "val_fraction", self.val_fraction, "a number in (0, 1)")
        need(isinstance(self.test_every_epoch, bool), "test_every_epoch", self.test_every_epoch, "true or false")
        need(self.keep_best is None or self.keep_best in BEST_METRICS, "keep_best", self.keep_best,
             f"one of {', '.join(BEST_METRICS)}")
        need(self.early_stop is None or (isinstance(self.early_stop, int) and not isinstance(self.early_stop, bool)
                                         and self.early_stop >= 1), "early_stop", self.early_stop, "an integer >= 1")
        # Without --val-fraction the data may hold its own validation set (a val/ group, fit()'s val split):
        # what needs one is checked with the data (flodl_mpi.training.validation.settle_validation).

    @property
    def best_metric(self) -> str:
        """What ``--keep-best`` and ``--early-stop`` watch: ``--keep-best``'s metric, else ``val_loss``."""
        return self.keep_best or "val_loss"

    @property
    def lr_gamma_value(self) -> float:
        """``step``'s factor per ``--lr-step-size`` cohort steps (``--lr-gamma``; default `LR_GAMMA_DEFAULT`, 0.1)."""
        return LR_GAMMA_DEFAULT if self.lr_gamma is None else float(self.lr_gamma)

    @property
    def step_samples(self) -> int:
        """Samples of one optimizer step of one rank: ``batch_size × accumulate``, the unit of the batch plan."""
        return self.batch_size * self.accumulate

    def _check_balancer(self, need) -> None:
        """The policy options: valid values, and only with a policy that takes them (its registry entry)."""
        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        need(self.anchor is None or (integer(self.anchor) and self.anchor >= 1), "anchor", self.anchor,
             "an integer >= 1")
        need(self.max_anchor is None or (integer(self.max_anchor) and self.max_anchor >= self.anchor_value),
             "max_anchor", self.max_anchor, f"an integer >= the anchor ({self.anchor_value})")
        need(self.overhead_target is None or (number(self.overhead_target) and self.overhead_target > 0),
             "overhead_target", self.overhead_target, "a finite number > 0")
        need(isinstance(self.divergence_guard, bool), "divergence_guard", self.divergence_guard, "true or false")
        need(self.replay_plan is None or (isinstance(self.replay_plan, str) and self.replay_plan != ""),
             "replay_plan", self.replay_plan, "a run's metrics.h5 path")
        need(self.easgd_alpha is None or (number(self.easgd_alpha) and 0 < self.easgd_alpha <= 1), "easgd_alpha",
             self.easgd_alpha, "a number in (0, 1] (1 is the delta adoption)")
        need(self.async_adopt is None or self.async_adopt in ASYNC_ADOPTS, "async_adopt", self.async_adopt,
             f"one of {', '.join(ASYNC_ADOPTS)}")
        problem = policy_refusal(self)  # the options the policy does not take, in its entry's words
        if problem:
            raise ConfigError(problem)
        if self.easgd_alpha is not None and self.async_adopt == "delta":
            raise ConfigError(f"--easgd-alpha takes effect with --async-adopt easgd; --async-adopt "
                              f"{self.async_adopt_value} adds this rank's own steps to the consensus")

    @property
    def wire_mode(self) -> str:
        """What the frames carry, one of `WIRES`: ``--wire``, else ``bf16`` with ``--bf16-wire``, else ``fp32``."""
        return self.wire if self.wire is not None else ("bf16" if self.bf16_wire else "fp32")

    @property
    def weight_decay_value(self) -> float:
        """The weight decay a new optimizer is built with: ``--weight-decay``, else the optimizer's own
        default (`OPTIMIZER_WEIGHT_DECAY`: torch.optim's, 0.01 for AdamW); 0 for a factory's class."""
        if self.weight_decay is not None:
            return float(self.weight_decay)
        return OPTIMIZER_WEIGHT_DECAY.get(self.optimizer, 0.0)

    @property
    def anchor_value(self) -> int:
        """The initial anchor, batches (``--anchor``; default ``BALANCER_DEFAULTS["anchor"]``, 10)."""
        return BALANCER_DEFAULTS["anchor"] if self.anchor is None else int(self.anchor)

    @property
    def max_anchor_value(self) -> int:
        """The anchor's ceiling, batches (``--max-anchor``; default ``BALANCER_DEFAULTS["max_anchor"]``,
        1000, at least the anchor)."""
        if self.max_anchor is None:
            return max(BALANCER_DEFAULTS["max_anchor"], self.anchor_value)
        return int(self.max_anchor)

    @property
    def overhead_target_value(self) -> float:
        """The round overhead past which the anchor grows (``--overhead-target``; default
        ``BALANCER_DEFAULTS["overhead_target"]``, 0.05)."""
        if self.overhead_target is None:
            return float(BALANCER_DEFAULTS["overhead_target"])
        return float(self.overhead_target)

    @property
    def easgd_alpha_value(self) -> float:
        """Async's pull on adoption (``--easgd-alpha``; default ``ADOPTION_DEFAULTS["easgd_alpha"]``, 0.5;
        1.0 is delta's); 1.0 under ``delta``."""
        if self.async_adopt_value != "easgd":
            return 1.0
        return float(ADOPTION_DEFAULTS["easgd_alpha"]) if self.easgd_alpha is None else float(self.easgd_alpha)

    @property
    def async_adopt_value(self) -> str:
        """How ``async`` adopts (``--async-adopt``; default ``delta``, measured closer to sync in docs/benchmarks.rst;
        ``easgd`` when only ``--easgd-alpha`` is given, which implies it)."""
        if self.async_adopt is None:
            return "easgd" if self.easgd_alpha is not None else ADOPTION_DEFAULTS["async_adopt"]
        return self.async_adopt

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON-able values (saved as ``config.json`` and in checkpoints)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def own_loop_policies() -> tuple[str, ...]:
    """The policies an own loop (:class:`flodl_mpi.Averager`) may run: the registry's entries with ``own_loop``."""
    return tuple(n for n in policy_names() if policy_spec(n).own_loop)


def __getattr__(name: str) -> tuple[str, ...]:
    """``POLICIES`` (every registered policy), ``BALANCED_POLICIES`` (those taking ``--anchor``) and
    ``OWN_LOOP_POLICIES`` (those an own loop runs): views of `flodl_mpi.policy.registry`, read when
    asked (a policy registered later is in them)."""
    if name == "POLICIES":
        return policy_names()
    if name == "BALANCED_POLICIES":
        return taking("anchor")
    if name == "OWN_LOOP_POLICIES":
        return own_loop_policies()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_class_path(value: Any) -> bool:
    """``module:Class``: how a Python API run records an optimizer that is none of `OPTIMIZERS` (RMSprop...)."""
    return isinstance(value, str) and re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.<>]*", value) is not None


def optimizer_class(optimizer: str) -> str:
    """The optimizer's class name for a config's ``optimizer``: ``"sgd"`` is ``"SGD"``,
    ``"torch.optim.rmsprop:RMSprop"`` is ``"RMSprop"`` (what a checkpoint's rank state records)."""
    if optimizer in OPTIMIZER_CLASSES:
        return OPTIMIZER_CLASSES[optimizer]
    return optimizer.rpartition(":")[2].rpartition(".")[2]


def check_output_option(name: str, value: Any, where: str) -> Any:
    """A valid value of an `OUTPUT_OPTIONS` key, or ConfigError naming ``where`` (the file and key)."""
    if name == "verbose" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ConfigError(f"{where}: {value!r}: must be an integer >= 0 (the count of -v)")
    if name == "quiet" and not isinstance(value, bool):
        raise ConfigError(f"{where}: {value!r}: must be true or false")
    if name == "progress" and value not in PROGRESS:
        raise ConfigError(f"{where}: {value!r}: must be one of {', '.join(PROGRESS)}")
    return value


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file: top-level keys are the long options, ``-`` or ``_``.

    Keys are :class:`TrainConfig`'s fields and the `OUTPUT_OPTIONS` (``verbose``, an
    integer, the count of ``-v``; ``quiet``; ``progress``), checked here.

    Raises:
        ConfigError: missing file, bad TOML, an unknown key, a key no file may hold
            (`NOT_IN_FILE`, with the reason), or a bad output option.
    """
    p = Path(path)
    raw = _load(p)
    known = set(TrainConfig.field_names()) | set(OUTPUT_OPTIONS)
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in NOT_IN_FILE:
            raise ConfigError(f"--config {str(p)!r}: key {key!r} is not allowed in a config file: {NOT_IN_FILE[name]}")
        if name not in known:
            raise ConfigError(f"--config {str(p)!r}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        if name in OUTPUT_OPTIONS:
            check_output_option(name, value, _key_text(p, key))
        out[name] = value
    return out


def _load(p: Path) -> dict[str, Any]:
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config {str(p)!r}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {str(p)!r}: not valid TOML ({exc})") from None


def _key_text(p: Path, key: str) -> str:
    return f"--config {str(p)!r}: key {key!r}"


def config_key_text(path: str | Path, name: str) -> str:
    """``--config 'FILE': key 'KEY'``: where a config file sets field ``name``, the key as written there.

    For messages about a value read by `read_config_file` (so the file was read once,
    and is read again here only to spell the key as the user did: ``batch-size`` or
    ``batch_size``).
    """
    p = Path(path)
    try:
        spelled = next((key for key in _load(p) if key.replace("-", "_") == name), name.replace("_", "-"))
    except (ConfigError, OSError):  # changed or gone since: the option's own spelling
        spelled = name.replace("_", "-")
    return _key_text(p, spelled)


# ---------------------------------------------------------------- the Python API's arguments (one place)

def check_int(value: Any, name: str, minimum: int) -> int:
    """``value`` when it is an int (not a bool) >= ``minimum``; the words name the keyword ``name``.

    Raises:
        TypeError: not an int (``window must be an int, got str '2'``).
        ValueError: below ``minimum`` (``window must be >= 1, got 0``).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def own_loop_config(*, model: str, optimizer: str, policy: Any, window: Any, gamma: Any, run_dir: Any,
                    checkpoint_every: Any, keep_checkpoints: Any, stall_timeout: Any, on_non_finite: Any,
                    chunk_elems: Any, resume: Any, node_reduce: Any = "auto", hierarchical: Any = "auto",
                    bf16_wire: Any = False, wire: Any = None, pin_staging: Any = None) -> TrainConfig:
    """The ``flodl_mpi.Averager``'s arguments as a :class:`TrainConfig`, checked in the keywords' words.

    Args:
        model, optimizer: the config's records of them (``module:Class``; the optimizer's
            name, or the default).
        policy: one of `own_loop_policies` (the registry's entries with ``own_loop``); window:
            ``step()`` calls between rounds.
        node_reduce, hierarchical, bf16_wire, wire: how a round's frames travel, as the CLI's
            ``--node-reduce``, ``--hierarchical``, ``--bf16-wire``, ``--wire`` (one of `WIRES`, or None:
            fp32, or bf16 with ``bf16_wire``; the config refuses the combinations the CLI does).
        pin_staging: True, False or None (pinned when the model is on CUDA); checked here,
            not a config field.
        others: as :class:`TrainConfig`'s fields.

    Raises:
        TypeError: a value of the wrong kind (``window must be an int, got str '2'``).
        ValueError: a bad value or combination, naming the keyword (``policy='cadence': must be ...``);
            ConfigError (a ValueError) for a combination the config refuses.
    """
    own_loop = own_loop_policies()
    if policy not in own_loop:
        # cadence and async decide how many batches each rank trains; in your own
        # loop you decide that, so they are flodl_mpi.fit's (and the CLI's) only.
        raise ValueError(f"policy={policy!r}: must be one of {', '.join(own_loop)}"
                         + (" (the balanced policies set each rank's batches: use flodl_mpi.fit)"
                            if policy in policy_names() else ""))
    check_int(window, "window", 1)
    if policy == "sync" and window != 1:
        raise ValueError(f"window={window} contradicts policy='sync' (a round after every step); "
                         "use policy='window'")
    if policy == "window" and window == 1:  # never silently sync (issue 26 item 9)
        raise ValueError("policy='window' needs window=N: the step() calls between rounds, N >= 2 "
                         "(a window of 1 is policy='sync')")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma):
        raise ValueError(f"gamma must be a finite number, got {gamma!r}")
    check_int(checkpoint_every, "checkpoint_every", 0)
    check_int(keep_checkpoints, "keep_checkpoints", 1)
    check_int(chunk_elems, "chunk_elems", 1)
    if not (isinstance(stall_timeout, (int, float)) and stall_timeout > 0):
        raise ValueError(f"stall_timeout must be seconds > 0, got {stall_timeout!r}")
    if on_non_finite not in ON_NON_FINITE:
        raise ValueError(f"on_non_finite must be one of {', '.join(ON_NON_FINITE)}, got {on_non_finite!r}")
    if node_reduce not in NODE_REDUCES:
        raise ValueError(f"node_reduce must be one of {', '.join(NODE_REDUCES)}, got {node_reduce!r}")
    if hierarchical not in HIERARCHICAL:
        raise ValueError(f"hierarchical must be one of {', '.join(HIERARCHICAL)}, got {hierarchical!r}")
    if not isinstance(bf16_wire, bool):
        raise TypeError(f"bf16_wire must be True or False, got {type(bf16_wire).__name__} {bf16_wire!r}")
    if wire is not None and wire not in WIRES:
        raise ValueError(f"wire must be one of {', '.join(WIRES)} or None, got {wire!r}")
    if pin_staging is not None and not isinstance(pin_staging, bool):
        raise TypeError("pin_staging must be True, False or None (pinned for a model on CUDA), got "
                        f"{type(pin_staging).__name__} {pin_staging!r}")
    if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
        raise TypeError(f"run_dir must be a path or None, got {type(run_dir).__name__}")
    if resume and run_dir is None:
        raise ValueError("resume=True needs run_dir: the run directory to continue")
    return TrainConfig(model=model, data="(your training loop)", policy=policy, window=window, gamma=float(gamma),
                       run_dir=None if run_dir is None else str(run_dir), checkpoint_every=checkpoint_every,
                       keep_checkpoints=keep_checkpoints, stall_timeout=float(stall_timeout),
                       on_non_finite=on_non_finite, chunk_elems=chunk_elems, optimizer=optimizer, resume=resume,
                       node_reduce=node_reduce, hierarchical=hierarchical, bf16_wire=bf16_wire,
                       wire=wire)


def check_fit_arguments(*, train_step: Any, eval_fn: Any, lr_schedule: Any, eval_every: Any, optimizer: Any,
                        task: Any) -> None:
    """:func:`flodl_mpi.fit`'s own arguments (its other options are :class:`TrainConfig`'s fields).

    Raises:
        ValueError: ``train_step``, ``eval_fn`` or ``lr_schedule`` given and not callable (``lr_schedule``:
            nor one of `LR_SCHEDULES`);
            ``eval_every`` not an int >= 0; ``optimizer`` neither a factory nor one of
            `OPTIMIZERS`; ``task`` none of `TASKS` nor None.
    """
    if isinstance(lr_schedule, str) and lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule={lr_schedule!r}: must be a callable or one of {', '.join(LR_SCHEDULES)}")
    for name, value in (("train_step", train_step), ("eval_fn", eval_fn), ("lr_schedule", lr_schedule)):
        if value is not None and not callable(value) and not (name == "lr_schedule" and isinstance(value, str)):
            raise ValueError(f"{name} must be callable, got {type(value).__name__}")
    if not (isinstance(eval_every, int) and eval_every >= 0):
        raise ValueError(f"eval_every must be an int >= 0, got {eval_every!r}")
    if optimizer is not None and not callable(optimizer) and optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be a factory or one of sgd, adam, adamw, got {optimizer!r}")
    if task is not None and task not in TASKS:
        raise ValueError(f"task={task!r}: must be one of {', '.join(map(repr, TASKS))} or None (from the "
                         "targets)")
