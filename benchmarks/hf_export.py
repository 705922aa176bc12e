"""``paratrain export --format hf`` of a small Llama: its time and size beside ``--format pt`` and transformers'
``save_pretrained`` of the same weights.

A Llama (width 512, 8 blocks, vocabulary 32000, untied head: 58M parameters, fp32) is saved by ``par.save`` in one
process (a DCP checkpoint, as any strategy writes one), then exported both ways; ``save_pretrained`` writes the model
itself (no checkpoint to read). Each is timed ``--repeats`` times (the median), in this process; the folders' sizes
are what is on disk. The export's folder is then loaded with ``from_pretrained`` and its logits compared.

Run (about a minute on 2 cores):
    PYTHONPATH=src .venv/bin/python benchmarks/hf_export.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import paratrain
from paratrain.checkpoint import export


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def timed(work, repeats: int, out: Path) -> float:
    """The median seconds of ``work()``, ``out`` removed before each run."""
    times = []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        out.unlink(missing_ok=True) if out.is_file() else None
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        par = paratrain.Parallel("single", monitor=False)
        model = par.prepare(llama())
        par.save(root / "ckpt")
        plain = par.unwrap(model)
        params = sum(p.numel() for p in plain.parameters())
        rows = [
            ("export --format hf", root / "hf", lambda: export(root / "ckpt", root / "hf", format="hf")),
            ("export --format pt", root / "model.pt", lambda: export(root / "ckpt", root / "model.pt", force=True)),
            ("save_pretrained", root / "pretrained", lambda: plain.save_pretrained(root / "pretrained")),
        ]
        print(f"Llama, {params / 1e6:.1f}M parameters, fp32; median of {args.repeats}")
        print(f"{'what':<20} {'seconds':>8} {'MiB':>8} {'files':>6}")
        for name, out, work in rows:
            seconds = timed(work, args.repeats, out)
            files = len(list(out.iterdir())) if out.is_dir() else 1
            print(f"{name:<20} {seconds:>8.2f} {size(out) / 2**20:>8.1f} {files:>6}")
        loaded = AutoModelForCausalLM.from_pretrained(root / "hf")
        x = torch.arange(32).reshape(2, 16)
        with torch.no_grad():
            same = torch.equal(loaded(x).logits, plain(x).logits)
        print(f"from_pretrained(export) logits equal to the model's: {same}")
        par.close()


if __name__ == "__main__":
    main()
