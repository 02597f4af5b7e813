"""The policy registry (issue 20 item 4): every policy is one entry that the CLI's choices and
help, the config's checks, train.log, the report, ``fit`` and the ``Averager`` read; a toy policy
registered by a test (tests/policy/toy_policy.py) runs through the CLI and ``fit`` with no product
file touched, and gives the rounds and the consensus of the built-in policy that plans alike."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

from flodl_mpi import config
from flodl_mpi.cli.main import build_parser, config_from_args
from flodl_mpi.config import ConfigError, TrainConfig
from flodl_mpi.policy import registry
from flodl_mpi.policy.defaults import ADOPTION_DEFAULTS, BALANCER_DEFAULTS
from flodl_mpi.policy.elche import ElChe
from flodl_mpi.policy.policies import CadencePolicy, FixedPolicy, Plan
from flodl_mpi.policy.registry import PolicySpec, describe, make_policy
from tests.policy import toy_policy


@pytest.fixture
def toy():
    """The toy policy, registered for one test (and removed after: the registry is the process's)."""
    toy_policy.register_toy()
    yield toy_policy.SPEC
    toy_policy.unregister_toy()


def _train_action(dest: str):
    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    return next(a for a in sub._actions if a.dest == dest)


def test_the_built_in_entries():
    assert registry.names() == ("sync", "window", "cadence", "async")
    assert [registry.get(n).blocking for n in registry.names()] == [True, True, True, False]
    assert [n for n in registry.names() if registry.get(n).quotas] == ["cadence", "async"]
    assert [n for n in registry.names() if registry.get(n).own_loop] == ["sync", "window"]
    assert config.POLICIES == registry.names() and config.BALANCED_POLICIES == ("cadence", "async")
    assert registry.get("window").options == {"window"} and registry.get("sync").options == frozenset()
    assert registry.get("async").options == set(registry.BALANCER_OPTIONS) | {"async_adopt", "easgd_alpha"}
    assert registry.lookup("nope") is None and registry.blocking("nope") and not registry.blocking("async")
    with pytest.raises(KeyError, match="no policy 'nope' \\(registered: sync, window, cadence, async\\)"):
        registry.get("nope")


def test_the_defaults_are_typed_once():
    """The balancer's anchor 10, ceiling 1000 and overhead target 0.05, and EASGD's 0.5: one mapping
    that the config, ElChe's signature, the entries and ``--help`` read."""
    assert dict(BALANCER_DEFAULTS) == {"anchor": 10, "max_anchor": 1000, "overhead_target": 0.05}
    assert dict(ADOPTION_DEFAULTS) == {"async_adopt": "delta", "easgd_alpha": 0.5}
    cfg = TrainConfig(policy="cadence")
    assert (cfg.anchor_value, cfg.max_anchor_value, cfg.overhead_target_value) == (10, 1000, 0.05)
    assert TrainConfig(policy="cadence", anchor=2000).max_anchor_value == 2000  # never below the anchor
    assert TrainConfig(policy="async", async_adopt="easgd").easgd_alpha_value == 0.5
    sig = inspect.signature(ElChe).parameters
    assert (sig["anchor"].default, sig["max_anchor"].default, sig["overhead_target"].default) == (10, 1000, 0.05)
    assert registry.get("cadence").defaults == BALANCER_DEFAULTS
    assert registry.get("async").defaults == {**BALANCER_DEFAULTS, **ADOPTION_DEFAULTS}
    assert _train_action("anchor").help.endswith("(default 10)")
    assert _train_action("max_anchor").help.endswith("(default 1000)")
    assert _train_action("overhead_target").help.endswith("(default 0.05)")
    assert _train_action("easgd_alpha").help.endswith("(default 0.5)")
    assert "(default delta;" in _train_action("async_adopt").help


def test_help_and_choices_come_from_the_entries(toy):
    policy = _train_action("policy")
    assert tuple(policy.choices) == ("sync", "window", "cadence", "async", "every4")
    # the built-in policies' words as --help said them before the registry
    assert policy.help.startswith(
        "when ranks average: sync after every batch, window after every --window batches, cadence after per-rank "
        "quotas that make uneven ranks arrive together (the ElChe balancer), async as cadence while training goes "
        "on during the round (its consensus adopted by --async-adopt), every4 after every 4 batches (a test's toy) "
        "(default sync)"), policy.help
    assert config_from_args(build_parser().parse_args(["train", "--policy", "every4"])).policy == "every4"


@pytest.mark.parametrize(("kwargs", "words"), [
    ({}, "policy sync (a round after every batch)"),
    ({"policy": "window", "window": 4}, "policy window (4 batches per rank per round)"),
    ({"policy": "cadence", "anchor": 8},
     "policy cadence (ElChe quotas per rank, anchor 8 to 1000, overhead target 0.05, divergence guard on)"),
    ({"policy": "cadence", "max_anchor": 50, "overhead_target": 0.1, "divergence_guard": False},
     "policy cadence (ElChe quotas per rank, anchor 10 to 50, overhead target 0.1, divergence guard off)"),
    ({"policy": "async"}, "policy async (ElChe quotas per rank, anchor 10, 1 to 1000, overhead target 0.05, "
                          "divergence guard on, adopt delta: consensus + own steps since the snapshot)"),
    ({"policy": "async", "easgd_alpha": 0.25},
     "policy async (ElChe quotas per rank, anchor 10, 1 to 1000, overhead target 0.05, divergence guard on, "
     "adopt easgd, alpha 0.25: own steps + alpha (consensus - snapshot))"),
])
def test_one_wording_for_train_log_and_the_report(tmp_path, kwargs, words):
    """train.log's header says ``describe(cfg.policy, cfg.to_dict())``; the report says it from the run's
    config.json: the same words (before issue 20 they were two wordings)."""
    from flodl_mpi.cli.report import describe_policy
    from flodl_mpi.outputs.run_reader import load_run
    from tests._runs import write_synthetic

    cfg = TrainConfig(**kwargs)
    assert describe(cfg.policy, cfg.to_dict()) == words
    run = load_run(write_synthetic(tmp_path / "r", config=cfg.to_dict(), attrs={"policy": cfg.policy}))
    assert describe_policy(run) == words


def test_an_own_loop_counts_step_calls():
    assert describe("sync", {"window": 1}, "step() call") == "policy sync (a round after every step() call)"
    assert describe("window", {"window": 3}, "step() call") == "policy window (3 step() calls per rank per round)"
    assert describe("window", {"window": 1}, "step() call") == "policy window (1 step() call per rank per round)"
    assert describe("mine", {}) == "policy mine"  # a run's policy this process has not registered


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"window": 3}, "--window 3 contradicts --policy sync (a round after every batch); use --policy window"),
    ({"policy": "window"}, "--policy window needs --window N: the batches each rank trains between rounds, N >= 2 "
                           "(a window of 1 is --policy sync)"),
    ({"policy": "cadence", "window": 3}, "--window 3 contradicts --policy cadence: the balancer sets each rank's "
                                         "window (start it with --anchor)"),
    ({"anchor": 4, "divergence_guard": False}, "--anchor, --no-divergence-guard take(s) effect with --policy cadence "
                                               "or async (the balancer); --policy sync runs a fixed window"),
    ({"policy": "window", "window": 2, "replay_plan": "x.h5"},
     "--replay-plan take(s) effect with --policy cadence or async (the balancer); --policy window runs a fixed "
     "window"),
    ({"policy": "cadence", "easgd_alpha": 0.5}, "--easgd-alpha takes effect with --policy async; --policy cadence "
                                                "adopts the consensus as it is"),
    ({"policy": "sync", "async_adopt": "delta"}, "--async-adopt takes effect with --policy async; --policy sync "
                                                 "adopts the consensus as it is"),
    ({"policy": "async", "outer": "slowmo"}, "--outer slowmo needs a blocking policy (sync, window or cadence): "
                                             "--policy async blends the consensus into parameters that trained on"),
])
def test_the_refusals_are_the_entries_words(kwargs, message):
    """The words the config said before the registry, whole."""
    with pytest.raises(ConfigError) as info:
        TrainConfig(**kwargs)
    assert str(info.value) == message and info.value.option is None


def test_make_policy_builds_each_entry():
    assert isinstance(make_policy(TrainConfig(), 2), FixedPolicy) and make_policy(TrainConfig(), 2).name == "sync"
    p = make_policy(TrainConfig(policy="window", window=5), 3)
    assert (p.name, p.plan()) == ("window", Plan((5, 5, 5), 5))
    p = make_policy(TrainConfig(policy="async", anchor=6), 2)
    assert isinstance(p, CadencePolicy) and (p.name, p.blocking, p.plan()) == ("async", False, Plan((6, 6), 6))


def test_a_toy_policy_is_one_entry(toy):
    """Registered in a few lines (toy_policy.py), it is a choice, a config, a policy and words, and the
    options it does not take are refused in the generic words."""
    cfg = TrainConfig(policy="every4")
    p = make_policy(cfg, 3)
    assert isinstance(p, toy_policy.EveryFour) and (p.name, p.blocking, p.plan()) == ("every4", True,
                                                                                       Plan((4, 4, 4), 4))
    assert p.state_dict()["name"] == "every4"  # a checkpoint says whose state it holds
    assert describe("every4", cfg.to_dict()) == "policy every4 (a round after every 4 batches)"
    assert describe("every4", cfg.to_dict(), "step() call") == "policy every4 (a round after every 4 step() calls)"
    assert TrainConfig(policy="every4", outer="slowmo").outer == "slowmo"  # blocking: an outer step is fine
    for kwargs, message in [
        ({"window": 2}, "--window takes effect with --policy window; --policy every4 plans its own windows"),
        ({"anchor": 4, "replay_plan": "x.h5"}, "--anchor, --replay-plan take(s) effect with --policy cadence or "
                                               "async (the balancer); --policy every4 plans its own windows"),
        ({"easgd_alpha": 0.5}, "--easgd-alpha takes effect with --policy async; --policy every4 adopts the "
                               "consensus as it is"),
    ]:
        with pytest.raises(ConfigError) as info:
            TrainConfig(policy="every4", **kwargs)
        assert str(info.value) == message
    from flodl_mpi.cli.plots import quota_policies

    assert quota_policies() == ("cadence", "async")  # its plan has no per-rank quotas to draw
    # a blocking toy joins the list of the policies an outer step needs
    with pytest.raises(ConfigError, match=r"needs a blocking policy \(sync, window, cadence or every4\)"):
        TrainConfig(policy="async", outer="nesterov")


def test_an_unregistered_policy_is_refused_as_before():
    with pytest.raises(ConfigError) as info:
        TrainConfig(policy="every4")
    assert str(info.value) == "--policy 'every4': must be one of sync, window, cadence, async"


def test_register_refuses_what_would_break_a_run(toy):
    with pytest.raises(ValueError, match="'every4' is registered already"):
        registry.register(toy)
    assert registry.register(toy, replace=True) is toy
    with pytest.raises(TypeError, match="takes a PolicySpec"):
        registry.register("every4")
    with pytest.raises(ValueError, match="policy name 'Bad Name'"):
        PolicySpec("Bad Name", True, "x", words=lambda v, u: "", build=lambda c, w: None)
    with pytest.raises(ValueError, match="'lr' is not a policy option"):
        PolicySpec("fine", True, "x", words=lambda v, u: "", build=lambda c, w: None, options={"lr"})
    with pytest.raises(ValueError, match="build must be callable"):
        PolicySpec("fine", True, "x", words=lambda v, u: "", build=None)
    liar = PolicySpec("liar", blocking=False, help="x", words=lambda v, u: "", build=toy.build)
    registry.register(liar)
    try:
        with pytest.raises(TypeError, match="its entry says blocking=False, the policy it builds has blocking=True"):
            make_policy(TrainConfig(policy="liar"), 2)
    finally:
        registry.unregister("liar")


# -- the toy through the front ends ------------------------------------------------------------------------------

def _check_rounds_of_every_four(rounds: dict, epochs: int, n_batches: int = 45, world: int = 2) -> None:
    """Each epoch of ``n_batches`` global batches at ``world`` ranks: full windows of 4 batches per rank, then
    one window that hands out the rest (`flodl_mpi.policy.cadence.fit_quotas`)."""
    full, rest = divmod(n_batches, 4 * world)
    per_epoch = full + (rest > 0)
    assert len(rounds["round"]) == epochs * per_epoch
    window = rounds["window"].reshape(epochs, per_epoch, world)
    assert (window[:, :full] == 4).all() and (rounds["quota"] == 4).all() and (rounds["anchor"] == 4).all()
    assert (window[:, full:].sum(axis=(1, 2)) == rest).all() and (window.sum(axis=(1, 2)) == n_batches).all()
    np.testing.assert_array_equal(rounds["steps"], rounds["window"])  # a round's steps: the window each rank ran


def test_a_toy_policy_runs_through_the_cli_as_the_built_in_that_plans_alike(tmp_path, toy):
    """The toy registered in this process (the ``toy`` fixture), then the CLI's main, at a world of 1 in a
    fork (tests/conftest.py's fork_flodl: the child has the parent's registry): its rounds are windows of 4
    batches, 11 an epoch and then the 1 batch left of 45 (hand-worked: 45 = 11 x 4 + 1), and its rounds
    table and final model are those of a ``--window 4`` run with the same options, forked alike, bit for
    bit. A world of 1 suffices: what is shown is that the CLI plans, logs and reports through the
    registered entry. (This was a 2-rank launch of a script that registers the toy and calls the CLI's
    main, against the session's 2-rank ``--window 4`` run, tests/_runs.py RUN_B. That every rank plans a
    registered policy alike, to one consensus, is the multi-rank ``fit`` test below, run by the suite's
    multi-rank stages.)"""
    from flodl_mpi.cli.report import format_summary
    from flodl_mpi.outputs.checkpoint import latest_checkpoint, read_checkpoint
    from flodl_mpi.outputs.metrics import read_table
    from flodl_mpi.outputs.run_reader import load_run
    from tests.conftest import fork_flodl

    same = ("--epochs", "3", "--gamma", "0.5")
    reference, run_dir = tmp_path / "window4", tmp_path / "toy"
    ref_proc = fork_flodl("train", *same, "--window", "4", "--run-dir", str(reference), timeout=400)
    assert ref_proc.returncode == 0, ref_proc.stdout[-2000:] + ref_proc.stderr[-3000:]
    proc = fork_flodl("train", "--policy", "every4", *same, "--run-dir", str(run_dir), timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    header = next(line for line in (run_dir / "train.log").read_text().splitlines() if ": 1 rank, " in line)
    assert "1 rank, policy every4 (a round after every 4 batches), gamma 0.5" in header
    rounds = read_table(run_dir / "metrics.h5", "rounds")
    _check_rounds_of_every_four(rounds, epochs=3, world=1)
    assert len(rounds["round"]) == 3 * 12
    want = read_table(reference / "metrics.h5", "rounds")
    for col in ("round", "window", "quota", "anchor", "steps", "mass"):
        np.testing.assert_array_equal(rounds[col], want[col], err_msg=col)
    got, ref = (read_checkpoint(latest_checkpoint(d / "checkpoints")) for d in (run_dir, reference))
    assert got.meta["policy"]["name"] == "every4" and got.meta["epoch"] == ref.meta["epoch"] == 3
    assert ref.meta["policy"]["name"] != "every4"  # the reference is the built-in's
    assert got.params.keys() == ref.params.keys()
    for name in ref.params:
        np.testing.assert_array_equal(got.params[name], ref.params[name], err_msg=name)
    assert "policy every4 (a round after every 4 batches)" in format_summary(load_run(run_dir)).splitlines()[0]


@pytest.mark.mpi
def test_a_toy_policy_runs_through_fit_as_the_built_in_that_plans_alike(toy):
    """``fit(policy="every4")`` at 2 ranks: its rounds are windows of 4 batches per rank, and its rounds
    and consensus are those of ``fit(policy="window", window=4)``, bit for bit, on every rank."""
    import tempfile

    import torch
    from mpi4py import MPI

    import flodl_mpi
    from flodl_mpi.outputs.metrics import read_table

    comm = MPI.COMM_WORLD
    if comm.size != 2:
        pytest.skip("the rounds asserted are those of 2 ranks")
    base = Path(comm.bcast(tempfile.mkdtemp(prefix="flodl-toy-") if comm.rank == 0 else None, root=0))
    runs = {}
    for name, kwargs in (("toy", {"policy": "every4"}), ("window", {"policy": "window", "window": 4})):
        run = flodl_mpi.fit(epochs=1, run_dir=base / name, **kwargs)
        run.wait()
        assert run.done
        runs[name] = {k: v.detach().clone() for k, v in run.state_dict().items()}
    for k, v in runs["window"].items():
        assert torch.equal(runs["toy"][k], v), k
    # the same consensus on every rank (BatchNorm's num_batches_tracked counts each rank's own batches)
    mine = {k: v.numpy().tobytes() for k, v in runs["toy"].items() if v.is_floating_point()}
    assert len(mine) == 10 and all(other == mine for other in comm.allgather(mine))  # 4 layers, BN stats
    if comm.rank == 0:
        rounds = read_table(base / "toy" / "metrics.h5", "rounds")
        _check_rounds_of_every_four(rounds, epochs=1)
        want = read_table(base / "window" / "metrics.h5", "rounds")
        for col in ("window", "quota", "anchor", "steps", "mass"):
            np.testing.assert_array_equal(rounds[col], want[col], err_msg=col)
        assert "policy every4 (a round after every 4 batches)" in (base / "toy" / "train.log").read_text()
    comm.barrier()
