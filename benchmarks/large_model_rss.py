"""Peak host memory (RSS) per rank and time to a ready model, for a Llama-shaped model loaded from a safetensors
checkpoint: today's path against the meta device and a sharded load.

* ``full``: every rank builds the whole model (transformers' init on the CPU), loads the checkpoint into it file by
  file (``safetensors.torch.load_file`` + ``load_state_dict``, as ``from_pretrained`` does), then ``prepare``
  shards it.
* ``meta``: every rank builds the model under ``torch.device("meta")``, ``prepare`` lays it out and allocates only
  this rank's shard (``init_fn="empty"``), then ``par.load_weights`` reads this rank's slices of the checkpoint.

Each variant runs as its own launched job (peak RSS only grows within a process), variants interleaved round by
round; per rank: ``ru_maxrss`` at the end, RSS after imports (the process baseline) and seconds from the start of
the build to a prepared, loaded model. The checkpoint is written once, transformers' sharded layout (one file per
block and an index), in a temporary folder.

    python benchmarks/large_model_rss.py --worlds 2,4 --strategies zero3,tp --rounds 1 --out rss.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

SHAPE = dict(
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPE)


def _rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


class _Peaks(threading.Thread):
    """Samples the anonymous and the file-backed resident memory every 10 ms: their peaks, apart (``ru_maxrss``
    only has their sum; file-backed pages are a memory-mapped checkpoint's, shared and reclaimable)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.anon = self.file = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.01):
            self.anon = max(self.anon, _rss_mib("RssAnon"))
            self.file = max(self.file, _rss_mib("RssFile"))


def write_checkpoint(folder: Path) -> tuple[int, int]:
    """A random checkpoint of the model in transformers' sharded layout, one block at a time (never the whole model
    in memory). Returns (parameters, largest tensor's bytes)."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(_config())
    groups: dict[str, dict[str, tuple]] = {}
    for name, p in model.named_parameters():
        part = name.split(".")[2] if name.startswith("model.layers.") else "outer"
        groups.setdefault(part, {})[name] = tuple(p.shape)
    weight_map, g = {}, torch.Generator().manual_seed(0)
    for part, shapes in groups.items():
        file = f"model-{part}.safetensors"
        save_file({n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}, str(folder / file))
        weight_map.update({n: file for n in shapes})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    params = sum(p.numel() for p in model.parameters())
    return params, max(p.numel() * p.element_size() for p in model.parameters())


def ready_model(variant: str, strategy: str, folder: str) -> dict[str, float]:
    """One rank: a prepared model holding the checkpoint's weights; its peak RSS and time to get there."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import paratrain

    torch.set_num_threads(1)
    baseline = _rss_mib()
    peaks = _Peaks()
    peaks.start()
    start = time.perf_counter()
    if variant == "full":
        from safetensors.torch import load_file

        par = paratrain.Parallel(strategy, monitor=False)
        model = LlamaForCausalLM(_config())
        for file in sorted(Path(folder).glob("*.safetensors")):  # file by file, as from_pretrained loads
            model.load_state_dict(load_file(str(file)), strict=False)
        model = par.prepare(model)
    else:
        par = paratrain.Parallel(strategy, monitor=False, model=paratrain.ModelConfig(init_fn="empty"))
        with torch.device("meta"):
            model = LlamaForCausalLM(_config())
        model = par.prepare(model)
        par.load_weights(model, folder)
    par.barrier()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peaks.stop.set()
    peaks.join()
    out = {
        "rank": dist.get_rank(),
        "baseline_mib": baseline,
        "peak_mib": peak,
        "peak_anon_mib": peaks.anon,
        "peak_file_mib": peaks.file,
        "seconds": seconds,
    }
    par.close()
    return out


def run(variant: str, strategy: str, world: int, folder: str) -> list[dict[str, float]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from paratrain.testing import spawn

    return spawn(_entry, world, (variant, strategy, folder), timeout_s=1200)


def _entry(variant: str, strategy: str, folder: str) -> dict[str, float]:
    return ready_model(variant, strategy, folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--strategies", default="zero3,tp")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--first-round", type=int, default=0, help="odd: start with the meta variant")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        params, largest = write_checkpoint(Path(tmp))
        print(
            f"model: Llama {SHAPE['num_hidden_layers']} layers x {SHAPE['hidden_size']}, {params / 1e9:.3f}B "
            f"parameters, {params * 4 / 2**30:.2f} GiB fp32; largest tensor {largest / 2**20:.0f} MiB",
            flush=True,
        )
        for r in range(args.first_round, args.first_round + args.rounds):
            for world in map(int, args.worlds.split(",")):
                for strategy in args.strategies.split(","):
                    for variant in ("full", "meta") if r % 2 == 0 else ("meta", "full"):
                        ranks = run(variant, strategy, world, tmp)
                        row = {"round": r, "world": world, "strategy": strategy, "variant": variant, "ranks": ranks}
                        results.append(row)
                        print(
                            f"round {r} world {world} {strategy:6s} {variant:5s} peak RSS/rank "
                            f"{max(x['peak_mib'] for x in ranks):8.0f} MiB (anon "
                            f"{max(x['peak_anon_mib'] for x in ranks):.0f}, file "
                            f"{max(x['peak_file_mib'] for x in ranks):.0f}, baseline "
                            f"{statistics.median(x['baseline_mib'] for x in ranks):.0f}), ready in "
                            f"{max(x['seconds'] for x in ranks):6.1f} s",
                            flush=True,
                        )
    summary = {
        "params": params,
        "largest_tensor_bytes": largest,
        "shape": SHAPE,
        "results": results,
        "machine": f"{os.cpu_count()} CPU cores, no GPU",
        "torch": torch.__version__,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
