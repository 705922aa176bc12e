"""What stepping by layout costs: the time ``groups_by_layout`` adds to an optimizer step, which splits each param group
into one group per layout (plain tensors, DTensors per mesh and placements) so that CUDA's ``foreach``/``fused`` paths
take experts beside plain parameters.

One process, a one-rank gloo group and mesh; ``--params`` small parameters, half of them DTensors; AdamW with
``foreach=True``. Rounds interleave the split alone and a whole step with and without it; medians.

    .venv/bin/python benchmarks/optimizer_layouts.py [--params 1000] [--rounds 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from paratrain.distributed.optimizer import groups_by_layout


def _params(n: int) -> list[torch.nn.Parameter]:
    mesh = init_device_mesh("cpu", (1,))
    plain = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(n - n // 2)]
    split = [torch.nn.Parameter(distribute_tensor(torch.randn(16, 16), mesh, [Shard(0)])) for _ in range(n // 2)]
    for p in plain + split:
        p.grad = torch.zeros_like(p)
    return plain + split


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    params = _params(args.params)
    opt = torch.optim.AdamW(params, foreach=True)

    def split_only() -> None:
        with groups_by_layout(opt):
            pass

    def step() -> None:
        with groups_by_layout(opt):
            opt.step()

    times: dict[str, list[float]] = {"split alone": [], "step by layout": []}
    for _ in range(args.rounds):
        times["split alone"].append(_ms(split_only))
        times["step by layout"].append(_ms(step))
    print(f"{args.params} parameters ({args.params // 2} DTensors), AdamW foreach, medians of {args.rounds} rounds")
    for name, values in times.items():
        print(f"  {name:<16} {statistics.median(values):8.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
