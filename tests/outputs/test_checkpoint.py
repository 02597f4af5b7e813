"""Checkpoint files: round trip, atomicity, refusal of incomplete files, pruning."""

import os

import h5py
import numpy as np
import pytest
import torch

from flodl_mpi.outputs.checkpoint import (
    LIBVER,
    SCHEMA_VERSION,
    CheckpointError,
    checkpoint_name,
    escape_name,
    latest_checkpoint,
    list_checkpoints,
    load_state_dict,
    prune_checkpoints,
    read_checkpoint,
    set_aside_damaged,
    unescape_name,
    verify_checkpoint,
    write_checkpoint,
)
from tests.conftest import flip_data_byte


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def trained_model():
    """A model whose BatchNorm running stats and counter are not at their defaults."""
    model = make_model(0)
    model.train()
    for _ in range(3):
        model(torch.randn(16, 4))
    return model.eval()


def split_state(model):
    """(params, buffers, order) as numpy copies, the way the bridge snapshots them."""
    params = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}
    buffers = {k: v.detach().numpy().copy() for k, v in model.named_buffers()}
    return params, buffers, list(model.state_dict())


def save(path, model, round_=0, **meta):
    params, buffers, order = split_state(model)
    return write_checkpoint(path, params, buffers, {"round": round_, **meta}, order)


def test_round_trip_of_a_batchnorm_model(tmp_path):
    model = trained_model()
    meta = {"epoch": 5, "round": 123, "reason": "checkpoint", "lr": 0.05, "resumable": True,
            "config": {"policy": "cadence", "anchor": 3, "nested": {"gamma": [0.5, 1.0]}},
            "rng": np.arange(5, dtype=np.uint8)}
    params, buffers, order = split_state(model)
    path = write_checkpoint(tmp_path / checkpoint_name(5, 123), params, buffers, meta, order)
    assert path.name == "ckpt-e000005-r000123.h5"

    ckpt = read_checkpoint(path)
    state = model.state_dict()
    assert ckpt.order == list(state)
    for name in state:
        got = {**ckpt.params, **ckpt.buffers}[name]
        want = state[name].numpy()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()  # bit-equal
    nbt = ckpt.buffers["1.num_batches_tracked"]
    assert nbt.dtype == np.int64 and nbt.shape == () and int(nbt) == 3
    rng = ckpt.meta.pop("rng")
    assert rng.dtype == np.uint8 and rng.tolist() == [0, 1, 2, 3, 4]
    assert ckpt.meta == {k: v for k, v in meta.items() if k != "rng"}
    assert type(ckpt.meta["epoch"]) is int and type(ckpt.meta["resumable"]) is bool
    with h5py.File(path, "r") as f:
        assert f.attrs["schema_version"] == SCHEMA_VERSION and bool(f.attrs["complete"])
        assert list(f.attrs)[-1] == "complete"  # written last
        assert "0.weight" in f["params"]  # dotted names kept as they are


def test_load_state_dict_reproduces_the_model(tmp_path):
    model = trained_model()
    path = save(tmp_path / "a.h5", model)
    fresh = make_model(1).eval()
    x = torch.randn(7, 4)
    assert not torch.equal(fresh(x), model(x))
    state = load_state_dict(path)
    assert list(state) == list(model.state_dict())
    assert state["1.num_batches_tracked"].dtype == torch.int64
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), model(x))


def test_float64_is_stored_float32(tmp_path):
    path = write_checkpoint(tmp_path / "a.h5", {"w": np.array([1 / 3])}, {"flag": np.array(True)}, {}, ["w", "flag"])
    ckpt = read_checkpoint(path)
    assert ckpt.params["w"].dtype == np.float32 and ckpt.params["w"][0] == np.float32(1 / 3)
    assert ckpt.buffers["flag"].dtype == np.bool_ and bool(ckpt.buffers["flag"])


def test_bad_names_and_order_are_refused(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        write_checkpoint(tmp_path / "a.h5", {"": np.zeros(2, np.float32)}, {}, {}, [""])
    with pytest.raises(ValueError, match=r"missing from order: \['b'\]"):
        write_checkpoint(tmp_path / "a.h5", {"a": np.zeros(1)}, {"b": np.zeros(1)}, {}, ["a"])
    with pytest.raises(ValueError, match=r"unknown in order: \['c'\]"):
        write_checkpoint(tmp_path / "a.h5", {"a": np.zeros(1)}, {}, {}, ["a", "c"])
    with pytest.raises(ValueError, match="reserved"):
        write_checkpoint(tmp_path / "a.h5", {"a": np.zeros(1)}, {}, {"complete": True}, ["a"])
    assert os.listdir(tmp_path) == []


def test_incomplete_file_is_refused_and_skipped(tmp_path):
    good = save(tmp_path / checkpoint_name(0, 1), trained_model(), round_=1)
    bad = tmp_path / checkpoint_name(0, 2)
    with h5py.File(bad, "w") as f:  # what an interrupted write without the flag looks like
        f.create_group("params")
        f.attrs["round"] = 2
        f.attrs["schema_version"] = SCHEMA_VERSION
    with pytest.raises(CheckpointError, match=f"{bad.name}.*incomplete"):
        read_checkpoint(bad)
    (tmp_path / "notes.h5").write_text("not hdf5")
    assert list_checkpoints(tmp_path) == [good]
    assert latest_checkpoint(tmp_path) == good


def test_missing_foreign_and_newer_files_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        read_checkpoint(tmp_path / "nope.h5")
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(CheckpointError, match="not an HDF5 file"):
        read_checkpoint(tmp_path / "text.h5")
    path = save(tmp_path / "new.h5", trained_model())
    with h5py.File(path, "a") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(CheckpointError, match="newer"):
        read_checkpoint(path)
    assert latest_checkpoint(tmp_path / "no-dir") is None


def test_crash_mid_write_keeps_the_previous_file(tmp_path, monkeypatch):
    model = trained_model()
    path = save(tmp_path / "ckpt.h5", model, round_=1)
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    params, buffers, order = split_state(make_model(9))
    with pytest.raises(OSError, match="killed"):
        write_checkpoint(path, params, buffers, {"round": 2}, order)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert read_checkpoint(path).meta["round"] == 1
    assert os.listdir(tmp_path) == ["ckpt.h5"]  # the temporary file was removed


def test_list_prune_keep_the_newest(tmp_path):
    model = trained_model()
    # Written out of order: listing sorts by meta round, not by mtime.
    for r in (3, 1, 4, 2, 5):
        save(tmp_path / checkpoint_name(0, r), model, round_=r)
    want = [tmp_path / checkpoint_name(0, r) for r in (1, 2, 3, 4, 5)]
    assert list_checkpoints(tmp_path) == want

    dead = tmp_path / (checkpoint_name(0, 6) + ".tmp-999999999")  # no such pid
    dead.write_bytes(b"half a file")
    live = tmp_path / (checkpoint_name(0, 7) + f".tmp-{os.getpid()}")  # a write in flight
    live.write_bytes(b"in progress")

    deleted = prune_checkpoints(tmp_path, keep=2)
    assert sorted(deleted) == sorted(want[:3] + [dead])
    assert list_checkpoints(tmp_path) == want[3:]
    assert live.exists() and not dead.exists()
    with pytest.raises(ValueError, match="keep must be an int >= 1, got 0"):
        prune_checkpoints(tmp_path, keep=0)


def test_a_flipped_bit_in_the_weights_is_caught_not_loaded(tmp_path):
    w = np.arange(4096, dtype=np.float32)
    path = write_checkpoint(tmp_path / "c.h5", {"w": w}, {}, {}, ["w"])
    with h5py.File(path, "r") as f:
        offset = f["params/w"].id.get_chunk_info(0).byte_offset
    raw = bytearray(path.read_bytes())
    raw[offset + 100] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="unreadable data"):
        read_checkpoint(path)


# ---------------------------------------------------------------- names HDF5 cannot hold

ODD_NAMES = ["conv1/7x7.weight", "a%2Fb.bias", ".", "..", ".hidden", "x/", "/lead", "%", "%%2F/",
             " sp ace ", "nul\0byte", "ünï/cødé", "a//b", "0.weight"]


@pytest.mark.parametrize("name", ODD_NAMES)
def test_escape_name_round_trips_and_is_a_plain_link_name(name):
    link = escape_name(name)
    assert unescape_name(link) == name
    assert "/" not in link and "\0" not in link and not link.startswith(".")
    if not any(c in name for c in "%/\0") and not name.startswith("."):
        assert link == name  # ordinary names stay readable in h5dump


def test_every_name_pytorch_allows_comes_back_exactly(tmp_path):
    model = torch.nn.ModuleDict({"conv1/7x7": torch.nn.Linear(6, 4), "fc/out": torch.nn.Linear(4, 3),
                                 "100%": torch.nn.BatchNorm1d(4)})
    params = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}
    buffers = {k: v.detach().numpy().copy() for k, v in model.named_buffers()}
    odd = {name: np.full(2, i, np.float32) for i, name in enumerate(ODD_NAMES) if name not in params}
    order = [*model.state_dict(), *odd]
    path = write_checkpoint(tmp_path / "a.h5", {**params, **odd}, buffers, {"round": 1}, order)
    ckpt = read_checkpoint(path)
    assert ckpt.order == order
    assert set(ckpt.params) == set(params) | set(odd) and set(ckpt.buffers) == set(buffers)
    state = load_state_dict(path)
    assert list(state) == order
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name
    fresh = torch.nn.ModuleDict({"conv1/7x7": torch.nn.Linear(6, 4), "fc/out": torch.nn.Linear(4, 3),
                                 "100%": torch.nn.BatchNorm1d(4)})
    fresh.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    with h5py.File(path, "r") as f:
        assert "conv1%2F7x7.weight" in f["params"]  # one dataset, not a group "conv1"


def test_schema_1_files_are_still_read(tmp_path):
    """A schema-1 file stored names as they were, '%' included: read back unchanged."""
    path = tmp_path / "old.h5"
    with h5py.File(path, "w") as f:
        f.create_group("params").create_dataset("rate%2F.weight", data=np.arange(3, dtype=np.float32))
        f.create_group("buffers").create_dataset("n", data=np.int64(7))
        f.attrs["json_keys"] = "[]"
        f.attrs["schema_version"] = 1
        f.attrs["order"] = '["rate%2F.weight", "n"]'
        f.attrs["round"] = 4
        f.attrs["complete"] = True
    ckpt = read_checkpoint(path)
    assert list(ckpt.params) == ["rate%2F.weight"] and int(ckpt.buffers["n"]) == 7
    assert list(load_state_dict(path)) == ["rate%2F.weight", "n"]


# ---------------------------------------------------------------- damaged weight data



def test_damaged_weight_data_is_found_and_set_aside(tmp_path):
    older = save(tmp_path / checkpoint_name(1, 10), trained_model(), round_=10)
    newest = save(tmp_path / checkpoint_name(2, 20), trained_model(), round_=20)
    flip_data_byte(newest, "params", "0.weight")
    assert latest_checkpoint(tmp_path) == newest  # the header still reads as complete
    verify_checkpoint(older)
    with pytest.raises(CheckpointError, match=f"{newest.name}.*unreadable data in 'params/0.weight'"):
        verify_checkpoint(newest)

    chosen, aside = set_aside_damaged(tmp_path)
    assert chosen == older
    assert [(p.name, why.split(" (")[0]) for p, why in aside] == [(newest.name, "unreadable data in 'params/0.weight'")]
    assert not newest.exists() and newest.with_name(newest.name + ".damaged").exists()
    assert latest_checkpoint(tmp_path) == older


def test_set_aside_damaged_reads_only_down_to_the_newest_good_one(tmp_path):
    oldest = save(tmp_path / checkpoint_name(1, 10), trained_model(), round_=10)
    flip_data_byte(oldest, "params", "0.weight")  # older than the good one: never read, kept as it is
    good = save(tmp_path / checkpoint_name(2, 20), trained_model(), round_=20)
    truncated = tmp_path / checkpoint_name(3, 30)
    truncated.write_bytes(b"\x89HDF\r\n\x1a\n truncated")
    chosen, aside = set_aside_damaged(tmp_path)
    assert chosen == good and [p for p, _ in aside] == [truncated] and oldest.exists()
    assert set_aside_damaged(tmp_path / "missing") == (None, [])


# ---------------------------------------------------------------- HDF5 1.10 readers


def test_checkpoint_stays_within_hdf5_1_10_formats(tmp_path):
    """Copying every object into a file capped at v110 fails on any newer object version."""
    assert LIBVER[1] == "v110"
    big = {"config": {"k": "x" * 100_000}}  # needs dense attribute storage
    params, buffers, order = split_state(trained_model())
    path = write_checkpoint(tmp_path / "a.h5", params, buffers, {"round": 1, **big}, order,
                            ranks=[({"optimizer/state/0/exp_avg": np.ones(3)}, {"global_step": 3})])
    assert_readable_by_hdf5_1_10(path)


def assert_readable_by_hdf5_1_10(path):
    with h5py.File(path, "r") as src, h5py.File(path.with_suffix(".v110-copy"), "w",
                                                   libver=("earliest", "v110")) as dst:
        assert path.read_bytes()[8] <= 3  # superblock version: 1.10 reads 0..3
        for name in src:
            src.copy(src[name], dst, name)  # raises "... version out of bounds" past v110
        for key, value in src.attrs.items():
            dst.attrs[key] = value


def test_per_rank_subgroups_opened_once_make_the_file_per_tensor_paths_make(tmp_path):
    """Issue 26 item 10: each subgroup of a rank's arrays is created once, on its first array (not looked
    up again per tensor); the file holds the same groups and datasets, with the same dtypes and bytes,
    as h5py's own intermediate-group creation of each full path (the reference, built here)."""
    params, buffers, order = split_state(trained_model())
    rng = np.random.default_rng(0)
    arrays = {  # parents revisited out of order, several levels, a top-level name, int and float dtypes
        "optimizer/state/0/exp_avg": rng.standard_normal(5).astype(np.float32),
        "optimizer/state/1/exp_avg": rng.standard_normal((2, 3)),
        "optimizer/state/0/step": np.array(7.0, dtype=np.float32),
        "rng/torch": rng.integers(0, 255, 16).astype(np.uint8),
        "optimizer/state/1/step": np.array(3, dtype=np.int64),
        "int_buffers/1.num_batches_tracked": np.array(3, dtype=np.int64),
        "top": np.arange(4),
    }
    path = write_checkpoint(tmp_path / "a.h5", params, buffers, {"round": 1}, order,
                            ranks=[(arrays, {"global_step": 3}), (arrays, {"global_step": 4})],
                            cohort=(arrays, {"k": 1}))
    reference = tmp_path / "ref.h5"
    with h5py.File(reference, "w", libver=LIBVER, track_order=True) as f:
        for group in ("ranks/0", "ranks/1", "cohort"):
            g = f.create_group(group)
            for name, value in arrays.items():
                g.create_dataset(name, data=value)  # h5py makes the intermediate groups
    listing = {}
    for p in (path, reference):
        with h5py.File(p, "r") as f:
            seen = []
            for group in ("ranks/0", "ranks/1", "cohort"):
                f[group].visititems(lambda name, obj, g=group: seen.append(
                    (g, name, type(obj).__name__, obj[()].tobytes() if isinstance(obj, h5py.Dataset) else None,
                     obj.dtype.str if isinstance(obj, h5py.Dataset) else None)))
            listing[p] = seen
    assert listing[path] == listing[reference]
    assert len(listing[path]) == 3 * (len(arrays) + 6)  # 6 groups: optimizer, state, 0, 1, rng, int_buffers
    ckpt = read_checkpoint(path)
    for r in (0, 1):
        assert set(ckpt.ranks[r][0]) == set(arrays)
        for name, value in arrays.items():
            np.testing.assert_array_equal(ckpt.ranks[r][0][name], value)
            assert ckpt.ranks[r][0][name].dtype == value.dtype
