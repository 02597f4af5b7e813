"""An own loop with ``flodl_mpi.Averager`` (2 ranks, a tiny model), run by the version that made the data
and by the tests with today's (the public API only, the same in both).

    mpiexec -n 2 python averager_loop.py RUN_DIR EPOCHS CUT [--resume] [--out FINAL.npz]

Trains ``EPOCHS`` epochs of 8 batches per rank (window 2, SGD with momentum, BatchNorm), the last one cut
short after ``CUT`` step() calls (0: not cut), then closes: a cut epoch is saved incomplete, with its place.
``--out``: rank 0 writes the final parameters and buffers there (npz, by state-dict name) and the
epochs' results (``FINAL.json``: per epoch ended, its avg_loss, test loss and scalar ``acc``).
"""

import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import flodl_mpi


def main(argv):
    run_dir, epochs, cut = argv[0], int(argv[1]), int(argv[2])
    resume = "--resume" in argv
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    results = []
    with flodl_mpi.Averager(model, optimizer=opt, policy="window", window=2, run_dir=run_dir,
                            resume=resume) as avg:
        for epoch in range(avg.start_epoch, epochs):
            g = torch.Generator().manual_seed(1000 * epoch + avg.rank)  # the epoch's batches: a function of it
            xs, ys = torch.randn(8, 6, 4, generator=g), torch.randint(0, 3, (8, 6), generator=g)
            batches = list(zip(xs, ys))
            last_cut = cut and epoch == epochs - 1
            for x, y in avg.batches(batches[:cut] if last_cut else batches):
                model.train()
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                flodl_mpi.record_scalar("acc", float((model(x).argmax(1) == y).float().mean()))
                avg.step(loss, samples=len(x))
            if last_cut:
                break
            model.eval()
            with torch.no_grad():
                test = float(F.cross_entropy(model(xs[0]), ys[0], reduction="sum"))
            res = avg.end_epoch(metrics={"loss": (test, len(ys[0]))})
            results.append({"epoch": res.epoch, "avg_loss": res.summary.avg_loss,
                            "test_loss": res.metrics["loss"], "acc": res.scalars["acc"]})
    if out is not None and avg.rank == 0:
        np.savez(out, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
        with open(out.removesuffix(".npz") + ".json", "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
