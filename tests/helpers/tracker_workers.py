"""Training runs that log to TensorBoard, W&B (offline) and MLflow (a local sqlite file) at once, run on 2 gloo
processes by tests/monitor/test_trackers.py: ddp (two replicas read different data) and tp (one replica), on a
tiny language model whose batches are token ids, so the monitor counts samples and tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.distributed.process_group import finish_group
from paratrain.monitor import MLflowConfig, MonitorConfig, TensorBoardConfig, TrackerConfig, WandbConfig

VOCAB, SEQ, BATCH, STEPS, EVERY = 16, 6, 4, 6, 2
FLOPS_PER_SAMPLE, PEAK_TFLOPS = 1e6, 1e-3
CLIENTS = ("wandb", "mlflow", "tensorboard")


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _train(strategy: str, root: Path, **options: object) -> dict:
    tracking = TrackerConfig(
        trackers=[
            TensorBoardConfig(),
            WandbConfig(mode="offline"),
            MLflowConfig(tracking_uri=f"sqlite:///{root / 'mlflow.db'}"),
        ],
        project="tiny-lm",
        run_name=strategy,
        dir=root / "runs",
        config={"lr": 0.1, "model": {"vocab": VOCAB}},
    )
    par = paratrain.Parallel(
        strategy,
        log_with=tracking,
        seed=0,
        **options,
        monitor=MonitorConfig(every=EVERY, summary=False, flops_per_sample=FLOPS_PER_SAMPLE, peak_tflops=PEAK_TFLOPS),
    )
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, VOCAB))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    samples = STEPS * BATCH * par.data_parallel_size
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    model, optimizer, loader = par.prepare(model, optimizer, loader)
    losses = []
    for x, y in loader:
        with par.step(model, optimizer):
            loss = par.forward_backward(model, x.to(par.device), y.to(par.device), _loss)
        losses.append(float(par.mean(loss)))
        par.log({"loss": losses[-1]})  # every rank calls it; rank 0 writes
    par.log({"eval/loss": losses[-1]}, step=100)
    active = par.trackers.active
    par.close()
    return {"losses": losses, "active": active, "replicas": par.data_parallel_size}


def tracked_runs(root: str) -> dict:
    """Both runs; with what this rank imported of the trackers' clients (rank 1 must import none)."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    runs = {"ddp": _train("ddp", Path(root)), "tp": _train("tp", Path(root), tp_plan={"1": "colwise", "3": "rowwise"})}
    runs["imported"] = [name for name in CLIENTS if name in sys.modules]
    finish_group()
    return runs
