"""Tests for flodl_mpi.training.models: the built-in MLP, the module:factory loader, signatures."""

import textwrap

import pytest
import torch
from torch import nn

from flodl_mpi.training.models import (
    ModelSpecError,
    build_model,
    check_training_step,
    digits_mlp,
    model_difference,
    model_signature,
    module_structure,
)


def model_file(tmp_path, body, name="usernet"):
    """Write ``body`` as ``<tmp_path>/<name>.py`` and return its path as a str."""
    path = tmp_path / f"{name}.py"
    path.write_text("import torch\nfrom torch import nn\n" + textwrap.dedent(body))
    return str(path)


# --------------------------------------------------------------------------- digits_mlp


def test_digits_mlp_forward_shape():
    model = digits_mlp((8, 8), 10, hidden=16)
    out = model(torch.zeros(4, 8, 8))
    assert out.shape == (4, 10)
    assert model[1].in_features == 64


def test_model_signature_of_digits_mlp():
    sig = model_signature(digits_mlp((64,), 10, hidden=32))
    assert sig == [
        ("1.weight", (32, 64), "float32"),
        ("1.bias", (32,), "float32"),
        ("2.weight", (32,), "float32"),
        ("2.bias", (32,), "float32"),
        ("4.weight", (32, 32), "float32"),
        ("4.bias", (32,), "float32"),
        ("6.weight", (10, 32), "float32"),
        ("6.bias", (10,), "float32"),
        ("2.running_mean", (32,), "float32"),
        ("2.running_var", (32,), "float32"),
        ("2.num_batches_tracked", (), "int64"),
    ]


def test_model_signature_differs_with_structure():
    assert model_signature(digits_mlp((64,), 10)) != model_signature(digits_mlp((64,), 9))


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (((), 10), TypeError, "input_shape must be a non-empty tuple"),
        (((64, 0), 10), ValueError, "input_shape entries must be >= 1, got 0"),
        (((64,), 0), ValueError, "num_classes must be >= 1, got 0"),
        (((64,), 10.0), TypeError, "num_classes must be an int"),
    ],
)
def test_digits_mlp_validates(args, exc, match):
    with pytest.raises(exc, match=match):
        digits_mlp(*args)


# --------------------------------------------------------------------------- build_model


def test_build_model_default_is_digits_mlp():
    model = build_model(None, [64], 10)
    assert model_signature(model) == model_signature(digits_mlp((64,), 10))


def test_factory_gets_both_arguments(tmp_path):
    path = model_file(
        tmp_path,
        """
        def make(input_shape, num_classes, width=5):
            assert isinstance(input_shape, tuple)
            return nn.Linear(input_shape[0], num_classes)
        """,
    )
    model = build_model(f"{path}:make", [7], 3)
    assert (model.in_features, model.out_features) == (7, 3)


def test_factory_with_no_arguments(tmp_path):
    path = model_file(tmp_path, "def make():\n    return nn.Linear(2, 2)\n")
    assert build_model(f"{path}:make", (64,), 10).out_features == 2


def test_factory_with_only_num_classes(tmp_path):
    path = model_file(tmp_path, "def make(*, num_classes):\n    return nn.Linear(4, num_classes)\n")
    assert build_model(f"{path}:make", (64,), 6).out_features == 6


def test_factory_with_kwargs(tmp_path):
    path = model_file(
        tmp_path,
        """
        def make(**kwargs):
            model = nn.Linear(kwargs["input_shape"][0], kwargs["num_classes"])
            model.seen = kwargs
            return model
        """,
    )
    model = build_model(f"{path}:make", (5,), 4)
    assert model.seen == {"input_shape": (5,), "num_classes": 4}


def test_class_as_factory_and_dotted_attribute(tmp_path):
    path = model_file(
        tmp_path,
        """
        class Net(nn.Module):
            def __init__(self, num_classes):
                super().__init__()
                self.fc = nn.Linear(3, num_classes)
            @classmethod
            def create(cls, input_shape, num_classes):
                return cls(num_classes + 1)
        """,
    )
    assert build_model(f"{path}:Net", (3,), 2).fc.out_features == 2
    assert build_model(f"{path}:Net.create", (3,), 2).fc.out_features == 3


def test_importable_module_form():
    # torch.nn.Identity has no parameters, so the dotted-import path reaches that check.
    with pytest.raises(ModelSpecError, match="'torch.nn:Identity': the model has no parameters"):
        build_model("torch.nn:Identity", (3,), 2)


@pytest.mark.parametrize("spec", ["no_colon_here", "mod:", ":make"])
def test_malformed_spec(spec):
    with pytest.raises(ModelSpecError, match="expected 'module:factory'"):
        build_model(spec, (3,), 2)


def test_spec_not_a_string():
    with pytest.raises(TypeError, match="spec must be a str"):
        build_model(42, (3,), 2)


def test_module_not_importable():
    with pytest.raises(
        ModelSpecError,
        match=r"cannot import module 'no_such_mod_xyz': ModuleNotFoundError: "
        r"No module named 'no_such_mod_xyz'",
    ):
        build_model("no_such_mod_xyz:make", (3,), 2)


def test_model_file_missing(tmp_path):
    with pytest.raises(ModelSpecError, match=r"no such file '.*missing\.py'"):
        build_model(f"{tmp_path}/missing.py:make", (3,), 2)


def test_model_file_fails_to_import(tmp_path):
    path = model_file(tmp_path, "import no_such_dependency_xyz\n")
    with pytest.raises(
        ModelSpecError, match="cannot import file .*No module named 'no_such_dependency_xyz'"
    ):
        build_model(f"{path}:make", (3,), 2)


def test_model_file_syntax_error(tmp_path):
    path = model_file(tmp_path, "def make(:\n")
    with pytest.raises(ModelSpecError, match="cannot import file .*SyntaxError"):
        build_model(f"{path}:make", (3,), 2)


def test_no_such_attribute(tmp_path):
    path = model_file(tmp_path, "def make():\n    return nn.Linear(2, 2)\n")
    with pytest.raises(ModelSpecError, match=r"usernet\.py' has no attribute 'mkae'"):
        build_model(f"{path}:mkae", (3,), 2)


def test_not_callable(tmp_path):
    path = model_file(tmp_path, "make = 3\n")
    with pytest.raises(ModelSpecError, match="'make' is a int, not callable"):
        build_model(f"{path}:make", (3,), 2)


def test_factory_raises(tmp_path):
    path = model_file(tmp_path, "def make():\n    raise RuntimeError('out of ideas')\n")
    with pytest.raises(ModelSpecError, match="factory raised RuntimeError: out of ideas") as info:
        build_model(f"{path}:make", (3,), 2)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_factory_needs_unknown_argument(tmp_path):
    path = model_file(tmp_path, "def make(depth):\n    return nn.Linear(2, depth)\n")
    with pytest.raises(ModelSpecError, match="factory raised TypeError: .*'depth'"):
        build_model(f"{path}:make", (3,), 2)


def test_factory_returns_non_module(tmp_path):
    path = model_file(tmp_path, "def make():\n    return [nn.Linear(2, 2)]\n")
    with pytest.raises(ModelSpecError, match="factory returned list, not a torch.nn.Module"):
        build_model(f"{path}:make", (3,), 2)


def test_model_without_parameters(tmp_path):
    path = model_file(tmp_path, "def make():\n    return nn.ReLU()\n")
    with pytest.raises(ModelSpecError, match="the model has no parameters"):
        build_model(f"{path}:make", (3,), 2)


def test_model_with_integer_parameter(tmp_path):
    path = model_file(
        tmp_path,
        """
        def make():
            m = nn.Linear(2, 2)
            m.steps = nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)
            return m
        """,
    )
    with pytest.raises(
        ModelSpecError, match="parameter 'steps' has dtype int64; all parameters must be floating"
    ):
        build_model(f"{path}:make", (3,), 2)


def test_error_messages_are_one_line(tmp_path):
    path = model_file(tmp_path, "def make():\n    raise ValueError('first\\nsecond')\n")
    with pytest.raises(ModelSpecError) as info:
        build_model(f"{path}:make", (3,), 2)
    assert str(info.value).endswith("factory raised ValueError: first second")


# --------------------------------------------------------------------------- check_training_step


def _state(model):
    """Every parameter and buffer (values, object identity) and every gradient, as copies."""
    return [(name, t, t.detach().clone(), None if t.grad is None else t.grad.clone())
            for name, t in [*model.named_parameters(), *model.named_buffers()]]


def _assert_same_state(model, before):
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert list(after) == [name for name, *_ in before]
    for name, obj, value, grad in before:
        assert after[name] is obj, name  # the same tensor object, still registered
        assert torch.equal(obj.detach(), value), name
        assert (obj.grad is None) == (grad is None) and (grad is None or torch.equal(obj.grad, grad)), name


def test_training_step_probe_changes_nothing():
    """Running stats, num_batches_tracked, params, grads, modes and the RNG are as before the probe."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(digits_mlp((64,), 10, hidden=16), torch.nn.Dropout(0.5))
    model.eval()
    model[0][2].train()  # a mixed mode, kept as it was
    model[0][1].weight.grad = torch.ones_like(model[0][1].weight)  # a gradient there already stays as it is
    before = _state(model)
    modes = [m.training for m in model.modules()]
    x, y = torch.rand(5, 64), torch.arange(5)
    rng = torch.get_rng_state()
    check_training_step(model, x, y, None, "raise --batch-size")
    _assert_same_state(model, before)
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)
    # The probe did run a training step: the same step outside it moves the running mean.
    model.zero_grad()
    model.train()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert not torch.equal(model[0][2].running_mean, before[-3][2]) and model[0][2].num_batches_tracked == 1


def test_training_step_probe_refuses_a_batch_of_one_with_batchnorm():
    model = digits_mlp((64,), 10, hidden=16)
    before = _state(model)
    with pytest.raises(ModelSpecError) as info:
        check_training_step(model, torch.rand(1, 64), torch.tensor([3]), None, "raise --batch-size")
    assert str(info.value) == ("the built-in model fails on a training batch of 1 sample "
                               "(BatchNorm needs more than 1 value per channel): raise --batch-size")
    _assert_same_state(model, before)  # restored on the error path too
    check_training_step(model, torch.rand(2, 64), torch.tensor([3, 4]), None, "raise --batch-size")


def test_training_step_probe_names_any_error_and_undoes_a_swapped_buffer(tmp_path):
    path = model_file(
        tmp_path,
        """
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 3)
                self.register_buffer("stat", torch.zeros(4))

            def forward(self, x):
                self.stat = x.mean(0).detach()  # replaces the registered buffer
                if len(x) < 3:
                    raise RuntimeError("needs 3 samples\\nor more")
                return self.fc(x)
        """,
    )
    model = build_model(f"{path}:Net", (4,), 3)
    before = _state(model)
    with pytest.raises(ModelSpecError, match=r"^--model '.*:Net' fails on a training batch of 2 samples "
                                             r"\(RuntimeError: needs 3 samples or more\): add --drop-last$"):
        check_training_step(model, torch.rand(2, 4), torch.tensor([0, 1]), f"{path}:Net", "add --drop-last")
    _assert_same_state(model, before)
    check_training_step(model, torch.rand(3, 4), torch.tensor([0, 1, 2]), f"{path}:Net", "x")
    _assert_same_state(model, before)


# --------------------------------------------------------------------------- the same model on every rank


def _described(model):
    return module_structure(model), model_signature(model)


def _net(act=nn.ReLU, hidden=32, extra=False):
    layers = [nn.Flatten(), nn.Linear(64, hidden), act(), nn.Linear(hidden, 10)]
    return nn.Sequential(*layers, *([nn.Softmax(dim=1)] if extra else []))


def test_module_structure_lists_every_module_with_its_class():
    assert module_structure(_net()) == [("", "Sequential"), ("0", "Flatten"), ("1", "Linear"), ("2", "ReLU"),
                                        ("3", "Linear")]


def test_the_same_model_on_every_rank_is_no_difference():
    assert model_difference([_described(_net()) for _ in range(3)]) is None


def test_a_parameter_free_layer_that_differs_is_named_with_the_ranks():
    # Same tensors (the signatures match); only the activation differs on ranks 1 and 3.
    assert model_signature(_net(nn.Tanh)) == model_signature(_net())
    gathered = [_described(_net(act)) for act in (nn.ReLU, nn.Tanh, nn.ReLU, nn.Tanh)]
    assert model_difference(gathered) == ("the model differs across ranks: module '2' is ReLU on rank 0 but Tanh "
                                          "on rank(s) 1, 3 (every rank must build the same model)")


def test_an_extra_module_and_a_different_root_are_named():
    assert model_difference([_described(_net()), _described(_net(extra=True))]) == (
        "the model differs across ranks: rank 0 has no further module where rank(s) 1 has module '4' (Softmax) "
        "(every rank must build the same model)")

    class Net(nn.Sequential):
        pass

    assert model_difference([_described(_net()), _described(Net(*_net()))]) == (
        "the model differs across ranks: the model itself is Sequential on rank 0 but "
        "test_an_extra_module_and_a_different_root_are_named.<locals>.Net on rank(s) 1 "
        "(every rank must build the same model)")


def test_same_modules_with_other_shapes_name_the_first_tensor():
    assert model_difference([_described(_net()), _described(_net(hidden=48))]) == (
        "the model differs across ranks: rank 0 has ('1.weight', (32, 64), 'float32') where rank(s) 1 has "
        "('1.weight', (48, 64), 'float32') (every rank must build the same model)")
