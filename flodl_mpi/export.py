"""``flodl-mpi export CKPT OUT``: a checkpoint's weights as a plain PyTorch state dict file.

Invariant: the file holds only the state dict (name -> tensor, the model's key
order), so ``model.load_state_dict(torch.load(OUT, weights_only=True))`` loads it
into a fresh model with no flodl-mpi installed; with ``--format safetensors`` it is
a safetensors file (the ``safetensors`` package). The weights come through
`flodl_mpi.checkpoint.load_state_dict`, the same reader ``--resume`` trusts, so a
damaged checkpoint is refused, never exported. The output is written under a
temporary name and renamed. Exporting never initialises MPI.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flodl_mpi.checkpoint import CheckpointError, latest_checkpoint, load_state_dict

__all__ = ["FORMATS", "add_parser", "export_state_dict", "main", "run"]

FORMATS = ("pt", "safetensors")


def export_state_dict(ckpt: str | os.PathLike, out: str | os.PathLike, fmt: str = "pt") -> tuple[Path, int]:
    """Write the checkpoint's state dict to ``out``.

    Args:
        ckpt: a checkpoint file, or a run directory / checkpoints directory (its
            newest complete checkpoint).
        out: the file to write (replaced atomically if it exists).
        fmt: ``pt`` (``torch.save`` of an ``OrderedDict[str, Tensor]``) or
            ``safetensors``.

    Returns:
        ``(checkpoint path used, number of tensors)``.

    Raises:
        CheckpointError: no checkpoint, or an unreadable / damaged one.
        ValueError: unknown ``fmt``.
        ImportError: ``fmt == "safetensors"`` without the safetensors package.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: must be one of {', '.join(FORMATS)}")
    path = Path(ckpt)
    if path.is_dir():
        found = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
        if found is None:
            raise CheckpointError(path, "no complete checkpoint in this directory")
        path = found
    import torch  # lazy: report and inspect need no torch

    state = load_state_dict(path)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
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
    return path, len(state)


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
    return p


def run(args: argparse.Namespace) -> int:
    """``flodl-mpi export``; returns the exit status (0, 1 damaged checkpoint, 2 bad input)."""
    fmt = args.format or ("safetensors" if str(args.out).endswith(".safetensors") else "pt")
    try:
        used, n = export_state_dict(args.ckpt, args.out, fmt)
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
    print(f"exported {n} tensors from {used} to {args.out} ({fmt})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m flodl_mpi.export CKPT OUT`` (the same as ``flodl-mpi export``)."""
    parser = argparse.ArgumentParser(prog="flodl-mpi")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["export", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    from flodl_mpi.cli import unix_pipe

    unix_pipe()
    sys.exit(main())
