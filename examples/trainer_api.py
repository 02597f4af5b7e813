"""The trainer API on the built-in digits: your model, optimizer and train step; flodl_mpi's loop.

    python examples/trainer_api.py                 # one process: a world of 1
    mpiexec -n 2 python examples/trainer_api.py    # two ranks

The effective batch of a round is batch_size x world size, so the learning rate is
scaled with the world size (linear scaling rule, warmed up over the first epoch).
"""

import argparse

import torch
from torch import nn

import flodl_mpi

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=5)
p.add_argument("--run-dir", default=None)
args = p.parse_args()


def make_model(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], 128), nn.BatchNorm1d(128), nn.ReLU(),
                         nn.Linear(128, num_classes))


def train_step(model, batch):
    x, y = batch
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    flodl_mpi.record_scalar("train_accuracy", (logits.argmax(1) == y).float().mean())
    return loss


run = flodl_mpi.fit(make_model, lambda params: torch.optim.Adam(params, lr=1e-3), train_step=train_step,
                      epochs=args.epochs, batch_size=32, scale_lr=True, warmup_steps=45, clip_grad_norm=5.0,
                      run_dir=args.run_dir)
for epoch in run:  # the same numbers on every rank
    if run.rank == 0:
        print(f"epoch {epoch.epoch}: loss {epoch.summary.avg_loss:.4f}  train_accuracy "
              f"{epoch.scalars['train_accuracy']:.4f}  test accuracy {epoch.metrics['accuracy']:.4f}", flush=True)
