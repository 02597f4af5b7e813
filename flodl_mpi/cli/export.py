"""``flodl-mpi export CKPT OUT``: a checkpoint's weights as a plain PyTorch state dict file.

Invariant: the file holds only the state dict (name -> tensor, the model's key
order), so ``model.load_state_dict(torch.load(OUT, weights_only=True))`` loads it
into a fresh model with no flodl-mpi installed; with ``--format safetensors`` it is
a safetensors file (the ``safetensors`` package). The weights come through
`flodl_mpi.outputs.checkpoint.read_checkpoint` with every dataset verified, the reader
``--resume`` trusts, so a damaged checkpoint is refused, never exported; given a run
directory whose newest checkpoint is damaged, the newest one that reads back is
exported (resume's rule) and stderr says so in one line naming both. A run directory's
checkpoint is chosen and read in one open (`flodl_mpi.outputs.checkpoint.read_newest`), so an
export while the run trains and prunes gets the newest that still exists. The output
is written under a temporary name in its directory (``.OUT.tmp-HOST-PID``) and renamed; a stop signal (SIGTERM,
Ctrl-C) during the CLI's export removes it and ends with one line, exit status
128 + the signal's number, and a later export to the same output removes such
temporaries left by a ``kill -9`` (`remove_stale_temps`). It never replaces a file of a run (a checkpoint,
``metrics.h5``, ``train.log``, a config record), and replaces another existing file
only with ``--force``. Exporting never initialises MPI.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import signal
import socket
import sys
from pathlib import Path

from flodl_mpi.outputs.checkpoint import CheckpointError, pid_alive, read_checkpoint, read_newest, state_dict_of

__all__ = ["FORMATS", "ExportStopped", "OutputRefused", "add_parser", "check_output", "export_state_dict", "main",
           "remove_stale_temps", "run", "temp_name"]

FORMATS = ("pt", "safetensors")

#: The files of a run directory an export must never replace (``fnmatch`` patterns).
RUN_FILES = ("metrics.h5", "train.log", "config.json", "config-resume-r*.json", "ranks.json", ".lock")


class OutputRefused(ValueError):
    """The output path of an export is refused (bad input, exit status 2); nothing was written."""


class ExportStopped(BaseException):
    """A stop signal (SIGTERM, SIGINT) reached ``flodl-mpi export``: raised in the main thread by `run`'s handler.

    A BaseException, like KeyboardInterrupt, so no ``except Exception`` on the way
    (torch's, safetensors') swallows it; `export_state_dict` removes its temporary
    file on the way out. Attributes: ``signum``; ``exit_code`` is 128 + signum
    (130 for Ctrl-C, 143 for SIGTERM), what a shell reports for a command ended by that signal.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum


def temp_name(out: Path) -> Path:
    """The temporary file an export of ``out`` writes first: ``.NAME.tmp-HOST-PID`` beside it (hidden).

    Host and process id together say whether its writer can still be alive
    (`remove_stale_temps`): a process id alone repeats across the nodes that share a file system.
    """
    return out.with_name(f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def remove_stale_temps(out: Path) -> tuple[list[Path], list[Path]]:
    """Remove the temporaries of earlier exports of ``out`` whose writer is gone (a ``kill -9``); reads none.

    A temporary ``.NAME.tmp-HOST-PID`` (or ``.NAME.tmp-PID``, from flodl-mpi before
    the host was named: taken as this host's) is stale when HOST is this host and no
    process PID is alive here. Another export of the same output may be writing: one
    on this host is alive, and one on another host cannot be checked from here, so
    both are left in place.

    Returns:
        ``(removed, left)``: the paths removed, and those left because their writer may be alive.
    """
    prefix = f".{out.name}.tmp-"
    host = socket.gethostname()
    removed, left = [], []
    try:
        candidates = [p for p in out.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return removed, left
    for p in sorted(candidates):
        owner, _, pid = p.name[len(prefix):].rpartition("-")
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        if (owner or host) != host or pid_alive(int(pid)):
            left.append(p)
            continue
        try:
            p.unlink()
        except FileNotFoundError:  # another export removed it first
            continue
        except OSError:
            left.append(p)
            continue
        removed.append(p)
    return removed, left


def _is_run_dir(directory: Path) -> bool:
    """A flodl-mpi run directory: a ``checkpoints/`` folder beside a record, a log or metrics."""
    return (directory / "checkpoints").is_dir() and any(
        (directory / name).exists() for name in ("config.json", "metrics.h5", "train.log"))


def check_output(out: str | os.PathLike, source: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Refuse an export target that would destroy work; returns ``out`` as a Path.

    Refused (`OutputRefused`): a path in a run directory's ``checkpoints/`` (any
    depth), one of a run's own files (`RUN_FILES`) in a run directory, the source
    checkpoint itself, an existing directory, a missing output directory, and,
    without ``force``, any other existing file. Reads only.
    """
    out = Path(out)
    real = Path(os.path.realpath(out))
    for up in real.parents:
        if up.name == "checkpoints" and _is_run_dir(up.parent):
            raise OutputRefused(f"{out} is in the checkpoints of run {up.parent}; exporting there could replace "
                                "a checkpoint: name a file outside the run's checkpoints/")
    if _is_run_dir(real.parent) and any(fnmatch.fnmatchcase(real.name, pat) for pat in RUN_FILES):
        raise OutputRefused(f"{out} is a file of run {real.parent}; an export never replaces it: name another file")
    if source is not None and real == Path(os.path.realpath(source)):
        raise OutputRefused(f"{out} is the checkpoint being exported; name another output file")
    if real.is_dir():
        raise OutputRefused(f"{out} is a directory; name the output file, e.g. {out / 'model.pt'}")
    if not real.parent.is_dir():
        raise OutputRefused(f"{out}: the directory {out.parent} does not exist; create it first")
    if out.exists() and not force:
        raise OutputRefused(f"{out} exists; not replaced (pass --force to replace it)")
    return out


_NAME = re.compile(r"ckpt-e(\d+)-r(\d+)\.h5$")


def _epoch(path: Path) -> str:
    """``ckpt-e000002-r000046.h5 (epoch 2)``: a checkpoint named with its epoch, as the name says."""
    m = _NAME.match(path.name)
    return f"{path.name} (epoch {int(m.group(1))})" if m else path.name


def export_state_dict(ckpt: str | os.PathLike, out: str | os.PathLike, fmt: str = "pt",
                      force: bool = False) -> tuple[Path, int, list[tuple[Path, str]]]:
    """Write the checkpoint's state dict to ``out``.

    Args:
        ckpt: a checkpoint file, or a run directory / checkpoints directory (its
            newest checkpoint that still exists and whose every dataset reads back,
            chosen and read in one open: `flodl_mpi.outputs.checkpoint.read_newest`, safe
            while the run trains and prunes).
        out: the file to write (`check_output`; written under a temporary name in
            its directory, then renamed).
        fmt: ``pt`` (``torch.save`` of an ``OrderedDict[str, Tensor]``) or
            ``safetensors``.
        force: replace an existing ``out`` that is not a file of a run.

    Returns:
        ``(checkpoint path used, number of tensors, newer damaged checkpoints passed over
        as (path, why))``.

    Raises:
        OutputRefused: ``out`` is refused (`check_output`); nothing written.
        ExportStopped: from `run`'s signal handler; the temporary file is removed, ``out`` untouched.
        CheckpointError: no checkpoint, or an unreadable / damaged one (never a raw h5py error).
        ValueError: unknown ``fmt``.
        ImportError: ``fmt == "safetensors"`` without the safetensors package.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: must be one of {', '.join(FORMATS)}")
    import torch  # lazy: report and inspect need no torch

    path = Path(ckpt)
    passed_over: list[tuple[Path, str]] = []
    if path.is_dir():
        # Chosen and read in one open (`read_newest`): a run that trains meanwhile may prune
        # what a listing named, never the file once it is open.
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        chosen, passed_over = read_newest(folder, ranks=[], verify=True)
    else:
        chosen = read_checkpoint(path, ranks=[], verify=True)
    path = chosen.path
    out = check_output(out, path, force)
    state = state_dict_of(chosen)
    tmp = temp_name(out)
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp),
                      metadata={"format": "pt", "source": str(path)})
        else:
            torch.save(state, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return path, len(state), passed_over


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``export`` on the ``flodl-mpi`` sub-parsers."""
    p = sub.add_parser("export", allow_abbrev=False,
                       help="write a checkpoint's weights as a plain PyTorch state dict",
                       description="Write a checkpoint's state dict for use outside flodl-mpi: "
                                   "model.load_state_dict(torch.load(OUT, weights_only=True)).")
    p.add_argument("ckpt", metavar="CKPT", help="checkpoint file, or a run directory (its newest checkpoint)")
    p.add_argument("out", metavar="OUT", help="output file, e.g. model.pt or model.safetensors")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="pt (torch.save) or safetensors; default from OUT's suffix, else pt")
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it exists (never a run's checkpoint, metrics.h5, train.log or config)")
    return p


def run(args: argparse.Namespace) -> int:
    """``flodl-mpi export``; returns the exit status (0, 1 damaged checkpoint, 2 bad input, 130/143 stopped).

    SIGTERM and SIGINT (Ctrl-C) stop it: the temporary file is removed, one line
    says so, and the status is 128 + the signal's number, as a shell reports a
    command ended by that signal (not 4: that means "checkpoint saved, resume" for
    ``train``, and job scripts requeue on it; an export is simply run again). Call
    from the main thread (it installs the handlers, and restores them on return).
    """
    fmt = args.format or ("safetensors" if str(args.out).endswith(".safetensors") else "pt")

    def stop(signum, frame) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):  # the clean-up on the way out is not interrupted again
            signal.signal(sig, signal.SIG_IGN)
        raise ExportStopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(args, fmt)
    except ExportStopped as exc:
        print(f"flodl-mpi export: {signal.Signals(exc.signum).name}: stopped; {args.out} not written "
              "(its temporary file removed)", file=sys.stderr)
        return exc.exit_code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _clean_before(out: Path) -> None:
    """An accepted output's stale temporaries (`remove_stale_temps`) removed, each said on stderr."""
    removed, left = remove_stale_temps(out)
    if removed:
        print(f"flodl-mpi export: removed {', '.join(p.name for p in removed)}: left by an export of {out} "
              "that was killed", file=sys.stderr)
    if left:
        print(f"flodl-mpi export: note: left {', '.join(p.name for p in left)} in place: its writer may be "
              "another export still running (on this host or another); remove it once none is", file=sys.stderr)


def _run(args: argparse.Namespace, fmt: str) -> int:
    try:
        _clean_before(check_output(args.out, force=args.force))
        used, n, passed_over = export_state_dict(args.ckpt, args.out, fmt, force=args.force)
    except OutputRefused as exc:
        print(f"flodl-mpi export: error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"flodl-mpi export: error: {exc}", file=sys.stderr)
        return 1 if Path(exc.path).is_file() else 2
    except ImportError as exc:
        print(f"flodl-mpi export: error: --format safetensors needs the safetensors package ({exc}); "
              "pip install safetensors", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"flodl-mpi export: error: {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if passed_over:  # resume's wording (`flodl_mpi.training.train._find_resume`), never silent
        damaged = "; ".join(f"{_epoch(p)} is damaged ({why})" for p, why in passed_over)
        print(f"flodl-mpi export: warning: {damaged}; not exported: exported {_epoch(used)}, "
              "the newest checkpoint that reads back", file=sys.stderr)
    print(f"exported {n} tensors from {used} to {args.out} ({fmt})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m flodl_mpi.cli.export CKPT OUT`` (the same as ``flodl-mpi export``)."""
    parser = argparse.ArgumentParser(prog="flodl-mpi")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["export", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    from flodl_mpi.cli.main import unix_pipe

    unix_pipe()
    sys.exit(main())
