"""An Accelerate training loop as its docs write one: ``Accelerator``, ``prepare``, ``accelerator.backward``.
``cpu=True`` because on a CPU-only machine Accelerate otherwise trains each process alone (no gradient sync).

Usage: torchrun --nproc-per-node 2 accelerate_script.py OUT_DIR [SEED]   (or accelerate launch, or paratrain run)
"""

import sys

import torch
import torch.nn.functional as F
from _report import finished, record_pid, report
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main(out_dir: str, seed: int) -> None:
    accelerator = Accelerator(cpu=True)
    record_pid(out_dir)
    set_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=g)
    dataset = TensorDataset(x, x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(256, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset, batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for inputs, targets in loader:
        optimizer.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
    final = accelerator.reduce(loss.detach(), reduction="mean")
    report(out_dir, final.item(), loss.item(), accelerator.unwrap_model(model))
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    finished(sys.argv[1])
