"""Layer-split model parallelism in one process: consecutive layers on cuda:0, cuda:1, … (all on the CPU here).

python examples/model_parallel.py                 # stages balanced by parameter count
python examples/model_parallel.py --split 2 4     # stages start at layers 2 and 4
paratrain run -n 2 examples/model_parallel.py     # 2 processes x 2 stages each (DDP over the stages)
"""

import argparse

import torch
from torch import nn

import paratrain
from paratrain.model.cuts import layers

# test-launch: python | python --split 2 4 | paratrain run -n 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--split", type=int, nargs="*", default=None)
    args = p.parse_args()
    par = paratrain.Parallel("model_parallel", split=args.split or None, seed=0)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    model, optimizer = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    where = {
        name: str(next(layer.parameters()).device)
        for name, layer in layers(par.unwrap(model))
        if any(True for _ in layer.parameters())
    }
    par.print(f"layers on devices: {where}; outputs on {par.device}")
    for _ in range(50):
        x = torch.randn(32, 16)
        y = x.sum(1, keepdim=True).to(par.device)  # targets go where the last stage puts its outputs
        with par.step(model, optimizer):
            loss = par.forward_backward(model, x, y, nn.functional.mse_loss)
    par.print(f"final loss {par.mean(loss):.4f}")
    par.close()


if __name__ == "__main__":
    main()
