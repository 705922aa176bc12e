"""nanoGPT's rank-0 habits under strategies that need every rank, for the real-code suite's one-line errors.

``paratrain run -n 2 nanogpt_alone.py DATA_DIR STRATEGY WHAT``: trains the nanoGPT-shaped model and, at iteration 1,
does ``WHAT`` as nanoGPT does it: ``eval`` (``if iter_num % eval_interval == 0 and master_process:`` evaluation) or
``state_dict`` (``checkpoint = {'model': raw_model.state_dict()}; torch.save(...)`` on rank 0).
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import torch
from nanogpt_model import GPT, GPTConfig

import paratrain


def main(data_dir: str, strategy: str, what: str) -> None:
    par = paratrain.Parallel(strategy, monitor=False)
    master_process = par.rank == 0
    torch.manual_seed(1337 + par.rank)
    model = GPT(GPTConfig(n_layer=2))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    model, optimizer = par.prepare(model, optimizer)
    data = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    for iter_num in range(4):
        ix = torch.randint(len(data) - 64, (4,))
        X = torch.stack([torch.from_numpy(data[i : i + 64].astype(np.int64)) for i in ix])
        Y = torch.stack([torch.from_numpy(data[i + 1 : i + 65].astype(np.int64)) for i in ix])
        if iter_num == 1 and master_process and what == "eval":
            model.eval()
            with torch.no_grad():
                _, loss = model(X, Y)
            model.train()
        if iter_num == 1 and master_process and what == "state_dict":
            checkpoint = {"model": model.state_dict(), "iter_num": iter_num}
            torch.save(checkpoint, os.path.join(tempfile.mkdtemp(), "ckpt.pt"))
        with par.step(model, optimizer):
            par.forward_backward(model, X, Y)
    par.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
