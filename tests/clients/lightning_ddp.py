"""A Lightning ``Trainer(strategy="ddp")`` script. Under torchrun (or ``paratrain run``) Lightning finds the
launcher's variables (``TorchElasticEnvironment``) and joins the processes it started instead of spawning its own;
``devices`` must then equal the processes per node.

Usage: torchrun --nproc-per-node 2 lightning_ddp.py OUT_DIR [SEED]
"""

import sys

import lightning as L
import torch
import torch.nn.functional as F
from _report import finished, record_pid, report
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.last_loss = torch.tensor(float("nan"))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.mse_loss(self.net(inputs), targets)
        self.last_loss = loss.detach()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(out_dir: str, seed: int) -> None:
    record_pid(out_dir)
    L.seed_everything(seed, verbose=False)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 16, generator=g)
    dataset = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset, batch_size=32, shuffle=True))
    final = trainer.strategy.reduce(model.last_loss.clone(), reduce_op="mean")  # reduces in place
    report(out_dir, final.item(), model.last_loss.item(), model)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    finished(sys.argv[1])
