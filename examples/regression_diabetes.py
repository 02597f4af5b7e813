"""Regression through the trainer API: scikit-learn's diabetes data (442 patients, 10 features).

    python examples/regression_diabetes.py                 # one process
    mpiexec -n 2 python examples/regression_diabetes.py    # two ranks

Float targets, a user loss (mean squared error plus a recorded mean absolute error),
a cosine learning-rate schedule over the cohort's steps, per-rank gradient clipping.
The script checks its own result: the test mean squared error must be below
``MAX_FRACTION`` of the variance of the test targets, and exits 1 otherwise. For scale, on
this split: predicting the training mean scores about 1.0, and ordinary least squares
(scikit-learn's LinearRegression, the best linear fit) 0.647.
"""

import argparse
import math
import sys

import numpy as np
import torch
from sklearn.datasets import load_diabetes
from torch import nn

import flodl_mpi

MAX_FRACTION = 0.7

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=20)
p.add_argument("--run-dir", default=None)
args = p.parse_args()

x, y = load_diabetes(return_X_y=True)
order = np.random.default_rng(0).permutation(len(x))  # the same split on every rank
x, y = x[order], y[order].reshape(-1, 1)
x_train, y_train, x_test, y_test = x[:342], y[:342], x[342:], y[342:]
mu, sd = x_train.mean(0), x_train.std(0)
y_mu, y_sd = y_train.mean(), y_train.std()
x_train, x_test = (x_train - mu) / sd, (x_test - mu) / sd
y_train, y_test = (y_train - y_mu) / y_sd, (y_test - y_mu) / y_sd
data = {"train": (x_train.astype(np.float32), y_train.astype(np.float32)),
        "test": (x_test.astype(np.float32), y_test.astype(np.float32))}


def make_model(input_shape, target_shape):
    return nn.Sequential(nn.Linear(input_shape[0], 32), nn.Tanh(), nn.Linear(32, target_shape[0]))


def train_step(model, batch):
    x, y = batch
    pred = model(x)
    flodl_mpi.record_scalar("mae", (pred - y).abs().mean())
    return nn.functional.mse_loss(pred, y)


def eval_fn(model, batch):  # sums and counts over a test batch: the cohort divides once
    x, y = batch
    err = model(x) - y
    # "loss" also fills metrics.h5's epochs/test_loss column (the mean squared error here)
    return {"loss": (float((err**2).sum()), y.numel()), "mae": (float(err.abs().sum()), y.numel())}


steps = args.epochs * math.ceil(342 / 32)  # the cohort's optimizer steps in the run
run = flodl_mpi.fit(make_model, lambda params: torch.optim.Adam(params, lr=3e-3), train_step=train_step,
                      eval_fn=eval_fn, data=data, batch_size=32, epochs=args.epochs, eval_every=5,
                      lr_schedule=lambda step: 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps)),
                      clip_grad_norm=1.0, run_dir=args.run_dir)
for epoch in run:
    if run.rank == 0 and epoch.metrics:
        print(f"epoch {epoch.epoch}: train mse {epoch.summary.avg_loss:.4f}  mae {epoch.scalars['mae']:.4f}  "
              f"test mse {epoch.metrics['loss']:.4f}  test mae {epoch.metrics['mae']:.4f}", flush=True)
var_y = float(np.var(y_test))
test_mse = run.history[-1].metrics["loss"]
if run.rank == 0:
    print(f"test mse {test_mse:.4f} = {test_mse / var_y:.3f} x var(y_test) {var_y:.4f} "
          f"(must be < {MAX_FRACTION}); {run.world_size} rank(s)", flush=True)
sys.exit(0 if test_mse < MAX_FRACTION * var_y else 1)
