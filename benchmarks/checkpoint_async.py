"""Step time while a checkpoint is written: an asynchronous save against a blocking one and no save.

An MLP whose state (weights and Adam's two moments) takes a second or more to write here trains at world 2 (CPU,
gloo, one thread a rank) under ddp and under zero3, one launched job each. Every round times three windows, in an
order that rotates from round to round: a save (``par.save(async_save=True)``, ``par.save``, or none) followed by
``--steps`` optimizer steps, each window into a folder of its own. Reported per strategy, medians over the rounds:

* the window's time (the save call and the steps after it) and its ratio to the window without a save;
* how long the save call held the loop (the blocking save: the whole write; the asynchronous one: staging);
* for the asynchronous save, when its checkpoint was published (seconds after the call; it is published at the first
  step after the write completed) and the median time of the steps taken until then, against the median step
  without a save: what writing in the background costs the steps it overlaps.

Run (about 3 minutes on 2 cores):
    .venv/bin/python benchmarks/checkpoint_async.py [--rounds 4] [--steps 6] [--json PATH]

``--compare``: how long an asynchronous save holds the training thread, through torch's stager (buffers kept from
save to save, filled in the background while the next step's forward and backward run) against the former path (the
whole state copied into fresh memory on the training thread, as ``async_save`` does without a stager). ddp at world
2; rounds alternate which path saves first; each save is followed by ``--steps`` steps and drained. Held: the save
call plus what the steps after it waited for the copy. The first save of each path (the stager allocates its buffers
then) is reported apart.
    .venv/bin/python benchmarks/checkpoint_async.py --compare [--rounds 8] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from checkpoint_jobs import build_mlp
from ddp_overhead import audited, background_line

import paratrain
from paratrain.checkpoint import background
from paratrain.checkpoint.background import BackgroundSaves

MODES = ("none", "blocking", "async")
BATCH = 16  # per rank


def window_worker(strategy: str, width: int, layers: int, rounds: int, steps: int, root: str) -> dict:
    """Rank 0 returns, per mode, each round's window time, save-call time and step times (and, for the asynchronous
    save, after how many steps its folder was published)."""
    torch.set_num_threads(1)
    par = paratrain.Parallel(strategy, seed=0, monitor=False)
    model = build_mlp(width, layers)
    parameters = sum(p.numel() for p in model.parameters())
    model, optimizer = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-5))
    x = torch.randn(BATCH, width)

    def step() -> float:
        start = time.perf_counter()
        with par.step(model, optimizer):
            par.backward(model(x).pow(2).mean())
        return time.perf_counter() - start

    def drain(saved: Path | None) -> None:
        """Steps (not timed) until every rank sees ``saved`` published: the next window starts with nothing in
        flight."""
        while saved is not None and par.sum(float(saved.exists())) < par.world_size:
            step()

    for _ in range(2):  # Adam's state exists and the first steps' costs are behind
        step()
    drain(par.save(Path(root) / "warmup", async_save=True))  # the writers' group is made once, outside the timing
    rows: dict[str, dict[str, list]] = {
        m: {"window_s": [], "call_s": [], "steps_s": [], "published_after": [], "published_s": []} for m in MODES
    }
    for r in range(rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            folder = Path(root) / f"{mode}-{r}"
            par.barrier()
            start = time.perf_counter()
            saved = None if mode == "none" else par.save(folder, async_save=mode == "async")
            call = time.perf_counter() - start
            times, published_after, published_s = [], None, None
            for i in range(steps):
                times.append(step())
                if saved is not None and published_after is None and saved.exists():
                    published_after, published_s = i + 1, time.perf_counter() - start
            window = time.perf_counter() - start
            drain(saved)
            for key, value in (
                ("window_s", window),
                ("call_s", call),
                ("steps_s", times),
                ("published_after", published_after),
                ("published_s", published_s),
            ):
                rows[mode][key].append(value)
            par.barrier()
            if par.is_main:
                shutil.rmtree(folder, ignore_errors=True)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights + Adam's 2 moments
    par.close()
    return {"parameters": parameters, "state_bytes": state_bytes, "rows": rows} if par.is_main else {}


PATHS = ("fresh copy", "stager")


@contextmanager
def fresh_copy(saves: BackgroundSaves) -> Iterator[None]:
    """A save through ``async_save`` without a stager (its copy into fresh memory, on this thread); the job's stager
    and its buffers are set aside meanwhile, not closed."""
    kept, saves._stager = saves._stager, None
    make, background.new_stager = background.new_stager, lambda gpus: None
    try:
        yield
    finally:
        saves._stager, background.new_stager = kept, make


def held_worker(width: int, layers: int, rounds: int, steps: int, root: str) -> dict:
    """Rank 0 returns, per path, each round's save-call time, time waited for the copy afterwards, and window."""
    torch.set_num_threads(1)
    waited = [0.0]
    wait_staged = BackgroundSaves.wait_staged

    def timed_wait(self: BackgroundSaves) -> None:
        start = time.perf_counter()
        wait_staged(self)
        waited[0] += time.perf_counter() - start

    BackgroundSaves.wait_staged = timed_wait
    par = paratrain.Parallel("ddp", seed=0, monitor=False)
    model = build_mlp(width, layers)
    model, optimizer = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-5))
    saves = par._checkpoints._background
    x = torch.randn(BATCH, width)

    def step() -> None:
        with par.step(model, optimizer):
            par.backward(model(x).pow(2).mean())

    def save(path: str, folder: Path) -> tuple[float, float, float]:
        """One save by ``path`` and ``steps`` steps; then steps until it is published everywhere."""
        par.barrier()
        waited[0] = 0.0
        start = time.perf_counter()
        with fresh_copy(saves) if path == "fresh copy" else nullcontext():
            saved = par.save(folder, async_save=True)
        call = time.perf_counter() - start
        for _ in range(steps):
            step()
        window = time.perf_counter() - start
        while par.sum(float(saved.exists())) < par.world_size:
            step()
        par.barrier()
        if par.is_main:
            shutil.rmtree(folder, ignore_errors=True)
        return call, waited[0], window

    for _ in range(2):
        step()
    rows: dict[str, dict[str, list]] = {p: {"call_s": [], "waited_s": [], "window_s": []} for p in PATHS}
    first = {p: save(p, Path(root) / f"first-{i}") for i, p in enumerate(PATHS)}
    for r in range(rounds):
        for i, path in enumerate(PATHS if r % 2 == 0 else PATHS[::-1]):
            for key, value in zip(("call_s", "waited_s", "window_s"), save(path, Path(root) / f"{r}-{i}")):
                rows[path][key].append(value)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    par.close()
    return {"state_bytes": state_bytes, "first": first, "rows": rows} if par.is_main else {}


def compare(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="ckpt-held-bench-", dir=".") as root:
        return paratrain.launch(
            held_worker, 2, args=(args.width, args.layers, args.rounds, args.steps, root), timeout_s=1800
        )[0]


def format_compare(args: argparse.Namespace, result: dict) -> str:
    lines = [
        (
            f"ddp, world 2, MLP {args.layers} x Linear({args.width}, {args.width}): state "
            f"{result['state_bytes'] / 1e6:.0f} MB a rank (weights + Adam); {args.steps} steps after each save; "
            f"median of {args.rounds} rounds, paths alternating"
        ),
        f"   {'path':<12}{'held ms':>9}{'call ms':>9}{'waited ms':>11}{'window s':>10}   first save: held ms",
    ]
    for path in PATHS:
        row = result["rows"][path]
        held = [c + w for c, w in zip(row["call_s"], row["waited_s"])]
        call, waited, _ = result["first"][path]
        lines.append(
            f"   {path:<12}{1e3 * statistics.median(held):>9.0f}{1e3 * statistics.median(row['call_s']):>9.0f}"
            f"{1e3 * statistics.median(row['waited_s']):>11.0f}{statistics.median(row['window_s']):>10.2f}"
            f"   {1e3 * (call + waited):.0f}"
        )
        lines.append(f"      held ms each round: {' '.join(f'{1e3 * h:.0f}' for h in held)}")
    return "\n".join(lines + [background_line(result)])


def bench(strategy: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="ckpt-async-bench-", dir=".") as root:
        return paratrain.launch(
            window_worker, 2, args=(strategy, args.width, args.layers, args.rounds, args.steps, root), timeout_s=900
        )[0]


def summary(result: dict) -> dict:
    rows = result["rows"]
    none_window = statistics.median(rows["none"]["window_s"])
    none_step = statistics.median(t for ts in rows["none"]["steps_s"] for t in ts)
    out = {}
    for mode in MODES:
        row = rows[mode]
        entry = {"window_s": statistics.median(row["window_s"]), "call_s": statistics.median(row["call_s"])}
        entry["window_x_none"] = entry["window_s"] / none_window
        if mode == "async":
            during = [t for ts, n in zip(row["steps_s"], row["published_after"]) for t in ts[: n or len(ts)]]
            entry["published_after_steps"] = row["published_after"]
            published = [t for t in row["published_s"] if t is not None]  # None: after the window
            entry["published_s"] = (
                statistics.median(published) if len(published) > len(row["published_s"]) / 2 else None
            )
            entry["step_while_writing_ms"] = 1e3 * statistics.median(during)
            entry["step_while_writing_x_none"] = statistics.median(during) / none_step
        out[mode] = entry
    out["step_none_ms"] = 1e3 * none_step
    return out


def format_report(args: argparse.Namespace, results: dict) -> str:
    lines = []
    for strategy, result in results.items():
        s = summary(result)
        lines += [
            f"{strategy}: MLP {args.layers} x Linear({args.width}, {args.width}) = "
            f"{result['parameters'] / 1e6:.1f}M parameters, state {result['state_bytes'] / 1e6:.0f} MB "
            f"(weights + Adam); world 2; {args.steps} steps a window, batch {BATCH}/rank; "
            f"median of {args.rounds} rounds",
            f"   {'save':<10}{'window s':>10}{'x none':>8}{'save call s':>13}   published after (steps each "
            "round), median step while writing",
        ]
        for mode in MODES:
            e = s[mode]
            extra = ""
            if mode == "async":
                when = "after the window" if e["published_s"] is None else f"{e['published_s']:.2f} s"
                extra = (
                    f"   {when} {e['published_after_steps']}, {e['step_while_writing_ms']:.0f} ms "
                    f"({e['step_while_writing_x_none']:.2f}x the {s['step_none_ms']:.0f} ms without a save)"
                )
            lines.append(f"   {mode:<10}{e['window_s']:>10.2f}{e['window_x_none']:>8.2f}{e['call_s']:>13.2f}{extra}")
        lines += [background_line(result), ""]
    return "\n".join(lines).rstrip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps in a window after the save call")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--compare",
        action="store_true",
        help="held time per save: torch's stager against a fresh copy on the training thread",
    )
    args = parser.parse_args()
    if args.compare:
        result = audited(lambda: compare(args))
        print(format_compare(args, result))
        if args.json:
            Path(args.json).write_text(json.dumps({"config": vars(args), "result": result}, indent=1))
        return
    results = {strategy: audited(lambda strategy=strategy: bench(strategy, args)) for strategy in ("ddp", "zero3")}
    print(format_report(args, results))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"config": vars(args), "results": results, "summary": {k: summary(v) for k, v in results.items()}},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
