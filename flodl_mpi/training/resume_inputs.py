"""Which spellings of ``--model`` and ``--data`` name a run's own input, for ``--resume``.

Invariant: a resume is refused when its model file or data file is not the run's,
never for how the path is spelled. A ``--model path/to/file.py:fn`` names the run's
model when ``fn`` is the same and the file is the run's file (``os.path.samefile``
with the absolute path recorded at the start), or else a file of the same
content (the SHA-256 recorded at the start, `model_file_record`): a moved run
dir, another working directory. A run recorded before the hash was kept is compared as
before, by its spelling read from here (the same text, or a path to the same
file): nothing else tells its file apart from another one of the same name and
structure, whose forward() may differ. A module spec (``pkg.mod:fn``) is compared as text. A ``--data`` file
names the run's data when it is the same file, or when the run's record holds a
data fingerprint: `flodl_mpi.training.train.check_resume_data` compares that first.
Reads files only: the caller decides on one rank and shares the verdict.
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["data_path_difference", "file_sha256", "model_file_record", "model_spec_difference"]


def _file_spec(spec: str | None) -> tuple[str, str] | None:
    """``(file, factory)`` of a ``path/to/file.py:factory`` spec; None for a module spec or None."""
    if not isinstance(spec, str):
        return None
    module, _, attr = spec.rpartition(":")  # as `flodl_mpi.training.models.build_model` splits it
    return (module, attr) if module.endswith(".py") and attr else None


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, hex. Raises OSError when it cannot be read."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_file_record(spec: str | None) -> dict | None:
    """What a run records at its start of a ``--model`` file spec: ``{"path": absolute, "sha256": hex}``.

    None for the built-in model and a module spec (nothing to record). Call after
    the model was built from ``spec`` (the file exists and reads).
    """
    parsed = _file_spec(spec)
    if parsed is None:
        return None
    try:
        return {"path": os.path.realpath(parsed[0]), "sha256": file_sha256(parsed[0])}
    except OSError:  # gone since it was built: nothing recorded, a resume compares the spelling
        return None


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them is not there (from here)
        return False


def model_spec_difference(saved: str | None, now: str | None, record: dict | None) -> str | None:
    """None when ``now`` names the run's model; else one phrase for the refusal.

    Args:
        saved: the ``--model`` the checkpoint's run was started with (None: built-in).
        now: this resume's ``--model``.
        record: the run's `model_file_record` (from its newest config record), or None
            (the built-in model, a module spec, or a run from before it was recorded).
    """
    if saved == now:
        return None
    phrase = f"--model {now!r} (was {saved!r})"
    old, new = _file_spec(saved), _file_spec(now)
    if old is None or new is None or old[1] != new[1]:
        return phrase
    if not (isinstance(record, dict) and record.get("path") and record.get("sha256")):
        # An older run: its spelling, read from here, is all there is (what the same text would name).
        if _same_file(old[0], new[0]):
            return None
        return (f"{phrase}: the run recorded no content hash of its model file (an older flodl-mpi), and "
                f"{old[0]!r} is not that file from here; spell it as the run did, from its working directory")
    if _same_file(record["path"], new[0]):
        return None
    try:
        if file_sha256(new[0]) == record["sha256"]:
            return None
    except OSError:
        pass  # building the model read it; a file that vanished since differs
    return (f"--model {now!r}: {new[0]} is not the run's model file {record['path']} (was {saved!r}): "
            "its content differs")


def data_path_difference(saved: str | None, now: str | None, fingerprinted: bool) -> str | None:
    """None when ``--data`` ``now`` names the run's data file ``saved``; else one phrase for the refusal.

    Args:
        fingerprinted: the run's record holds a data fingerprint, so its content is
            compared on its own (`flodl_mpi.training.train.check_resume_data`, called before).
    """
    if saved == now:
        return None
    phrase = f"--data {now!r} (was {saved!r})"
    if saved is None or now is None:  # the built-in digits against a file
        return phrase
    if _same_file(saved, now) or fingerprinted:
        return None
    return (f"{phrase}: the run recorded no data fingerprint (an older flodl-mpi), and {saved!r} is not that "
            "file from here; spell it as the run did, from its working directory")

