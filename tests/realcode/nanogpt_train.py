"""nanoGPT's ``train.py`` as docs/porting.md ports it to ``Parallel``, for the real-code suite.

Kept from nanoGPT: module-level configuration, ``torch.manual_seed(1337 + rank)`` before the model is built (each
rank initializes differently; ``prepare`` starts every rank from rank 0's weights), a character-level dataset in
``train.bin``/``val.bin`` read through ``np.memmap`` with no DataLoader, ``model(X, Y)`` computing the loss inside
``forward``, ``configure_optimizers``' two parameter groups, the cosine learning-rate schedule set by hand each
iteration, gradient clipping, evaluation every ``eval_interval`` iterations and a checkpoint on rank 0.

What the port changes, as the guide says: the global batch is stated once (``global_batch``; ``par.accumulate``
follows from the layout), ``get_batch`` draws the global batch's offsets from a generator every rank seeds alike
and keeps this replica's share (so the run equals one process on the same batches), the evaluation runs on every
rank and prints on rank 0, and the checkpoint's full state is taken on every rank and written by rank 0.

Run as a script (``paratrain run -n 2 nanogpt_train.py DATA_DIR OUT_DIR CASES_JSON``) it trains each case in turn on
one process group, which it starts itself as nanoGPT does; :func:`train` runs one case (one process: the
reference).
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import torch
from nanogpt_model import GPT, GPTConfig

import paratrain

# -----------------------------------------------------------------------------
# the char-level configuration (block_size > vocab_size, as in nanoGPT's shakespeare_char), tiny
block_size, vocab_size, n_layer, n_head, n_embd, dropout, bias = 64, 48, 2, 4, 32, 0.0, True
batch_size = 4  # micro-batch per replica
global_batch = 16  # samples per optimizer step, every replica and micro-step together
eval_batch = 8
learning_rate, weight_decay, beta1, beta2, grad_clip = 1e-3, 1e-1, 0.9, 0.99, 1.0
max_iters, warmup_iters, lr_decay_iters, min_lr = 3, 2, 4, 1e-4
eval_interval, eval_iters = 2, 2
# -----------------------------------------------------------------------------


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def train(strategy: str, options: dict, data_dir: str, out_dir: str, *, in_forward_backward: bool = True) -> dict:
    """One training run; returns the losses and, on rank 0, the final full state dict."""
    par = paratrain.Parallel(
        strategy,
        clip_grad_norm=grad_clip,
        monitor=False,
        accumulate=paratrain.GlobalBatch(global_batch, micro=batch_size),
        **options,
    )
    torch.manual_seed(1337 + par.rank)  # nanoGPT's seed_offset: every rank builds other weights
    config = GPTConfig(
        block_size=block_size,
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        dropout=dropout,
        bias=bias,
    )
    model = GPT(config)
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), "cpu")
    model, optimizer = par.prepare(model, optimizer)

    def get_batch(split: str, it: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        samples = global_batch if split == "train" else eval_batch
        g = torch.Generator().manual_seed(it if split == "train" else 10_000 + it)  # alike on every rank
        ix = torch.randint(len(data) - block_size, (samples,), generator=g)  # the global batch of this iteration
        ix = ix.view(
            -1, par.data_parallel_size, samples // par.data_parallel_size // (par.accumulate if split == "train" else 1)
        )[micro, par.data_parallel_rank]  # this replica's share of this micro-step
        x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
        return x.to(par.device), y.to(par.device)

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                X, Y = get_batch(split, k)
                _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = float(par.mean(losses.mean()))
        model.train()
        return out

    losses, evals = [], []
    for iter_num in range(max_iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num)
        if iter_num % eval_interval == 0:
            evals.append(estimate_loss())
            par.print(f"step {iter_num}: train loss {evals[-1]['train']:.4f}, val loss {evals[-1]['val']:.4f}")
        step_loss = 0.0
        for micro_step in range(par.accumulate):
            X, Y = get_batch("train", iter_num, micro_step)
            with par.step(model, optimizer):
                if in_forward_backward:
                    loss = par.forward_backward(model, X, Y)
                else:
                    _, loss = model(X, Y)
                    par.backward(loss)
            step_loss += float(loss) / par.accumulate
        losses.append(float(par.mean(step_loss)))  # the global batch's mean loss
    state = par.full_state_dict(model)  # every rank; rank 0 gets it
    if par.is_main:
        torch.save({"model": state, "iter_num": max_iters}, os.path.join(out_dir, "ckpt.pt"))
    result = {"losses": losses, "evals": evals, "accumulate": par.accumulate, "state": state}
    par.close()
    return result


def main(data_dir: str, out_dir: str, cases: list[dict]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # as nanoGPT does; each case's Parallel joins it
    results = {}
    for case in cases:
        name = case["name"]
        folder = os.path.join(out_dir, name)
        os.makedirs(folder, exist_ok=True)
        try:
            results[name] = train(
                case["strategy"],
                case.get("options", {}),
                data_dir,
                folder,
                in_forward_backward=case.get("forward_backward", True),
            )
        except paratrain.ParatrainError as err:
            results[name] = {"error": str(err)}
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
