"""The single-process half of verify: the same setup, trained on the global batch, in this process.

It starts from rank 0's initial weights and reads, at every micro-step, exactly the samples that all
data-parallel ranks together should read (a distributed sampler's split of each epoch's order), as one batch;
the loss of every micro-step is divided by the accumulation count. That is the math the parallel run must equal.
"""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from ..data import ShardSampler
from .distributed import DataSetup
from .record import Record, Recorder
from .spec import VerifySpec


def reference_run(spec: VerifySpec, init_state: dict[str, torch.Tensor], data: DataSetup, accumulate: int,
                  steps: int) -> Record:
    """``steps`` optimizer steps of ``spec`` in one process on the global batches of ``data``."""
    model = spec.model.cpu()
    model.load_state_dict(init_state)
    model.train()
    recorder = Recorder(model)
    optimizer = spec.optimizer(model.parameters())
    loss_fn = recorder.wrap_loss(spec.loss)
    dataset = spec.loader.dataset
    sampler = ShardSampler(dataset, num_replicas=1, rank=0, shuffle=data.shuffle, seed=data.seed,
                           drop_last=data.drop_last)
    loader = DataLoader(dataset, batch_size=data.replicas * data.micro_batch, sampler=sampler,
                        collate_fn=spec.loader.collate_fn, drop_last=data.drop_last)
    if len(loader) == 0:
        return recorder.record
    micro, epoch = 0, 0
    while recorder.record.steps < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            (loss_fn(model(x), y) / accumulate).backward()
            micro += 1
            if micro % accumulate == 0:
                norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                recorder.end_step(float(norm), {k: v.detach().clone() for k, v in model.state_dict().items()})
                if recorder.record.steps >= steps:
                    break
        epoch += 1
    return recorder.record
