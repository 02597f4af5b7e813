"""``flodl-mpi report`` and ``train --help`` name the adoption an async run used (trial 5 item 5).

Before: the report said "EASGD alpha 0.5" for every async run, though the default adoption
is delta, and ``--policy``'s help said "(EASGD blend on adoption)".
"""

import pytest

from flodl_mpi.cli.main import build_parser
from flodl_mpi.cli.report import describe_policy
from flodl_mpi.outputs.run_reader import load_run
from tests._runs import write_synthetic


@pytest.mark.parametrize(("config", "words"), [
    ({"async_adopt": None, "easgd_alpha": None}, "adopt delta)"),  # the default
    ({"async_adopt": "delta", "easgd_alpha": None}, "adopt delta)"),
    ({"async_adopt": "easgd", "easgd_alpha": None}, "adopt easgd, alpha 0.5)"),
    ({"async_adopt": "easgd", "easgd_alpha": 0.25}, "adopt easgd, alpha 0.25)"),
    ({"easgd_alpha": 0.75}, "adopt easgd, alpha 0.75)"),  # a config from before --async-adopt: EASGD only
])
def test_the_report_names_the_adoption_the_run_used(tmp_path, config, words):
    run = load_run(write_synthetic(tmp_path / "r", config={"policy": "async", **config},
                                   attrs={"policy": "async"}))
    text = describe_policy(run)
    assert text.startswith("policy async (ElChe quotas per rank, anchor 10, 1 to 1000, ") and text.endswith(words), text
    assert ("EASGD" in text) is False


def test_train_help_names_the_async_adopt_option_not_easgd():
    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    policy = next(a for a in sub._actions if "--policy" in a.option_strings)
    assert "--async-adopt" in policy.help and "EASGD" not in policy.help, policy.help
