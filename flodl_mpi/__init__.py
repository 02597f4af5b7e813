"""flodl_mpi: MPI-launched PyTorch training with work-weighted parameter averaging.

Every rank trains its own replica; a background bridge thread per rank averages
the parameters across ranks with MPI Allreduce, weighting each rank by the
optimizer steps it actually took since the last round (SPEC §1-2), and rank 0
writes metrics and checkpoints to HDF5.

Two ways in from Python, both the same under ``python script.py`` (a world of 1)
and ``mpiexec -n N python script.py``:

- :class:`Averager`: keep your own loop, call ``averager.step()`` after each optimizer step
  (:func:`shard` gives each rank its batches of an epoch under the CLI's plan).
- :func:`fit`: give a model factory, an optimizer factory, a train step and the
  data; iterate the returned :class:`Run` for the cohort's epoch metrics.

Importing the package loads no torch (the names below load on first use). Under a
launcher (``mpiexec``, ``srun``) it starts MPI and the exception hooks that abort
the job on an uncaught error on any rank (:func:`flodl_mpi.runtime.session.start_at_import`);
without one, MPI starts as a world of 1 on first use.
(The API's entry point is ``fit``, not ``train``: ``flodl_mpi.training.train`` is the CLI's module.)
"""

__version__ = "0.1.0"

__all__ = ["Averager", "CheckpointError", "EpochResult", "InputError", "Run", "Shard", "Stopped", "__version__",
           "build_model", "fit", "latest_checkpoint", "load_state_dict", "read_newest", "read_table", "record_scalar",
           "request", "shard"]

_WHERE = {
    "Averager": "flodl_mpi.api.averager",
    "EpochResult": "flodl_mpi.api.epoch_result",
    "InputError": "flodl_mpi.errors",
    "Stopped": "flodl_mpi.errors",
    "Run": "flodl_mpi.api.fit",
    "fit": "flodl_mpi.api.fit",
    "record_scalar": "flodl_mpi.training.scalars",
    # a rank's batches of an epoch under the CLI's plan, for an own loop
    "Shard": "flodl_mpi.training.shard",
    "shard": "flodl_mpi.training.shard",
    # reading a run's outputs (no MPI is needed for these)
    "CheckpointError": "flodl_mpi.outputs.checkpoint",
    "latest_checkpoint": "flodl_mpi.outputs.checkpoint",
    "load_state_dict": "flodl_mpi.outputs.checkpoint",
    "read_newest": "flodl_mpi.outputs.checkpoint",
    "read_table": "flodl_mpi.outputs.metrics",
    "build_model": "flodl_mpi.training.models",
    "request": "flodl_mpi.training.scalars",
}


def _start_if_launched() -> None:
    from flodl_mpi.runtime.session import start_at_import

    start_at_import()


_start_if_launched()


def __getattr__(name: str):
    # Lazy (PEP 562): importing the package must not start MPI (the launcher checks
    # come first, in flodl_mpi.runtime.session) nor load torch (the CLI's start-up order).
    if name in _WHERE:
        import importlib

        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flodl_mpi' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_WHERE))
