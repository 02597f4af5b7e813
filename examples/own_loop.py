"""Your own training loop, averaged across ranks by flodl_mpi.Averager (the PostLocalSGD shape).

    python examples/own_loop.py                 # one process: a world of 1
    mpiexec -n 2 python examples/own_loop.py    # two ranks, averaged after every step

Each rank trains on its own share of each epoch's batches (scikit-learn's digits), with
its own optimizer, learning-rate schedule and gradient clipping; the averager counts the
optimizer steps and averages the parameters every ``--window`` steps.
"""

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import flodl_mpi

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=5)
p.add_argument("--window", type=int, default=1)
p.add_argument("--run-dir", default=None)
args = p.parse_args()

x, y = load_digits(return_X_y=True)
x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
x_train, y_train, x_test, y_test = x[:1437], y[:1437], x[1437:], y[1437:]

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * 23)
policy = "sync" if args.window == 1 else "window"
with flodl_mpi.Averager(model, optimizer=opt, policy=policy, window=args.window, run_dir=args.run_dir) as avg:
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        batches = order.split(32)
        # every rank takes the same number of steps: rank r trains batches r, r+W, ...
        for i in range(avg.rank, len(batches) - len(batches) % avg.world_size, avg.world_size):
            b = batches[i]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[b]), y_train[b])
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            avg.step(loss, samples=len(b))
        with torch.no_grad():  # each rank evaluates its slice of the test set
            part = slice(avg.rank, None, avg.world_size)
            correct = (model(x_test[part]).argmax(1) == y_test[part]).sum()
            loss_sum = nn.functional.cross_entropy(model(x_test[part]), y_test[part], reduction="sum")
        result = avg.end_epoch({"loss": (loss_sum, len(y_test[part])), "accuracy": (correct, len(y_test[part]))})
        if avg.rank == 0:
            print(f"epoch {result.epoch}: loss {result.summary.avg_loss:.4f} "
                  f"test accuracy {result.metrics['accuracy']:.4f}", flush=True)
