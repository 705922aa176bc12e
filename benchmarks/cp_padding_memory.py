"""Peak host memory of one attention call (forward and backward) on whole padded sequences, as cp runs it: the
kernel called once with a dense ``[b, 1, s, s]`` mask against :func:`paratrain.distributed.context_parallel.masks.
attend` (each sample's valid tokens run causally, no mask for SDPA), beside the kernel on the same sequence
unpadded (is_causal, no mask: the floor the kernel itself sets).

One sample, 8 query heads over 2 key/value heads of 64 (what a rank holds of a 32-head model under cp=4), fp32,
the last 10% of the sequence padded. Each (way, kernel, length) runs in a fresh process; the figure is the growth
of its peak resident memory (``VmHWM``, reset after a warm-up call) over the call: the mask, the kernel's
temporaries and the gradients.

Run (a few minutes on 2 cores):
    .venv/bin/python benchmarks/cp_padding_memory.py [--lengths 2048 4096 8192 16384] [--kernel sdpa|eager]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from types import SimpleNamespace

import torch

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _rss(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+) kB", status.read()).group(1)) * 1024


def _kernel(name: str):
    if name == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return lambda module, q, k, v, mask, **kwargs: eager_attention_forward(module, q, k, v, mask, HEAD_DIM**-0.5)


def measure(way: str, name: str, length: int) -> int:
    """Bytes the peak resident memory grows by over one call."""
    from paratrain.distributed.context_parallel.masks import attend, key_mask, read_padding

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, length, HEAD_DIM, requires_grad=True) for h in (HEADS, KV_HEADS, KV_HEADS))
    keys = torch.ones(1, length, dtype=torch.long)
    keys[0, length - length // 10 :] = 0
    module, kernel = (
        SimpleNamespace(is_causal=True, num_key_value_groups=HEADS // KV_HEADS, training=False),
        _kernel(name),
    )
    form = "bool" if name == "sdpa" else "additive"

    def call() -> None:
        if way != "dense":
            padding = read_padding(keys if way == "attend" else torch.ones_like(keys), q.device)
            out, _ = attend(kernel, module, q, k, v, padding, True, form, {})
        else:
            allowed = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & keys.bool()[:, None, None, :]
            out, _ = kernel(module, q, k, v, key_mask(allowed, form, q.dtype))
        out.sum().backward()

    call()
    q.grad = k.grad = v.grad = None
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak (VmHWM) starts again from the current RSS
    base = _rss("VmRSS")
    call()
    return _rss("VmHWM") - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--kernel", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # way, kernel, length: the child process
    args = parser.parse_args()
    if args.one:
        way, name, length = args.one
        print(measure(way, name, int(length)))
        return
    print(
        f"{'tokens':>8} {'dense mask MiB':>15} {'attend MiB':>11} {'unpadded MiB':>13}  ({args.kernel}, peak RSS "
        "growth of one call)"
    )
    for length in args.lengths:
        row = [
            int(
                subprocess.run(
                    [sys.executable, __file__, "--one", way, args.kernel, str(length)],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.split()[-1]
            )
            / 2**20
            for way in ("dense", "attend", "unpadded")
        ]
        print(f"{length:>8} {row[0]:>15.0f} {row[1]:>11.0f} {row[2]:>13.0f}")


if __name__ == "__main__":
    main()
