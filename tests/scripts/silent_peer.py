"""A plain torchrun script whose rank 1 stops answering: it sleeps instead of joining the first all-reduce.

Usage: paratrain run -n 2 --pg-timeout S silent_peer.py
Rank 0 creates its process group without a timeout of its own, so only the launcher's default bounds its wait.
"""

import time

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))
