"""flodl_mpi.Averager: argument checks (serial), the consensus against a float64 reference
(multi-rank, in process), and a rank's error ending the job promptly (a launched script)."""

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch import nn

import flodl_mpi
from flodl_mpi.errors import InputError
from tests.conftest import launch_argv, launch_env


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


# ---- argument checks: before MPI starts, so serial ------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({"policy": "cadence"}, InputError,
     "policy='cadence': must be one of sync, window \\(the balanced policies set each rank's batches: "
     "use flodl_mpi.fit\\)"),
    ({"policy": "sync", "window": 4}, InputError, "window=4 contradicts policy='sync'"),
    ({"policy": "window", "window": 0}, InputError, "window must be >= 1, got 0"),
    ({"policy": "window"}, InputError, r"^policy='window' needs window=N: the step\(\) calls between rounds, "
                                       r"N >= 2 \(a window of 1 is policy='sync'\)$"),  # issue 26 item 9: not sync
    ({"window": 2.5}, InputError, "window must be an int"),
    ({"gamma": float("nan")}, InputError, "gamma must be a finite number"),
    ({"optimizer": "adam"}, InputError, "optimizer must be a torch.optim.Optimizer"),
    ({"stall_timeout": 0}, InputError, "stall_timeout must be seconds > 0"),
    ({"on_non_finite": "ignore"}, InputError, "on_non_finite must be one of quarantine, stop"),
    # issue 26 item 9: a misspelt keyword is fit's line (was: Python's TypeError, under a launcher MPI_Abort)
    ({"windw": 3, "stall_timout": 5}, InputError,
     "^Averager\\(\\) got unknown option\\(s\\) stall_timout \\(did you mean stall_timeout\\?\\), windw "
     "\\(did you mean window\\?\\); the options it takes by name are bf16_wire, broadcast, checkpoint_every, "),
    # issue 20 item 2: the CLI's wire options, validated in config.py (own_loop_config) by their keywords
    ({"node_reduce": "nccl"}, InputError, "^node_reduce must be one of auto, shm, mpi, got 'nccl'$"),
    ({"hierarchical": True}, InputError, "^hierarchical must be one of auto, on, off, got True$"),
    ({"bf16_wire": "yes"}, InputError, "^bf16_wire must be True or False, got str 'yes'$"),
    ({"pin_staging": 1}, InputError, r"^pin_staging must be True, False or None \(pinned for a model on CUDA\), "
                                     "got int 1$"),
    ({"bf16_wire": True, "node_reduce": "mpi", "hierarchical": "on"}, InputError,
     r"^bf16_wire=True with node_reduce='mpi' hierarchical='on' is not implemented; use node_reduce='shm' "
     r"\(or hierarchical='off'\)$"),
])
def test_bad_arguments_are_refused_by_name(kwargs, error, match):
    # bad input of the API: InputError (one line from rank 0 and exit status 2 when uncaught)
    with pytest.raises(error, match=match):
        flodl_mpi.Averager(small_model(), **kwargs)


def test_model_must_be_a_module_with_float_params():
    with pytest.raises(InputError, match="model must be a torch.nn.Module, got function"):
        flodl_mpi.Averager(small_model)
    with pytest.raises(InputError, match="model has no parameters"):
        flodl_mpi.Averager(nn.ReLU())


# ---- the consensus, against a float64 reference (every rank, in process) ----------------------

def _steps(rank: int, round_: int) -> int:
    """Realized steps of ``rank`` in window ``round_`` (3 calls each): uneven, one rank idle once."""
    return [3, 2, 0, 1][(rank + round_) % 4]


@pytest.mark.mpi
@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_window_consensus_matches_reference(gamma):
    from mpi4py import MPI

    from flodl_mpi.protocol.realized_work import gamma_mass

    comm = MPI.COMM_WORLD
    rank = comm.rank
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(10 + rank)
    avg = flodl_mpi.Averager(model, optimizer=opt, policy="window", window=3, gamma=gamma)
    try:
        for r in range(4):
            realized = _steps(rank, r)
            for call in range(3):
                if call < realized:
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(torch.randn(16, 8, generator=gen)),
                                                torch.randint(0, 3, (16,), generator=gen)).backward()
                    opt.step()
                if call == 2:  # the window's last call runs the round: note what goes in
                    pre = np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])
                # a call without an optimizer step: the hook counted none, so it carries no mass
                update = avg.step()
            assert update is not None and update.steps_at_snapshot == realized
            all_pre, all_n = comm.allgather(pre), comm.allgather(realized)
            masses = np.array([gamma_mass(n, gamma) for n in all_n])
            ref = sum(m * p for m, p in zip(masses, all_pre)) / masses.sum()
            got = np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
            assert update.adopted
        states = comm.allgather({k: v.numpy().copy() for k, v in model.state_dict().items()
                                 if v.is_floating_point()})
        for k in states[0]:
            np.testing.assert_array_equal(states[0][k], states[rank][k])
    finally:
        avg.close()


@pytest.mark.mpi
@pytest.mark.parametrize("wire", [{"node_reduce": "mpi"}, {"bf16_wire": True}, {"bf16_wire": True, "node_reduce": "mpi"}])
def test_wire_options_give_the_mass_weighted_mean(wire):
    """Issue 20 item 2: the Averager's bridge comes from the CLI's factory (`flodl_mpi.training.setup.make_bridge`),
    so ``node_reduce`` and ``bf16_wire`` reach it, and its consensus is the mass-weighted mean of a float64 numpy
    reference (with ``bf16_wire``: of every rank's parameters rounded to bfloat16, SPEC §7)."""
    import json
    import tempfile
    from pathlib import Path

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.rank
    run_dir = Path(comm.bcast(tempfile.mkdtemp(prefix="flodl-wire-") if rank == 0 else None, root=0)) / "r"
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(20 + rank)
    avg = flodl_mpi.Averager(model, optimizer=opt, policy="window", window=2, run_dir=run_dir, **wire)
    try:
        assert avg.bridge.reducer.path in (("allgather-bf16",) if wire.get("bf16_wire") and
                                           wire.get("node_reduce") == "mpi" else
                                           ("allreduce",) if wire.get("node_reduce") == "mpi" else
                                           ("shm", "shm-in-place", "allgather-bf16", "allreduce"))
        assert avg.cfg.node_reduce == wire.get("node_reduce", "auto") and avg.cfg.bf16_wire == wire.get("bf16_wire",
                                                                                                          False)
        for r in range(3):
            realized = [2, 1, 0][(rank + r) % 3]
            for call in range(2):
                if call < realized:
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(torch.randn(16, 8, generator=gen)),
                                                torch.randint(0, 3, (16,), generator=gen)).backward()
                    opt.step()
                if call == 1:
                    pre = [p.detach().clone() for p in model.parameters()]
                update = avg.step()
            assert update is not None and update.steps_at_snapshot == realized
            sent = [(p.to(torch.bfloat16) if wire.get("bf16_wire") else p).double().numpy().ravel() for p in pre]
            all_pre, all_n = comm.allgather(np.concatenate(sent)), comm.allgather(realized)
            masses = np.array(all_n, dtype=np.float64)  # gamma 1: mass = realized steps
            got = np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])
            if masses.sum() == 0:
                continue
            ref = sum(m * p for m, p in zip(masses, all_pre)) / masses.sum()
            np.testing.assert_allclose(got, ref.astype(np.float32), rtol=1e-6, atol=1e-7)
        states = comm.allgather([p.detach().numpy().copy() for p in model.parameters()])
        for a, b in zip(states[0], states[rank]):
            np.testing.assert_array_equal(a, b)
    finally:
        avg.close()
    if rank == 0:  # the run's record and train.log say how the rounds travelled
        cfg = json.loads((run_dir / "config.json").read_text())
        assert (cfg["node_reduce"], cfg["hierarchical"], cfg["bf16_wire"]) == \
            (wire.get("node_reduce", "auto"), "auto", wire.get("bf16_wire", False))
        path = [line for line in (run_dir / "train.log").read_text().splitlines() if "averaging path: " in line]
        assert len(path) == 1 and f"--node-reduce {wire.get('node_reduce', 'auto')}" in path[0]
        assert ("--bf16-wire" in path[0]) == wire.get("bf16_wire", False)


FAILING_LOOP = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import flodl_mpi
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with flodl_mpi.Averager(model, optimizer=opt) as avg:
        for step in range(1000):
            if avg.rank == 1 and step == 3:
                raise RuntimeError("boom in the user's loop")
            opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
            avg.step()
    print("not reached", flush=True)
""")


@pytest.mark.slow
def test_an_error_on_one_rank_ends_the_job_promptly(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING_LOOP)
    t0 = time.monotonic()
    proc = subprocess.run(launch_argv(2, sys.executable, str(script)), capture_output=True, text=True, timeout=400,
                          env=launch_env(), check=False)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "rank 1: error: RuntimeError: boom in the user's loop; aborting the job" in proc.stderr
    assert "not reached" not in proc.stdout
    assert elapsed < 300  # rank 0 waits in a round: the abort ends it, not the 600 s stall timeout (generous: load)


def test_world_of_one_error_propagates_as_is(tmp_path):
    """Under plain python (a world of 1) the loop's own exception reaches the caller, nothing aborts."""
    script = tmp_path / "failing1.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        import flodl_mpi
        model = nn.Linear(4, 2)
        try:
            with flodl_mpi.Averager(model) as avg:
                avg.step()
                raise RuntimeError("boom in the user's loop")
        except RuntimeError as exc:
            print("caught:", exc, flush=True)
        print("closed:", avg._closed, flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=launch_env(), check=False)
    assert proc.returncode == 0, proc.stderr
    assert "caught: boom in the user's loop" in proc.stdout and "closed: True" in proc.stdout


@pytest.mark.mpi
def test_resume_continues_the_epochs_and_the_metrics():
    import tempfile
    from pathlib import Path

    from mpi4py import MPI

    from flodl_mpi.outputs.metrics import read_table

    comm = MPI.COMM_WORLD
    run_dir = Path(comm.bcast(tempfile.mkdtemp(prefix="flodl-avg-") if comm.rank == 0 else None, root=0)) / "r"
    gen = torch.Generator().manual_seed(comm.rank)

    def train(avg, model, opt, epochs):
        for _ in range(avg.epoch, epochs):
            for _ in range(5):
                opt.zero_grad()
                nn.functional.cross_entropy(model(torch.randn(16, 8, generator=gen)),
                                            torch.randint(0, 3, (16,), generator=gen)).backward()
                opt.step()
                avg.step()
            flodl_mpi.record_scalar("x", 1.0)
            avg.end_epoch()

    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with flodl_mpi.Averager(model, optimizer=opt, run_dir=run_dir) as avg:
        train(avg, model, opt, 2)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model2 = small_model()  # fresh values: the checkpoint must bring the consensus back
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    with flodl_mpi.Averager(model2, optimizer=opt2, run_dir=run_dir, resume=True) as avg:
        assert avg.epoch == 2 and avg.global_step == 10
        for k, v in model2.state_dict().items():
            torch.testing.assert_close(v, saved[k], msg=k)
        assert len(opt2.state) == len(opt.state)  # Adam's moments came back
        train(avg, model2, opt2, 3)
    if comm.rank == 0:
        np.testing.assert_array_equal(read_table(run_dir / "metrics.h5", "epochs")["epoch"], [1, 2, 3])
        np.testing.assert_array_equal(read_table(run_dir / "metrics.h5", "rounds")["round"], np.arange(15))
        np.testing.assert_array_equal(read_table(run_dir / "metrics.h5", "scalars")["epoch"], [1, 2, 3])


@pytest.mark.mpi
def test_a_step_the_amp_scaler_skips_carries_no_mass():
    """GradScaler skips optimizer.step() on inf gradients: the post-step hook counts none, so mass 0."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with flodl_mpi.Averager(model, optimizer=opt, policy="window", window=2) as avg:
        steps = []
        for call in range(2):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(torch.randn(8, 8)), torch.randint(0, 3, (8,)))
            if call == 1:
                loss = loss * float("inf")  # inf gradients: the scaler skips this step
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            steps.append(avg.step())
        assert steps[0] is None and steps[1].steps_at_snapshot == 1  # two calls, one realized step
        assert avg.global_step == 1


@pytest.mark.mpi
def test_end_epoch_closes_an_unfinished_window_so_the_checkpoint_is_the_consensus():
    """issue 26 item 2: window 5, 7 steps an epoch: end_epoch() averages the 2 pending calls before it saves.

    Was: the checkpoint held rank 0's own parameters (ranks apart by 0.05), and a resume handed them to every
    rank. Now the checkpoint and every rank's live parameters are the work-weighted consensus of the ranks'
    parameters before end_epoch (float64 reference; the last rank of W > 1 realized one of its two pending calls)."""
    import tempfile
    from pathlib import Path

    from mpi4py import MPI

    from flodl_mpi.outputs.checkpoint import load_state_dict

    comm = MPI.COMM_WORLD
    run_dir = Path(comm.bcast(tempfile.mkdtemp(prefix="flodl-avg-") if comm.rank == 0 else None, root=0)) / "r"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(20 + comm.rank)
    short = comm.size > 1 and comm.rank == comm.size - 1  # no batch for its last call: mass 1, not 2
    with flodl_mpi.Averager(model, optimizer=opt, policy="window", window=5, run_dir=run_dir) as avg:
        for call in range(7):
            if not (short and call == 6):
                opt.zero_grad()
                nn.functional.cross_entropy(model(torch.randn(16, 8, generator=gen)),
                                            torch.randint(0, 3, (16,), generator=gen)).backward()
                opt.step()
            assert (avg.step() is not None) == (call == 4)  # the one full window's round
        pre = np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])
        all_pre, pending = comm.allgather(pre), comm.allgather(avg.steps)
        assert pending == [2] * (comm.size - 1) + [1 if comm.size > 1 else 2]
        result = avg.end_epoch()
        assert result.summary.rounds == 2  # the window's and the one that closed the epoch's last window
        assert avg.steps == 0
        live = np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])
    ref = sum(n * p for n, p in zip(pending, all_pre)) / sum(pending)  # gamma 1: mass = realized steps (SPEC §1)
    if comm.size > 1:  # the ranks had moved apart: the path is a real average
        assert np.abs(all_pre[0] - all_pre[-1]).max() > 1e-3
    np.testing.assert_allclose(live, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(comm.allgather(live)[0], live)  # the same bits on every rank
    path = comm.bcast(result.checkpoint, root=0)
    assert path is not None and Path(path).name.startswith("ckpt-e000001-r000002")
    saved = np.concatenate([v.double().numpy().ravel() for k, v in load_state_dict(path).items()])
    np.testing.assert_array_equal(saved, live)  # was: rank 0's own parameters, all_pre[0]
