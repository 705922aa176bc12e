"""The demo job: a small CNN trained on scikit-learn's handwritten digits with paratrain.

Run it with ``paratrain demo`` (which launches this module on every process), or by hand:
``paratrain run -n 2 -m paratrain.demo --epochs 10``.

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

from .digest import state_digest
from .launch.leaving import rejoin_count
from .monitor import MonitorConfig
from .parallel import Parallel
from .progress import Progress
from .workloads.digits import DIGITS_TP_PLAN, digits_cnn, load_digits_split


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="paratrain.demo", description=__doc__)
    p.add_argument("--strategy", default="auto", help="parallel strategy (default: auto)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel degree inside ddp/zero2/zero3 (the CNN's linear layers split over it)")
    p.add_argument("--staleness", type=int, default=None,
                   help="with --strategy ps: asynchronous updates at most this many versions old")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64,
                   help="global batch per optimizer step, split over replicas and accumulation steps")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (and resume from them)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="checkpoint every N optimizer steps")
    p.add_argument("--resume", action="store_true", help="start from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="fault injection: SIGKILL --fail-rank after this optimizer step, on the first attempt only")
    p.add_argument("--fail-rank", type=int, default=0, help="the rank --fail-at-step kills")
    p.add_argument("--monitor-csv", metavar="PATH", help="log the training monitor's per-rank figures to this CSV")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace, nproc: int | None = None) -> None:
    """Reject bad options before any process starts (with ``nproc``: also a strategy that cannot run on it)."""
    from .errors import ConfigError
    from .strategies import check_name

    check_name(args.strategy)
    if nproc is not None and args.strategy != "auto":
        from .strategies import check_world

        check_world(args.strategy, nproc, **strategy_options(args))
    for name in ("epochs", "batch_size", "accumulate"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}")
    for name in ("checkpoint_every", "fail_at_step"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if (args.checkpoint_every is not None or args.resume) and not args.checkpoint_dir:
        raise ConfigError("--checkpoint-every and --resume need --checkpoint-dir")
    if args.staleness is not None and args.strategy != "ps":
        raise ConfigError(f"--staleness is an option of --strategy ps, not of {args.strategy}")
    if args.fail_at_step is not None and nproc is not None and not 0 <= args.fail_rank < nproc:
        raise ConfigError(f"--fail-rank {args.fail_rank} is not a rank of a {nproc}-process job (0..{nproc - 1})")


def strategy_options(args: argparse.Namespace) -> dict[str, object]:
    """``--tp``'s options, with the CNN's own plan (it has no built-in one), and ``--staleness``."""
    from .distributed.tensor_parallel.degrees import cli_options

    options = cli_options(args.strategy, args.tp, DIGITS_TP_PLAN)
    return options if args.staleness is None else {**options, "staleness": args.staleness}


def micro_batch(args: argparse.Namespace, par: Parallel) -> int:
    """Samples each replica reads per micro-step for the requested global batch."""
    from .errors import ConfigError

    parts = par.data_parallel_size * args.accumulate
    if args.batch_size % parts:
        raise ConfigError(f"--batch-size {args.batch_size} does not split over {par.data_parallel_size} replica(s) "
                          f"x {args.accumulate} accumulation step(s); use a multiple of {parts}")
    return args.batch_size // parts


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
    args = parse_args(argv)
    check_args(args)
    monitor = MonitorConfig(csv=args.monitor_csv)  # its summary table closes the output
    # deterministic kernels: the final SHA-256 then compares two runs bit for bit on a GPU too
    with Parallel(args.strategy, accumulate=args.accumulate, seed=args.seed, deterministic=True,
                  checkpoint_dir=args.checkpoint_dir,
                  checkpoint_every=args.checkpoint_every, resume=True if args.resume else None,
                  monitor=monitor, **strategy_options(args)) as par:
        train_set, test_set = load_digits_split(seed=args.seed)
        model = digits_cnn()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        model, optimizer = par.prepare(model, optimizer)  # first: 'auto' chooses the layout the data follows
        # The global batch is fixed, so every strategy and world size trains the same math per step.
        # drop_last: every step has a full batch, which pipelines split into equal micro-batches.
        train = par.prepare(DataLoader(train_set, batch_size=micro_batch(args, par), shuffle=True, drop_last=True))
        test = DataLoader(test_set, batch_size=120)
        steps = args.epochs * -(-len(train) // args.accumulate)
        schedule = par.prepare(torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1)))
        test = par.prepare_loader(test, even=False, shard=not args.staleness)  # async ps: each worker scores alone
        par.print(f"paratrain demo: digits CNN, {len(train_set)} train / {len(test_set)} test samples, "
                  f"{par.world_size} process(es), {par!r}")
        start = time.perf_counter()
        seen = 0
        acc = 0.0
        for epoch in par.epochs(args.epochs):
            t0 = time.perf_counter()
            running = torch.zeros((), dtype=torch.float64)
            batches = 0  # fewer than len(train) in an epoch resumed from a checkpoint
            with Progress(len(train), f"epoch {epoch + 1}/{args.epochs}", enabled=par.is_main) as bar:
                for x, y in train:
                    x, y = x.to(par.device), y.to(par.device)
                    with par.step(model, optimizer) as step:
                        loss = par.forward_backward(model, x, y, nn.functional.cross_entropy)
                    if step.sync:
                        schedule.step()
                        inject_fault(args, par)
                    running += loss.item()
                    batches += 1
                    seen += len(y)
                    bar.update(loss=loss.item())
            train_loss = float(par.mean(running / max(batches, 1)))
            test_loss, acc = evaluate(par, model, test)
            par.print(f"epoch {epoch + 1:2d}/{args.epochs}  train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
                      f"test acc {acc:6.2%}  ({time.perf_counter() - t0:.2f} s)")
        wall = time.perf_counter() - start
        total = par.sum(float(seen))
        state = par.full_state_dict(model)  # consolidated on rank 0, whatever the sharding
        digest = state_digest(state) if par.is_main else ""
        over = "on rank 0 alone" if args.staleness else f"over {par.world_size} process(es)"  # async ps: no sum
        par.print(f"done in {wall:.2f} s  ({total / wall:,.0f} samples/s {over})  "
                  f"final test acc {acc:.2%}")
        par.print(f"final parameters sha256 {digest}")
        return {"test_acc": acc, "wall_s": wall, "samples_per_s": total / wall, "sha256": digest}


def inject_fault(args: argparse.Namespace, par: Parallel) -> None:
    """SIGKILL this rank after optimizer step ``--fail-at-step`` if it is ``--fail-rank``, on the first attempt."""
    if (args.fail_at_step == par.optimizer_steps and par.rank == args.fail_rank
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not rejoin_count()):
        print(f"paratrain demo: fault injection: SIGKILL rank {par.rank} after step {par.optimizer_steps}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
