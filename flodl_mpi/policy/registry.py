"""One registry of the averaging policies: each policy is one entry (SPEC §3-§4).

An entry (:class:`PolicySpec`) says a policy's name, whether the training thread waits
for its rounds, its defaults, the words train.log and ``flodl-mpi report`` use for it,
which policy options apply to it (the config refuses the others, in the words the entry
gives), and how to build it. The CLI's ``--policy`` choices and ``--help``, the config's
policy checks, train.log's header, the report, :func:`flodl_mpi.fit` and
:class:`flodl_mpi.Averager` read the entries here; :func:`make_policy` builds the policy
a config names.

Adding a policy (docs/howto/add-policy.rst)::

    from flodl_mpi.policy.policies import Plan, Policy
    from flodl_mpi.policy.registry import PolicySpec, count, register

    class EveryThree(Policy):
        def plan(self) -> Plan:                      # batches per rank, the anchor
            return Plan((3,) * self.world_size, 3)

    register(PolicySpec("every3", blocking=True, help="after every 3 batches",
                        words=lambda values, unit: f"a round after every {count(3, unit)}",
                        build=lambda cfg, world_size: EveryThree(world_size)))

Invariant: every rank registers the same entries before it builds its config (they run
the same program), so every rank reads the same choices, the same refusals, and builds
the same policy. Importing this module imports neither numpy nor torch (the config and
the CLI's start-up read it); building a built-in policy imports
:mod:`flodl_mpi.policy.policies`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from flodl_mpi.policy.defaults import ADOPTION_DEFAULTS, BALANCER_DEFAULTS

if TYPE_CHECKING:  # pragma: no cover
    from flodl_mpi.policy.policies import Policy

__all__ = ["ADOPTION_OPTIONS", "BALANCER_OPTIONS", "POLICY_OPTIONS", "PolicySpec", "adoption", "blocking",
           "count", "describe", "either", "get", "help_text", "lookup", "make_policy", "names", "refusal",
           "register", "taking", "unregister"]

#: The config fields that belong to some policies only, and the flag a refusal names for each.
POLICY_OPTIONS = MappingProxyType({
    "window": "--window", "anchor": "--anchor", "max_anchor": "--max-anchor",
    "overhead_target": "--overhead-target", "divergence_guard": "--no-divergence-guard",
    "replay_plan": "--replay-plan", "async_adopt": "--async-adopt", "easgd_alpha": "--easgd-alpha"})
#: The ElChe balancer's options: refused together, in one line, by a policy without the balancer.
BALANCER_OPTIONS = ("anchor", "max_anchor", "overhead_target", "divergence_guard", "replay_plan")
#: How a policy that trains on during its rounds adopts their consensus.
ADOPTION_OPTIONS = ("async_adopt", "easgd_alpha")

#: The groups of options a refusal names together: (fields, what they belong to, the policy's
#: words that say what it does instead: a :class:`PolicySpec` attribute).
_GROUPS = (
    (("window",), "", "plans"),
    (BALANCER_OPTIONS, " (the balancer)", "plans"),
    (("easgd_alpha",), "", "adopts"),
    (("async_adopt",), "", "adopts"),
)

_NAME = re.compile(r"[a-z][a-z0-9_-]*")


@dataclass(frozen=True)
class PolicySpec:
    """One policy's entry: everything the front ends, the config and the records say about it.

    Attributes:
        name: the ``--policy`` word (``[a-z][a-z0-9_-]*``); also the name the built
            policy's checkpoint state carries.
        blocking: the training thread waits for each round (False: it trains on, as ``async``,
            and adopts the consensus later; only a blocking policy takes an outer step).
        help: ``--help``'s words after the name (``"after every batch"``).
        words: ``(values, unit) -> str``, the words in the parentheses of train.log's header
            and the report (``policy window (4 batches per rank per round)``): ``values`` is
            the run's config as a mapping (a :class:`~flodl_mpi.config.TrainConfig`'s
            ``to_dict()``, or a run's ``config.json``, which may predate an option: default
            what is missing), ``unit`` what one step is (``"batch"``; an own loop's
            ``"step() call"``; :func:`count` spells a number of them).
        build: ``(cfg, world_size) -> Policy``: the policy for a validated config on every
            rank alike (:func:`make_policy` calls it).
        options: which of `POLICY_OPTIONS` apply; the config refuses the others when given.
        defaults: the values the policy's options take when not given (read-only; the
            balancer's are `~flodl_mpi.policy.defaults.BALANCER_DEFAULTS`).
        quotas: its plan gives the ranks per-rank quotas and a moving anchor (the report's
            anchor line, the cadence figure, what ``--replay-plan`` replays).
        own_loop: :class:`flodl_mpi.Averager` runs it (its window counts ``step()`` calls).
        check: ``cfg -> str | None``: a refusal of its own (one line), or None.
        refusals: a refusal's words for an option in `POLICY_OPTIONS` it does not take,
            instead of the generic ones; formatted with ``{value}`` (the option's) and
            ``{name}`` (the policy's).
        plans, adopts: how it plans and adopts, closing the generic refusals
            (``--policy sync runs a fixed window``).
        outer: why a policy that is not blocking refuses ``--outer`` (after its name).

    Raises:
        ValueError: a bad name, an option not in `POLICY_OPTIONS`, ``words``/``build``/``check``
            not callable.
    """

    name: str
    blocking: bool
    help: str
    words: Callable[[Mapping[str, Any], str], str]
    build: Callable[[Any, int], Policy]
    options: Iterable[str] = frozenset()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    quotas: bool = False
    own_loop: bool = False
    check: Callable[[Any], str | None] | None = None
    refusals: Mapping[str, str] = field(default_factory=dict)
    plans: str = "plans its own windows"
    adopts: str = "adopts the consensus as it is"
    outer: str = "trains on while its rounds run"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or _NAME.fullmatch(self.name) is None:
            raise ValueError(f"policy name {self.name!r}: must match [a-z][a-z0-9_-]*")
        options = frozenset(self.options)
        unknown = sorted(options - set(POLICY_OPTIONS)) + sorted(set(self.refusals) - set(POLICY_OPTIONS))
        if unknown:
            raise ValueError(f"policy {self.name!r}: {unknown[0]!r} is not a policy option (one of "
                             f"{', '.join(POLICY_OPTIONS)})")
        for what in ("words", "build"):
            if not callable(getattr(self, what)):
                raise ValueError(f"policy {self.name!r}: {what} must be callable")
        if self.check is not None and not callable(self.check):
            raise ValueError(f"policy {self.name!r}: check must be callable or None")
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "blocking", bool(self.blocking))
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "refusals", MappingProxyType(dict(self.refusals)))


_REGISTRY: dict[str, PolicySpec] = {}


def register(spec: PolicySpec, *, replace: bool = False) -> PolicySpec:
    """Add ``spec`` to the registry (every rank, before its config is built); returns it.

    Raises:
        TypeError: ``spec`` is not a :class:`PolicySpec`.
        ValueError: a policy of that name is registered (``replace=True`` replaces it).
    """
    if not isinstance(spec, PolicySpec):
        raise TypeError(f"register() takes a PolicySpec, got {type(spec).__name__}")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"policy {spec.name!r} is registered already (replace=True replaces it)")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a registered policy (a test's toy, once it ran); an unknown name is ignored."""
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered policies' names, the built-in ones first (``sync, window, cadence, async``)."""
    return tuple(_REGISTRY)


def lookup(name: Any) -> PolicySpec | None:
    """The entry of ``name``; None when no policy of that name is registered (a run made elsewhere)."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def get(name: str) -> PolicySpec:
    """The entry of ``name``.

    Raises:
        KeyError: no such policy (the message lists the registered ones).
    """
    spec = lookup(name)
    if spec is None:
        raise KeyError(f"no policy {name!r} (registered: {', '.join(names())})")
    return spec


def blocking(name: Any) -> bool:
    """Whether the training thread waited for each round of policy ``name`` (a policy not
    registered here, say a run's recorded one: True, the usual)."""
    spec = lookup(name)
    return True if spec is None else spec.blocking


def taking(option: str) -> tuple[str, ...]:
    """The policies that take ``option`` (one of `POLICY_OPTIONS`), in registry order."""
    return tuple(s.name for s in _REGISTRY.values() if option in s.options)


def either(words: Iterable[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    words = list(words)
    if not words:
        return "none"
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def count(n: Any, unit: str) -> str:
    """``1 batch``, ``4 batches``, ``2 step() calls``: ``n`` of ``unit`` (``n`` not a number: the plural)."""
    if n == 1 and not isinstance(n, bool):
        return f"1 {unit}"
    return f"{n} {unit}{'es' if unit.endswith(('ch', 'sh', 's', 'x')) else 's'}"


def help_text(default: str) -> str:
    """``--policy``'s help: each registered policy in its own words, and the default."""
    return (f"when ranks average: {', '.join(f'{s.name} {s.help}' for s in _REGISTRY.values())} "
            f"(default {default})")


def describe(name: Any, values: Mapping[str, Any], unit: str = "batch") -> str:
    """``policy NAME (WORDS)``: the one wording of train.log's header and the report.

    Args:
        name: the run's policy; one not registered here gets ``policy NAME`` alone.
        values: the run's config as a mapping (``TrainConfig.to_dict()`` or ``config.json``).
        unit: one step's name: ``"batch"``, or an own loop's ``"step() call"``.
    """
    spec = lookup(name)
    return f"policy {name}" if spec is None else f"policy {name} ({spec.words(values, unit)})"


def _given(cfg: Any, option: str) -> bool:
    value = getattr(cfg, option)
    if option == "window":
        return value != 1
    if option == "divergence_guard":
        return value is False
    return value is not None


def refusal(cfg: Any) -> str | None:
    """The config's policy refusal, one line, or None (the config raises it as a ``ConfigError``).

    In order: the policy's own ``check``; each group of `POLICY_OPTIONS` given that the
    policy does not take (``--window``, the balancer's options together, ``--easgd-alpha``,
    ``--async-adopt``): the entry's ``refusals`` words, else ``--anchor take(s) effect with
    --policy cadence or async (the balancer); --policy sync runs a fixed window``; an
    ``--outer`` step with a policy that is not blocking.

    Args:
        cfg: a config whose values are valid one by one (a
            :class:`~flodl_mpi.config.TrainConfig` in its ``__post_init__``), with a
            registered ``policy``.
    """
    spec = get(cfg.policy)
    if spec.check is not None:
        problem = spec.check(cfg)
        if problem:
            return problem
    for fields, note, kind in _GROUPS:
        given = [f for f in fields if f not in spec.options and _given(cfg, f)]
        if not given:
            continue
        if given[0] in spec.refusals:
            return spec.refusals[given[0]].format(value=getattr(cfg, given[0]), name=spec.name)
        flags = ", ".join(POLICY_OPTIONS[f] for f in given)
        verb = "take(s)" if len(fields) > 1 else "takes"
        return (f"{flags} {verb} effect with --policy {either(taking(fields[0]))}{note}; --policy {spec.name} "
                f"{getattr(spec, kind)}")
    if not spec.blocking and getattr(cfg, "outer", "avg") != "avg":
        waiting = either(s.name for s in _REGISTRY.values() if s.blocking)
        return f"--outer {cfg.outer} needs a blocking policy ({waiting}): --policy {spec.name} {spec.outer}"
    return None


def make_policy(cfg: Any, world_size: int) -> Policy:
    """The policy ``cfg`` names (a :class:`~flodl_mpi.config.TrainConfig`), built by its entry.

    The built policy carries the entry's name (its checkpoint state says whose it is).

    Raises:
        KeyError: ``cfg.policy`` is not registered.
        TypeError: the built policy's ``blocking`` is not the entry's.
    """
    spec = get(cfg.policy)
    policy = spec.build(cfg, int(world_size))
    if bool(policy.blocking) != spec.blocking:
        raise TypeError(f"policy {spec.name!r}: its entry says blocking={spec.blocking}, the policy it builds "
                        f"has blocking={policy.blocking}")
    policy.name = spec.name
    return policy


# -- the built-in policies --------------------------------------------------------------------------------------

def adoption(values: Mapping[str, Any]) -> tuple[str, float]:
    """How an async run adopts, from its config: (``"delta"`` or ``"easgd"``, EASGD's alpha).

    ``async_adopt`` None is the default: delta, or easgd when ``easgd_alpha`` is given (which
    implies it); a config written before ``--async-adopt`` existed (no such key): easgd,
    then the only adoption.
    """
    if "async_adopt" not in values:
        adopt = "easgd"
    else:
        adopt = values["async_adopt"] or ("easgd" if values.get("easgd_alpha") is not None
                                          else ADOPTION_DEFAULTS["async_adopt"])
    alpha = values.get("easgd_alpha")
    return adopt, float(ADOPTION_DEFAULTS["easgd_alpha"] if alpha is None else alpha)


def _balancer_words(values: Mapping[str, Any], shrinks: bool) -> str:
    anchor = values.get("anchor") or BALANCER_DEFAULTS["anchor"]
    top = values.get("max_anchor") or max(BALANCER_DEFAULTS["max_anchor"], anchor)
    target = values.get("overhead_target") or BALANCER_DEFAULTS["overhead_target"]
    guard = "off" if values.get("divergence_guard", True) is False else "on"
    span = f"{anchor}, 1 to {top}" if shrinks else f"{anchor} to {top}"  # async also shrinks it
    return f"ElChe quotas per rank, anchor {span}, overhead target {target:g}, divergence guard {guard}"


def _cadence_words(values: Mapping[str, Any], unit: str) -> str:
    return _balancer_words(values, shrinks=False)


def _async_words(values: Mapping[str, Any], unit: str) -> str:
    adopt, alpha = adoption(values)
    how = ("adopt delta: consensus + own steps since the snapshot" if adopt == "delta"
           else f"adopt easgd, alpha {alpha:g}: own steps + alpha (consensus - snapshot)")
    return f"{_balancer_words(values, shrinks=True)}, {how}"


def _build_fixed(cfg: Any, world_size: int) -> Policy:
    from flodl_mpi.policy.policies import FixedPolicy, guard_threshold
    from flodl_mpi.protocol.divergence import TrendGuard

    # No NudgeDown by default: healthy runs rise 5 rounds in a row to 2-3x (benchmarks/README.md, guard_replay.py).
    return FixedPolicy(world_size, cfg.window, TrendGuard(threshold=guard_threshold(None)))


def _build_balanced(cfg: Any, world_size: int, blocking: bool) -> Policy:
    from flodl_mpi.policy.elche import ElChe
    from flodl_mpi.policy.policies import CadencePolicy, guard_threshold
    from flodl_mpi.protocol.divergence import TrendGuard

    # The blend leaves each rank (1 - alpha) of its way from the consensus: the guard reads 0.3 then.
    alpha = cfg.easgd_alpha_value if not blocking and cfg.async_adopt_value == "easgd" else None
    elche = ElChe(world_size, anchor=cfg.anchor_value, max_anchor=cfg.max_anchor_value,
                  overhead_target=cfg.overhead_target_value)
    return CadencePolicy(world_size, elche, TrendGuard(threshold=guard_threshold(alpha)),
                         act_on_guard=cfg.divergence_guard, blocking=blocking)


def _window_needed(cfg: Any) -> str | None:
    if cfg.window == 1:  # issue 26 item 9: never silently sync
        return ("--policy window needs --window N: the batches each rank trains between rounds, N >= 2 "
                "(a window of 1 is --policy sync)")
    return None


_FIXED = "runs a fixed window"
_BALANCER_WINDOW = ("--window {value} contradicts --policy {name}: the balancer sets each rank's window "
                    "(start it with --anchor)")

register(PolicySpec(
    "sync", blocking=True, help="after every batch", own_loop=True, plans=_FIXED,
    words=lambda values, unit: f"a round after every {unit}", build=_build_fixed,
    refusals={"window": "--window {value} contradicts --policy sync (a round after every batch); "
                        "use --policy window"}))
register(PolicySpec(
    "window", blocking=True, help="after every --window batches", own_loop=True, plans=_FIXED,
    options={"window"}, check=_window_needed, build=_build_fixed,
    words=lambda values, unit: f"{count(values.get('window', '?'), unit)} per rank per round"))
register(PolicySpec(
    "cadence", blocking=True, quotas=True, options=BALANCER_OPTIONS, defaults=BALANCER_DEFAULTS,
    help="after per-rank quotas that make uneven ranks arrive together (the ElChe balancer)",
    words=_cadence_words, build=lambda cfg, world_size: _build_balanced(cfg, world_size, True),
    refusals={"window": _BALANCER_WINDOW}))
register(PolicySpec(
    "async", blocking=False, quotas=True, options=BALANCER_OPTIONS + ADOPTION_OPTIONS,
    defaults={**BALANCER_DEFAULTS, **ADOPTION_DEFAULTS},
    help="as cadence while training goes on during the round (its consensus adopted by --async-adopt)",
    words=_async_words, build=lambda cfg, world_size: _build_balanced(cfg, world_size, False),
    refusals={"window": _BALANCER_WINDOW}, outer="blends the consensus into parameters that trained on"))
