"""A torchrun DDP script in the style of pytorch/examples' ``distributed/ddp-tutorial-series/multigpu_torchrun.py``:
``init_process_group`` from the environment, ``DistributedDataParallel``, ``DistributedSampler`` with ``set_epoch``.
On CPU, so gloo instead of NCCL and no ``set_device``.

Usage: torchrun --nproc-per-node 2 torchrun_ddp.py OUT_DIR [SEED]
"""

import os
import sys

import torch
import torch.nn.functional as F
from _report import finished, record_pid, report
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.train_data = train_data
        self.optimizer = optimizer
        self.model = DDP(model)
        self.loss = float("nan")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        self.loss = loss.item()

    def _run_epoch(self, epoch: int) -> None:
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def train(self, max_epochs: int) -> None:
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def main(out_dir: str, seed: int, total_epochs: int = 2, batch_size: int = 32) -> None:
    init_process_group(backend="gloo")
    record_pid(out_dir)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = MyTrainDataset(256, seed)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, loader, optimizer)
    trainer.train(total_epochs)
    losses = torch.tensor([trainer.loss])
    torch.distributed.all_reduce(losses)
    report(out_dir, losses.item() / torch.distributed.get_world_size(), trainer.loss, trainer.model.module)
    destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    finished(sys.argv[1])
