"""A byte-level language-model data file from a real English corpus that a Debian package installs.

The corpus is the GNU Collaborative International Dictionary of English (GCIDE,
Webster's 1913 revised: about 40 MB of English definitions, etymologies and quotations),
installed by Debian's ``dict-gcide`` as ``/usr/share/dictd/gcide.dict.dz`` (dictzip, which
Python's ``gzip`` reads)::

    apt-get install -y dict-gcide

Nothing is downloaded at run time. The text is cut into blocks of ``block_bytes``; the
blocks used are spread evenly over the whole dictionary (so a small slice still holds
words from A to Z), and every ``val_every``-th of them is held out as the validation
split (block-level, so no training sequence overlaps a validation one). Each block is cut
into non-overlapping sequences of ``context + 1`` bytes: ``x`` the first ``context``
bytes, ``y`` the ``context`` next bytes (``y[t] = x[t + 1]``), the targets of a causal
language model at every position. Tokens are bytes (vocabulary 256, stated as the file's
``num_classes`` so it does not depend on which bytes a slice holds).

The file is the ``--data`` layout of ``flodl-mpi train`` (docs/tutorial/your-data.rst)::

    train/x  float32 (N, T)   token ids as exact floats (the CLI's features are float32)
    train/y  int64   (N, T)   next-token labels, one per position
    test/x, test/y            the held-out blocks, same shapes

Write one::

    python benchmarks/lm/corpus.py /tmp/gcide.h5 --train-bytes 2000000 --context 128
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

#: Where Debian's dict-gcide installs the dictionary's text.
GCIDE_PATH = Path("/usr/share/dictd/gcide.dict.dz")
#: The command that installs it (nothing else is needed).
INSTALL = "apt-get install -y dict-gcide"
#: Tokens are bytes.
VOCAB = 256


class CorpusMissing(RuntimeError):
    """The corpus file is not installed; the message names the package to install."""


def read_corpus(path: str | os.PathLike = GCIDE_PATH) -> bytes:
    """The whole GCIDE text as bytes (about 40 MB, ASCII with a handful of other bytes).

    Raises:
        CorpusMissing: ``path`` does not exist (the message gives :data:`INSTALL`).
    """
    path = Path(path)
    if not path.is_file():
        raise CorpusMissing(f"{path} not found: the GCIDE corpus comes from Debian's dict-gcide ({INSTALL})")
    with gzip.open(path, "rb") as f:
        return f.read()


def split_blocks(text: bytes, train_bytes: int, block_bytes: int = 65536, val_every: int = 10) -> tuple[bytes, bytes]:
    """Pick blocks spread evenly over ``text`` until the training split holds ``train_bytes``.

    Of the blocks taken (in text order), every ``val_every``-th (the 10th, 20th, ...) goes
    to the validation split, the others to training; with fewer than ``val_every`` blocks,
    one more block after them is the validation split. ``train_bytes`` is rounded up to
    whole blocks.

    Returns:
        ``(train, validation)`` bytes.

    Raises:
        ValueError: the text holds fewer blocks than asked for, or a size below 1.
    """
    if block_bytes < 1 or train_bytes < 1 or val_every < 2:
        raise ValueError(f"block_bytes and train_bytes must be >= 1 and val_every >= 2, got "
                         f"{block_bytes}, {train_bytes}, {val_every}")
    n_train = math.ceil(train_bytes / block_bytes)
    n_blocks = n_train
    while n_blocks - n_blocks // val_every < n_train:
        n_blocks += 1
    last_val = n_blocks < val_every  # too few for a k-th block: the one after the training blocks
    n_blocks += last_val
    available = len(text) // block_bytes
    if n_blocks > available:
        raise ValueError(f"asked for {n_blocks} blocks of {block_bytes} bytes but the text holds {available}")
    starts = (np.arange(n_blocks, dtype=np.int64) * available // n_blocks) * block_bytes
    train, val = [], []
    for i, s in enumerate(starts.tolist()):
        held = (i + 1) % val_every == 0 or (last_val and i == n_blocks - 1)
        (val if held else train).append(text[s : s + block_bytes])
    return b"".join(train), b"".join(val)


def sequences(data: bytes, context: int, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping ``(x, y)`` sequences cut inside each block of ``data``.

    Returns:
        ``x`` float32 ``(N, context)`` token ids, ``y`` int64 ``(N, context)`` with
        ``y[:, t] == x[:, t + 1]`` within the sequence's ``context + 1`` bytes.
    """
    if context < 1 or context + 1 > block_bytes:
        raise ValueError(f"context must be in [1, block_bytes - 1], got {context} (block {block_bytes})")
    per_block = block_bytes // (context + 1)
    tokens = np.frombuffer(data, dtype=np.uint8).reshape(-1, block_bytes)
    seqs = tokens[:, : per_block * (context + 1)].reshape(-1, context + 1)
    return seqs[:, :-1].astype(np.float32), seqs[:, 1:].astype(np.int64)


def write_h5(out: str | os.PathLike, train_bytes: int, context: int = 128, block_bytes: int = 65536,
             val_every: int = 10, corpus: str | os.PathLike = GCIDE_PATH) -> dict:
    """Write the ``--data`` file (the module docstring's layout) crash-safely (temp name, then rename).

    Returns:
        ``{"train": N_train, "test": N_test, "context": T, "vocab": 256, "source": ...}``.

    Raises:
        CorpusMissing: the corpus is not installed. ValueError: sizes as :func:`split_blocks`.
    """
    train, val = split_blocks(read_corpus(corpus), train_bytes, block_bytes, val_every)
    out = Path(out)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent or ".")
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["num_classes"] = VOCAB
            f.attrs["source"] = f"{corpus} (Debian dict-gcide), byte tokens"
            f.attrs["block_bytes"], f.attrs["val_every"] = block_bytes, val_every
            counts = {}
            for split, data in (("train", train), ("test", val)):
                x, y = sequences(data, context, block_bytes)
                f[f"{split}/x"], f[f"{split}/y"] = x, y
                counts[split] = len(x)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return {**counts, "context": context, "vocab": VOCAB, "source": str(corpus)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the HDF5 file to write")
    p.add_argument("--train-bytes", type=int, default=2_000_000, help="bytes of training text (default 2,000,000)")
    p.add_argument("--context", type=int, default=128, help="tokens per sequence, T (default 128)")
    p.add_argument("--block-bytes", type=int, default=65536, help="block of the split (default 65536)")
    p.add_argument("--val-every", type=int, default=10, help="every k-th block is held out (default 10)")
    args = p.parse_args(argv)
    try:
        info = write_h5(args.out, args.train_bytes, args.context, args.block_bytes, args.val_every)
    except (CorpusMissing, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {info['train']} train and {info['test']} test sequences of {info['context']} byte tokens "
          f"(vocab {info['vocab']}) from {info['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
