"""A plain torchrun script: reads RANK/WORLD_SIZE itself and calls init_process_group; knows nothing of paratrain.

Usage: torchrun --nproc-per-node 2 plain_torchrun.py OUT_DIR [ARGS...]   (each rank writes ARGS back)
"""

import os
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    out_dir = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(
            f"{rank} {world} {os.environ['LOCAL_RANK']} {t.item():g} {torch.get_num_threads()} {__name__} "
            f"{' '.join(sys.argv[2:])}\n"
        )
    dist.destroy_process_group()
