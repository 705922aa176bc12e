"""The demo job: a small CNN trained on scikit-learn's handwritten digits with paratrain.

Run it with ``paratrain demo`` (which launches this module on every process), or by hand:
``paratrain run -n 2 -m paratrain.demo --epochs 10``; its flags are ``DemoConfig``'s (:mod:`.config`).

With ``--checkpoint-dir D --checkpoint-every N`` it checkpoints itself; ``--fail-at-step S --fail-rank R`` then
SIGKILLs rank R after optimizer step S on the job's first attempt, so ``paratrain demo --max-restarts 1`` shows
a restart resuming from the latest checkpoint and ending with the same final SHA-256 as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..checkpoint import CheckpointConfig
from ..digest import state_digest
from ..flags import add_flags, build
from ..launcher.leaving import rejoin_count
from ..monitor import MonitorConfig
from ..parallel import Parallel
from ..progress import Progress
from ..settings import JobConfig
from ..workloads.digits import digits_cnn, load_digits_split
from .config import LAUNCH_FIELDS, DemoConfig


def parse(argv: list[str] | None = None) -> DemoConfig:
    """This process's options: ``DemoConfig``'s flags, less the launcher's own."""
    parser = argparse.ArgumentParser(
        prog="paratrain.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_flags(parser, DemoConfig, skip=LAUNCH_FIELDS)
    return build(DemoConfig, parser.parse_args(argv))


def micro_batch(config: DemoConfig, par: Parallel) -> int:
    """Samples each replica reads per micro-step for the requested global batch."""
    from ..errors import ConfigError

    parts = par.data_parallel_size * config.accumulate
    if config.batch_size % parts:
        raise ConfigError(
            f"--batch-size {config.batch_size} does not split over {par.data_parallel_size} "
            f"replica(s) x {config.accumulate} accumulation step(s); use a multiple of {parts}"
        )
    return config.batch_size // parts


def evaluate(par: Parallel, model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole test set: each sample counted exactly once across ranks (on each worker
    alone where ``par.sum`` is its own: asynchronous parameter servers, whose test loader is not sharded)."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    correct = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(par.device), y.to(par.device)
            logits = model(x)
            loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            count += len(y)
    model.train()
    loss_sum, correct, count = par.sum(loss_sum), par.sum(correct), par.sum(count)
    return float(loss_sum / count), float(correct / count)


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    config = parse(argv)
    monitor = MonitorConfig(csv=config.monitor_csv)  # its summary table closes the output
    # deterministic kernels: the final SHA-256 then compares two runs bit for bit on a GPU too
    checkpoint = CheckpointConfig(
        dir=config.checkpoint_dir,
        every=config.checkpoint_every,
        resume=True if config.resume else None,
        async_save=config.checkpoint_async,
    )
    with Parallel(
        config.strategy,
        accumulate=config.accumulate,
        seed=config.seed,
        job=JobConfig(deterministic=True),
        checkpoint=checkpoint,
        monitor=monitor,
        **config.strategy_options(),
    ) as par:
        train_set, test_set = load_digits_split(seed=config.seed)
        model = digits_cnn()
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        model, optimizer = par.prepare(model, optimizer)  # first: 'auto' chooses the layout the data follows
        # The global batch is fixed, so every strategy and world size trains the same math per step.
        # drop_last: every step has a full batch, which pipelines split into equal micro-batches.
        train = par.prepare(DataLoader(train_set, batch_size=micro_batch(config, par), shuffle=True, drop_last=True))
        test = DataLoader(test_set, batch_size=120)
        steps = config.epochs * -(-len(train) // config.accumulate)
        schedule = par.prepare(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1)))
        test = par.prepare_loader(test, even=False, shard=not config.staleness)  # async ps: each worker scores alone
        par.print(
            f"paratrain demo: digits CNN, {len(train_set)} train / {len(test_set)} test samples, "
            f"{par.world_size} process(es), {par!r}"
        )
        start = time.perf_counter()
        seen = 0
        acc = 0.0
        for epoch in par.epochs(config.epochs):
            t0 = time.perf_counter()
            running = torch.zeros((), dtype=torch.float64)
            batches = 0  # fewer than len(train) in an epoch resumed from a checkpoint
            with Progress(len(train), f"epoch {epoch + 1}/{config.epochs}", enabled=par.is_main) as bar:
                for x, y in train:
                    x, y = x.to(par.device), y.to(par.device)
                    with par.step(model, optimizer) as step:
                        loss = par.forward_backward(model, x, y, nn.functional.cross_entropy)
                    if step.sync:
                        schedule.step()
                        inject_fault(config, par)
                    running += loss.item()
                    batches += 1
                    seen += len(y)
                    bar.update(loss=loss.item())
            train_loss = float(par.mean(running / max(batches, 1)))
            test_loss, acc = evaluate(par, model, test)
            par.print(
                f"epoch {epoch + 1:2d}/{config.epochs}  train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
                f"test acc {acc:6.2%}  ({time.perf_counter() - t0:.2f} s)"
            )
        wall = time.perf_counter() - start
        total = par.sum(float(seen))
        state = par.full_state_dict(model)  # consolidated on rank 0, whatever the sharding
        digest = state_digest(state) if par.is_main else ""
        over = "on rank 0 alone" if config.staleness else f"over {par.world_size} process(es)"  # async ps: no sum
        par.print(f"done in {wall:.2f} s  ({total / wall:,.0f} samples/s {over})  final test acc {acc:.2%}")
        par.print(f"final parameters sha256 {digest}")
        return {"test_acc": acc, "wall_s": wall, "samples_per_s": total / wall, "sha256": digest}


def inject_fault(config: DemoConfig, par: Parallel) -> None:
    """SIGKILL this rank after optimizer step ``--fail-at-step`` if it is ``--fail-rank``, on the first attempt."""
    if (
        config.fail_at_step == par.optimizer_steps
        and par.rank == config.fail_rank
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        and not rejoin_count()
    ):
        print(
            f"paratrain demo: fault injection: SIGKILL rank {par.rank} after step {par.optimizer_steps}",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
