"""Train the GPT of ``model.py`` on GCIDE bytes with :func:`flodl_mpi.fit`: the language model as a Python API user writes it.

A worked example of a task that is not classification of whole samples: each sample is a
sequence of ``T`` byte tokens, its labels the ``T`` next bytes, and the loss the
cross-entropy at every position (``fit``'s default train step does that for integer
labels of shape ``(N, T)`` and logits ``(batch, vocab, T)``; it is written out here to show
it). The evaluation reports the per-token validation loss, its perplexity ``exp(loss)``
and bits per byte ``loss / ln 2``. The data is the file ``corpus.py`` writes (from Debian's
``dict-gcide``; it states the vocabulary, 256, as its ``num_classes``)::

    python benchmarks/lm/corpus.py /tmp/gcide-tiny.h5 --train-bytes 40000 --context 32 --block-bytes 4096
    python benchmarks/lm/fit_lm.py /tmp/gcide-tiny.h5 --size tiny --epochs 1
    python benchmarks/lm/corpus.py /tmp/gcide.h5
    mpiexec -n 2 python benchmarks/lm/fit_lm.py /tmp/gcide.h5 --policy window --window 50 --option outer=nesterov

Any other ``fit`` keyword is ``--option name=value`` (a number or a word), e.g.
``--option bf16_wire=true``. Rank 0 prints one JSON line per epoch, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
from torch import nn

import model as lm_model

import flodl_mpi


def train_step(model: nn.Module, batch) -> torch.Tensor:
    """Mean cross-entropy over every position: logits ``(B, vocab, T)``, labels ``(B, T)``."""
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def eval_fn(model: nn.Module, batch) -> dict[str, tuple[float, int]]:
    """Summed per-token loss and correct next-byte guesses, counted in tokens."""
    x, y = batch
    logits = model(x)
    return {"loss": (float(nn.functional.cross_entropy(logits, y, reduction="sum")), y.numel()),
            "accuracy": (float((logits.argmax(dim=1) == y).sum()), y.numel())}


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="the HDF5 file corpus.py wrote")
    p.add_argument("--size", choices=sorted(lm_model.SIZES), default="small")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--policy", default="sync")
    p.add_argument("--window", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="another fit keyword")
    args = p.parse_args(argv)
    options = {}
    for item in args.option:
        name, sep, value = item.partition("=")
        if not sep:
            p.error(f"--option {item!r}: expected NAME=VALUE")
        options[name.replace("-", "_")] = _value(value)

    run = flodl_mpi.fit(lambda input_shape, num_classes: lm_model.gpt(input_shape, num_classes, args.size),
                        "adamw", train_step=train_step, eval_fn=eval_fn, data=args.data, batch_size=args.batch_size,
                        epochs=args.epochs, lr=args.lr, policy=args.policy, window=args.window, seed=args.seed,
                        run_dir=args.run_dir, **options)
    last = None
    for result in run:
        loss = result.metrics["loss"]
        last = {"epoch": result.epoch, "train_loss": result.summary.avg_loss, "val_loss": loss,
                "perplexity": math.exp(loss), "bits_per_byte": loss / math.log(2),
                "val_token_accuracy": result.metrics["accuracy"], "rounds": result.summary.rounds}
        if run.rank == 0:
            print(json.dumps(last), flush=True)
    if run.rank == 0 and last is not None:
        params = lm_model.count_parameters(run.model)
        print(f"done: {args.size} GPT ({params} parameters), context {run.model.context}, {run.world_size} "
              f"rank(s): validation loss "
              f"{last['val_loss']:.4f} per token, perplexity {last['perplexity']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
