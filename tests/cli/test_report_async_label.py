"""``flodl-mpi report`` and ``train --help`` name the adoption an async run used (trial 5 item 5).

Before: the report said "EASGD alpha 0.5" for every async run, though the default adoption
is delta, and ``--policy``'s help said "(EASGD blend on adoption)".

Issue 20 item 4: the report and train.log now say a policy in one wording, the registry's
(`flodl_mpi.policy.registry.describe`): the report's ``adopt easgd, alpha 0.5`` kept (the
option's word), followed by train.log's explanation of the rule (``: own steps + alpha
(consensus - snapshot)``), and the overhead target and the guard as train.log said them; so
the words are asserted whole, before the closing parenthesis, where they were the ending.
"""

import pytest

from flodl_mpi.cli.main import build_parser
from flodl_mpi.cli.report import describe_policy
from flodl_mpi.outputs.run_reader import load_run
from tests._runs import write_synthetic


@pytest.mark.parametrize(("config", "words"), [
    ({"async_adopt": None, "easgd_alpha": None}, "adopt delta: consensus + own steps since the snapshot)"),  # default
    ({"async_adopt": "delta", "easgd_alpha": None}, "adopt delta: consensus + own steps since the snapshot)"),
    ({"async_adopt": "easgd", "easgd_alpha": None}, "adopt easgd, alpha 0.5: own steps + alpha (consensus - snapshot))"),
    ({"async_adopt": "easgd", "easgd_alpha": 0.25},
     "adopt easgd, alpha 0.25: own steps + alpha (consensus - snapshot))"),
    # a config from before --async-adopt: EASGD only
    ({"easgd_alpha": 0.75}, "adopt easgd, alpha 0.75: own steps + alpha (consensus - snapshot))"),
    # --easgd-alpha alone implies easgd (TrainConfig.async_adopt_value); the report said delta
    ({"async_adopt": None, "easgd_alpha": 0.25}, "adopt easgd, alpha 0.25: own steps + alpha (consensus - snapshot))"),
])
def test_the_report_names_the_adoption_the_run_used(tmp_path, config, words):
    run = load_run(write_synthetic(tmp_path / "r", config={"policy": "async", **config},
                                   attrs={"policy": "async"}))
    text = describe_policy(run)
    assert text.startswith("policy async (ElChe quotas per rank, anchor 10, 1 to 1000, overhead target 0.05, "
                           "divergence guard on, ") and text.endswith(words), text
    assert ("EASGD" in text) is False


def test_train_help_names_the_async_adopt_option_not_easgd():
    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    policy = next(a for a in sub._actions if "--policy" in a.option_strings)
    assert "--async-adopt" in policy.help and "EASGD" not in policy.help, policy.help
