"""Save step 2 in the background and end without ``par.close()``: the process must still publish it.

Usage: python async_save_then_exit.py DIR
The write is slowed down, so it is still in flight when the script's last line has run.
"""

import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

import paratrain

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.checkpoint_workers import dropout_model  # noqa: E402

if __name__ == "__main__":
    write_data = _FileSystemWriter.write_data

    def slow(self, *args, **kwargs):
        time.sleep(1.0)
        return write_data(self, *args, **kwargs)

    _FileSystemWriter.write_data = slow
    par = paratrain.Parallel("single", seed=0, monitor=False)
    model = dropout_model()
    model, opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    for _ in range(2):
        with par.step(model, opt):
            par.backward(model(torch.randn(4, 8)).pow(2).mean())
    par.save(sys.argv[1], async_save=True)
