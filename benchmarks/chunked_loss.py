"""Peak memory and step time of a long-sequence, large-vocabulary step: the loss at the head in chunks
(``Parallel(loss_chunk=N)``) against the plain one (the model's own ``labels=`` loss on whole logits).

Model: transformers' ``LlamaForCausalLM`` with Llama 3's vocabulary (128256) and a small trunk (2 layers x 64), so the
logits dominate the step as they do in a real one at a long sequence; one sequence of ``--seq`` tokens, fp32, one
process, through ``par.forward_backward(model, {"input_ids": ids, "labels": ids})``.

One process holds a ``Parallel`` and a copy of the model per variant and runs their steps interleaved: a warm-up
step each (for the chunked loss also its proof, on a slice of the batch), then ``--steps`` rounds of one step each.
Per step: the peak resident memory above the resident memory before it (the kernel's high-water mark, reset before
each step through ``/proc/self/clear_refs``; glibc is told to hand every block over 64 KiB back to the kernel when
freed, so resident memory follows the tensors alive) and the time of the forward and backward, wall and this
process's CPU time (steadier on a shared machine). Reported: medians over the rounds, and the last step's loss
(equal across variants to float precision).

    PYTHONPATH=src .venv/bin/python benchmarks/chunked_loss.py [--seq 2048] [--chunks 256,1024] [--steps 4]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

VOCAB, HIDDEN = 128256, 64


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _model(seq: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=4 * HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=seq,
            tie_word_embeddings=False,
        )
    )


def measure(seq: int, chunks: list[int | None], steps: int) -> dict[str, dict]:
    """Each variant's peaks (bytes), step times (s, wall and this process's CPU) and last loss."""
    import paratrain

    torch.set_num_threads(os.cpu_count() or 1)
    batch = {"input_ids": torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))}
    batch["labels"] = batch["input_ids"]
    variants = {}
    for chunk in chunks:
        par = paratrain.Parallel("single", monitor=False, model=paratrain.ModelConfig(loss_chunk=chunk))
        variants[str(chunk or "plain")] = (par, par.prepare(_model(seq)))
    runs: dict[str, dict] = {name: {"peaks": [], "times": [], "cpu": []} for name in variants}
    for step in range(steps + 1):
        for name, (par, model) in variants.items():
            model.zero_grad(set_to_none=True)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the high-water mark starts again from what is resident now
            before, start, cpu = _status("VmRSS"), time.perf_counter(), time.process_time()
            loss = par.forward_backward(model, batch)
            seconds, cpu, peak = time.perf_counter() - start, time.process_time() - cpu, _status("VmHWM") - before
            runs[name]["loss"] = float(loss)
            if step:  # the first is the warm-up (and the chunked loss's proof)
                runs[name]["peaks"].append(peak)
                runs[name]["times"].append(seconds)
                runs[name]["cpu"].append(cpu)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--chunks", default="256,1024", help="loss_chunk values to compare with the plain loss")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # glibc reads it at start: run again with it set
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)
    runs = measure(args.seq, [None, *(int(c) for c in args.chunks.split(","))], args.steps)
    logits = args.seq * VOCAB * 4
    print(
        f"seq {args.seq}, vocab {VOCAB}: the fp32 logits are {logits / 2**20:.0f} MiB; medians of {args.steps} "
        "interleaved steps"
    )
    print(
        f"{'':>12} {'peak above the step start':>26} {'x plain':>8} {'step':>8} {'x plain':>8} "
        f"{'CPU':>8} {'x plain':>8} {'loss':>10}"
    )
    summary, base = {}, None
    for name, run in runs.items():
        peak, step, cpu = (statistics.median(run[k]) for k in ("peaks", "times", "cpu"))
        base = base or (peak, step, cpu)
        summary[name] = {"peak_bytes": peak, "step_s": step, "cpu_s": cpu, "loss": run["loss"]}
        label = "plain" if name == "plain" else f"chunk {name}"
        print(
            f"{label:>12} {peak / 2**20:>22.0f} MiB {peak / base[0]:>8.2f} {step:>7.2f}s {step / base[1]:>8.2f} "
            f"{cpu:>7.2f}s {cpu / base[2]:>8.2f} {run['loss']:>10.6f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "seq": args.seq,
                    "vocab": VOCAB,
                    "hidden": HIDDEN,
                    "logits_bytes": logits,
                    "runs": runs,
                    "summary": summary,
                    "torch": torch.__version__,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
