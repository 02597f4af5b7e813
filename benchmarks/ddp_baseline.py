"""The peer a user would pick: PyTorch DistributedDataParallel over gloo, same data and model.

Run under the same launcher as flodl-mpi (the rank and world size come from MPI;
gloo meets on a loopback TCP port that rank 0 picks and broadcasts)::

    mpiexec -n 2 python benchmarks/ddp_baseline.py --data m1d.h5 \\
        --model benchmarks/models.py:mnist1d_cnn --epochs 40 --optimizer adam --lr 1e-3 --out ddp.json

Same as ``flodl-mpi train --policy sync`` in everything but the averaging: the model
built by ``flodl_mpi.training.models.build_model`` after ``torch.manual_seed(seed)`` (DDP
broadcasts rank 0's initial parameters, as flodl-mpi does); the epoch's global
permutation from ``flodl_mpi.training.data.epoch_permutation(n, seed, epoch)``; at step k
rank r trains global batch ``k * W + r`` (flodl-mpi's sync window plan); the
final incomplete step, where some ranks have no batch, runs under
``torch.distributed.algorithms.Join`` so DDP does not hang; per-rank batch size,
optimizer and learning rate as given; cross-entropy loss; the test set split in
contiguous slices and the sums reduced. Writes per-epoch test accuracy and loss,
seconds (``time_s`` since the start; ``train_s`` the epoch's training loop alone, rank 0's, and its
``steps``) and gradient bytes all-reduced per rank to ``--out`` (JSON) on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="HDF5 data file (default: built-in digits)")
    p.add_argument("--model", help="MODULE:FACTORY (default: built-in MLP)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON results file (rank 0)")
    args = p.parse_args()

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.rank, comm.size
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    from flodl_mpi.training.data import DEFAULT_NAMES, batch_indices, default_digits_path, ensure_digits, epoch_permutation
    from flodl_mpi.training.data import load_dataset, num_batches
    from flodl_mpi.training.models import build_model

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    path = args.data
    if path is None:
        path = default_digits_path()
        if rank == 0:
            ensure_digits(path)
        comm.Barrier()
    data = load_dataset(path, DEFAULT_NAMES)
    torch.manual_seed(args.seed)
    model = build_model(args.model, data.input_shape, data.num_classes)
    ddp = DistributedDataParallel(model)
    params = list(model.parameters())
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    elif args.optimizer == "adam":
        opt = torch.optim.Adam(params, lr=args.lr, weight_decay=args.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    torch.manual_seed(int(np.random.SeedSequence([args.seed, rank]).generate_state(1)[0]))
    grad_bytes = 4 * sum(q.numel() for q in params)
    n_batches = num_batches(data.train.n, args.batch_size)
    epochs, bytes_moved, t0 = [], 0, time.perf_counter()
    for epoch in range(args.epochs):
        perm = epoch_permutation(data.train.n, args.seed, epoch)
        ddp.train()
        mine = list(range(rank, n_batches, world))
        t_train = time.perf_counter()
        with Join([ddp]):
            for b in mine:
                idx = batch_indices(perm, args.batch_size, b)
                x = torch.from_numpy(data.train.x[idx])
                y = torch.from_numpy(data.train.y[idx])
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                loss.backward()
                opt.step()
                bytes_moved += grad_bytes
        train_s = time.perf_counter() - t_train
        # Evaluate the (identical) replica on this rank's slice of the test set.
        model.eval()
        lo, hi = (data.test.n * rank) // world, (data.test.n * (rank + 1)) // world
        with torch.no_grad():
            x, y = torch.from_numpy(data.test.x[lo:hi]), torch.from_numpy(data.test.y[lo:hi])
            logits = model(x)
            sums = np.array([float(torch.nn.functional.cross_entropy(logits, y, reduction="sum")),
                             float((logits.argmax(1) == y).sum()), float(hi - lo)])
        comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        epochs.append({"epoch": epoch + 1, "test_loss": sums[0] / sums[2], "test_accuracy": sums[1] / sums[2],
                       "time_s": time.perf_counter() - t0, "train_s": train_s, "steps": len(mine)})
    dist.destroy_process_group()
    if rank == 0:
        out = {"peer": "DDP (gloo)", "world_size": world, "epochs": epochs, "bytes_per_rank": bytes_moved,
               "args": vars(args)}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
