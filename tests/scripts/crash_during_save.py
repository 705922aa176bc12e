"""Save a checkpoint at step 2, then SIGKILL this process in the middle of saving step 4.

Usage: python crash_during_save.py DIR data|publish [async]
  data:    killed inside torch.distributed.checkpoint's write, after the tensor files, before its metadata;
  publish: killed after the new folder is renamed into place, before ``latest`` moves;
  async:   the second save is written in the background (killed there, or while ``close`` publishes it).
Writes DIR/params-at-2.pt (the parameters the first checkpoint holds) for the test to compare.
"""

import os
import signal
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter

import paratrain
from paratrain.checkpoint import layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.checkpoint_workers import dropout_model  # noqa: E402


def die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    root, where, background = Path(sys.argv[1]), sys.argv[2], sys.argv[3:] == ["async"]
    par = paratrain.Parallel("single", seed=0)
    model = dropout_model()
    model, opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    for step in range(1, 5):
        with par.step(model, opt):
            par.backward(model(torch.randn(4, 8)).pow(2).mean())
        if step == 2:
            par.save(root / "ckpt")
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "params-at-2.pt")
    if where == "data":
        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            future = write_data(self, plan, planner)
            future.wait()
            die()

        FileSystemWriter.write_data = write_then_die
    else:
        commit = layout.commit

        def commit_and_die(*args):
            layout.fsync_dir = die  # its first call comes right after the rename, before `latest` is written
            return commit(*args)

        layout.commit = commit_and_die
    par.save(root / "ckpt", async_save=background)
    par.close()
    raise SystemExit("the save was expected to be killed")
