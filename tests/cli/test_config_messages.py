"""Config values a new user gets wrong (issue 26 items 9 and 11): the words name the real problem,
and an option left unset takes the library's default, never a silent other behaviour."""

from __future__ import annotations

import inspect

import pytest
import torch

from flodl_mpi.cli.main import build_parser, config_from_args
from flodl_mpi.config import OPTIMIZER_WEIGHT_DECAY, ConfigError, TrainConfig
from flodl_mpi.training.task import make_optimizer


def _cfg(tmp_path, text, *flags):
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    return config_from_args(build_parser().parse_args(["train", "--config", str(toml), *flags])), str(toml)


def test_a_quoted_number_in_the_config_file_is_named_a_string(tmp_path):
    """issue 26 item 9: TOML ``lr = "0.1"`` is the wrong type; the line says so, not only the range."""
    with pytest.raises(ConfigError) as info:
        _cfg(tmp_path, 'lr = "0.1"\n')
    path = str(tmp_path / "run.toml")
    assert str(info.value) == (f"--config {path!r}: key 'lr': '0.1' is a string: must be a finite number > 0 "
                               "(without quotes)")
    with pytest.raises(ConfigError) as info:
        _cfg(tmp_path, 'batch-size = "sixty"\n')
    assert str(info.value) == f"--config {path!r}: key 'batch-size': 'sixty' is a string: must be an integer >= 1"
    with pytest.raises(ConfigError) as info:  # a boolean where a number belongs (True is an int to Python)
        _cfg(tmp_path, "lr = true\n")
    assert str(info.value) == f"--config {path!r}: key 'lr': True is a boolean: must be a finite number > 0"
    with pytest.raises(ConfigError) as info:  # a wrong number keeps the range's words
        _cfg(tmp_path, "lr = -1.0\n")
    assert str(info.value) == f"--config {path!r}: key 'lr': -1.0: must be a finite number > 0"
    with pytest.raises(ConfigError, match=r"^--lr '0\.1' is a string: must be a finite number > 0 \(without"):
        TrainConfig(lr="0.1")  # fit(lr="0.1") and the Averager get the same words


def test_policy_window_without_a_window_is_refused_not_sync(tmp_path):
    """issue 26 item 9: ``--policy window`` without ``--window`` ran sync silently; it is refused in one line."""
    want = ("--policy window needs --window N: the batches each rank trains between rounds, N >= 2 "
            "(a window of 1 is --policy sync)")
    with pytest.raises(ConfigError) as info:
        config_from_args(build_parser().parse_args(["train", "--policy", "window"]))
    assert str(info.value) == want
    with pytest.raises(ConfigError) as info:
        _cfg(tmp_path, 'policy = "window"\n')
    assert str(info.value) == want
    assert config_from_args(build_parser().parse_args(["train", "--policy", "window", "--window", "3"])).window == 3
    cfg, _ = _cfg(tmp_path, 'policy = "window"\n', "--window", "4")
    assert (cfg.policy, cfg.window) == ("window", 4)


def test_weight_decay_defaults_to_each_optimizers_own(tmp_path):
    """issue 26 item 11: ``--optimizer adamw`` without ``--weight-decay`` gets torch.optim.AdamW's 0.01
    (it got 0.0, so AdamW was Adam); an explicit value, 0 included, is honoured; ``--help`` says so."""
    model = torch.nn.Linear(3, 2)
    for name, cls in (("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)):
        torch_default = inspect.signature(cls).parameters["weight_decay"].default
        assert OPTIMIZER_WEIGHT_DECAY[name] == torch_default
        cfg = config_from_args(build_parser().parse_args(["train", "--optimizer", name]))
        assert cfg.weight_decay is None and cfg.weight_decay_value == torch_default
        assert make_optimizer(cfg, model).param_groups[0]["weight_decay"] == torch_default
        explicit = config_from_args(build_parser().parse_args(["train", "--optimizer", name, "--weight-decay", "0"]))
        assert make_optimizer(explicit, model).param_groups[0]["weight_decay"] == 0.0
    assert OPTIMIZER_WEIGHT_DECAY["adamw"] == 0.01
    cfg, _ = _cfg(tmp_path, 'optimizer = "adamw"\nweight-decay = 0.0\n')
    assert make_optimizer(cfg, model).param_groups[0]["weight_decay"] == 0.0
    helptext = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "the optimizer's weight decay (default: the optimizer's own, as torch.optim's: sgd 0, adam 0, " \
           "adamw 0.01; on a resume, the run's)" in helptext
