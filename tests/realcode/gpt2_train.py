"""GPT-2 trained as karpathy/build-nanogpt's ``train_gpt2.py`` trains it, ported to ``Parallel``, for the real-code
suite.

Kept from that script: the GPT-2 model in the same file (``b, t = idx.size()`` in ``forward``, the loss computed
there from ``targets``, ``lm_head`` tied to ``wte``, ``configure_optimizers``' decay and no-decay groups with AdamW's
``foreach``/``fused`` left to torch), ``torch.manual_seed(1337)`` before the model is built, a ``DataLoaderLite``
reading ``B*T+1`` tokens at a position offset by the rank and advancing by ``B*T`` times the number of processes (its
token shard a seeded tensor here, nothing downloaded), gradient accumulation in ``for micro_step in
range(grad_accum_steps)``, gradient clipping at 1.0, bf16 autocast, the learning rate set by hand each step, a
validation loss averaged over ranks, a HellaSwag-style evaluation whose examples are split ``i % world == rank`` and
whose counts are summed over ranks, and top-k generation from a generator seeded per rank.

What the port changes, as docs/porting.md says: ``Parallel(precision="bf16-mixed", clip_grad_norm=1.0,
accumulate=GlobalBatch(...))`` replaces the setup block, the ``torch.autocast`` context and ``clip_grad_norm_``;
``grad_accum_steps`` is ``par.accumulate``; the loaders take ``par.data_parallel_rank``/``par.data_parallel_size``
(a tensor-parallel group reads one replica's batch); ``par.step`` and ``par.backward`` replace ``loss /
grad_accum_steps`` and ``loss.backward()``; ``par.mean``/``par.sum`` replace ``dist.all_reduce``; the validation
steps are stated for the whole job, so a run equals one process on the same batches; the evaluation's uneven split
runs through ``par.map_evenly`` (every rank runs as many forwards); evaluation and generation run on every rank and
rank 0 prints.

Run as a script (``paratrain run -n 2 gpt2_train.py OUT_DIR CASES_JSON``) it trains each case in turn on one process
group, which it starts itself as the original does; :func:`train` runs one case (one process: the reference).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

import paratrain


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight sharing scheme
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if hasattr(module, "NANOGPT_SCALE_INIT"):
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        assert t <= self.config.block_size, (
            f"Cannot forward sequence of length {t}, block size is {self.config.block_size}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float, device_type: str) -> torch.optim.AdamW:
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8)


# -----------------------------------------------------------------------------


def load_tokens(split: str) -> torch.Tensor:
    """One token shard: seeded ids standing for the original's ``edu_fineweb10B`` ``.npy`` files."""
    n, seed = (4097, 0) if split == "train" else (1025, 1)
    return torch.randint(0, GPTConfig.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


class DataLoaderLite:
    def __init__(self, B: int, T: int, process_rank: int, num_processes: int, split: str) -> None:
        self.B, self.T = B, T
        self.process_rank, self.num_processes = process_rank, num_processes
        self.tokens = load_tokens(split)
        self.reset()

    def reset(self) -> None:
        self.current_position = self.B * self.T * self.process_rank

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.B, self.T
        buf = self.tokens[self.current_position : self.current_position + B * T + 1]
        x = (buf[:-1]).view(B, T)  # inputs
        y = (buf[1:]).view(B, T)  # targets
        self.current_position += B * T * self.num_processes
        if self.current_position + (B * T * self.num_processes + 1) > len(self.tokens):
            self.reset()
        return x, y


def iterate_examples(n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """HellaSwag-shaped examples, seeded: a context and four candidate endings (``tokens``, ``mask`` over the ending,
    ``label``), standing for the original's downloaded ``hellaswag_val.jsonl``."""
    g = torch.Generator().manual_seed(7)
    for _ in range(n):
        context = torch.randint(0, GPTConfig.vocab_size, (1, 8), generator=g).repeat(4, 1)
        endings = torch.randint(0, GPTConfig.vocab_size, (4, 4), generator=g)
        mask = torch.cat([torch.zeros(4, 8, dtype=torch.long), torch.ones(4, 4, dtype=torch.long)], dim=1)
        yield torch.cat([context, endings], dim=1), mask, int(torch.randint(0, 4, (1,), generator=g))


def get_most_likely_row(tokens: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor) -> int:
    shift_logits = (logits[..., :-1, :]).contiguous()
    shift_tokens = (tokens[..., 1:]).contiguous()
    flat_shift_logits = shift_logits.view(-1, shift_logits.size(-1))
    flat_shift_tokens = shift_tokens.view(-1)
    shift_losses = F.cross_entropy(flat_shift_logits, flat_shift_tokens, reduction="none")
    shift_losses = shift_losses.view(tokens.size(0), -1)
    shift_mask = (mask[..., 1:]).contiguous()
    masked_shift_losses = shift_losses * shift_mask
    avg_loss = masked_shift_losses.sum(dim=1) / shift_mask.sum(dim=1)
    return avg_loss.argmin().item()


# -----------------------------------------------------------------------------
# the configuration, tiny: samples of T tokens, B per micro-step and replica, total_batch_size tokens per step
B, T = 2, 16
total_batch_size = 8 * T
max_lr, min_lr, warmup_steps, max_steps = 6e-4, 6e-5, 1, 3
val_batches = 4  # validation micro-batches of the whole job (the original: 20 on every rank)
hellaswag_examples = 5  # uneven over two replicas
num_return_sequences, max_length = 2, 12


def get_lr(it: int) -> float:
    if it < warmup_steps:
        return max_lr * (it + 1) / warmup_steps
    if it > max_steps:
        return min_lr
    decay_ratio = (it - warmup_steps) / (max_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (max_lr - min_lr)


def generate(model: nn.Module, device: torch.device, seed: int) -> list[list[int]]:
    """Top-k sampling from a fixed prompt, as the original does every 250 steps."""
    tokens = torch.tensor([1, 2, 3, 4], dtype=torch.long).unsqueeze(0).repeat(num_return_sequences, 1)
    xgen = tokens.to(device)
    sample_rng = torch.Generator(device=device)
    sample_rng.manual_seed(seed)
    while xgen.size(1) < max_length:
        with torch.no_grad():
            logits, loss = model(xgen)
            logits = logits[:, -1, :]
            probs = F.softmax(logits, dim=-1)
            topk_probs, topk_indices = torch.topk(probs, 50, dim=-1)
            ix = torch.multinomial(topk_probs, 1, generator=sample_rng)
            xcol = torch.gather(topk_indices, -1, ix)
            xgen = torch.cat((xgen, xcol), dim=1)
    return xgen.tolist()


def train(strategy: str, options: dict, *, sample_as: range | None = None) -> dict:
    """One run; returns what it logged, this rank's samples and, on rank 0, the final full state dict.
    ``sample_as``: the data-parallel ranks whose samples this process draws (its own by default; the one-process
    reference draws each replica's)."""
    par = paratrain.Parallel(
        strategy,
        precision="bf16-mixed",
        clip_grad_norm=1.0,
        monitor=False,
        accumulate=paratrain.GlobalBatch(total_batch_size // T, micro=B),
        **options,
    )
    torch.manual_seed(1337)
    model = GPT(GPTConfig(vocab_size=64))
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, device_type=par.device.type)
    model, optimizer = par.prepare(model, optimizer)
    grad_accum_steps = par.accumulate
    par.print(f"total desired batch size: {total_batch_size}, gradient accumulation steps: {grad_accum_steps}")
    train_loader = DataLoaderLite(B, T, par.data_parallel_rank, par.data_parallel_size, "train")
    val_loader = DataLoaderLite(B, T, par.data_parallel_rank, par.data_parallel_size, "val")
    log: dict = {"losses": [], "norms": [], "val": [], "hellaswag": [], "samples": {}, "accumulate": grad_accum_steps}

    for step in range(max_steps):
        last_step = step == max_steps - 1
        if step % 2 == 0 or last_step:
            model.eval()
            val_loader.reset()
            with torch.no_grad():
                val_loss_accum = 0.0
                val_loss_steps = val_batches // par.data_parallel_size
                for _ in range(val_loss_steps):
                    x, y = val_loader.next_batch()
                    x, y = x.to(par.device), y.to(par.device)
                    logits, loss = model(x, y)
                    loss = loss / val_loss_steps
                    val_loss_accum += loss.detach()
            val_loss_accum = par.mean(val_loss_accum)
            par.print(f"validation loss: {val_loss_accum.item():.4f}")
            log["val"].append(val_loss_accum.item())

            def correct(example: tuple[torch.Tensor, torch.Tensor, int]) -> int:
                tokens, mask, label = example
                tokens, mask = tokens.to(par.device), mask.to(par.device)
                with torch.no_grad():
                    logits, loss = model(tokens)
                return int(get_most_likely_row(tokens, mask, logits) == label)

            mine = [
                e
                for i, e in enumerate(iterate_examples(hellaswag_examples))
                if i % par.data_parallel_size == par.data_parallel_rank
            ]
            scores = par.map_evenly(correct, mine)  # the replicas evaluate 3 and 2: every rank runs 3 forwards
            num_total, num_correct_norm = len(scores), sum(scores)
            num_total = par.sum(torch.tensor(num_total, dtype=torch.long, device=par.device)).item()
            num_correct_norm = par.sum(torch.tensor(num_correct_norm, dtype=torch.long, device=par.device)).item()
            par.print(f"HellaSwag accuracy: {num_correct_norm}/{num_total}={num_correct_norm / num_total:.4f}")
            log["hellaswag"].append((num_correct_norm, num_total))

        if last_step:
            model.eval()
            for rank in sample_as or [par.data_parallel_rank]:
                log["samples"][rank] = generate(model, par.device, 42 + rank)

        model.train()
        lr = get_lr(step)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        loss_accum = 0.0
        for micro_step in range(grad_accum_steps):  # noqa: B007 - par.step knows which one syncs
            x, y = train_loader.next_batch()
            x, y = x.to(par.device), y.to(par.device)
            with par.step(model, optimizer):
                logits, loss = model(x, y)
                par.backward(loss)
            loss_accum += loss.detach() / grad_accum_steps
        loss_accum = par.mean(loss_accum)
        norm = par.last_grad_norm
        par.print(f"step {step:4d} | loss: {loss_accum.item():.6f} | lr {lr:.4e} | norm: {norm:.4f}")
        log["losses"].append(loss_accum.item())
        log["norms"].append(norm.item())
    log["state"] = par.full_state_dict(model)
    par.close()
    return log


def main(out_dir: str, cases: list[dict]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # as the original does; each case's Parallel joins it
    results = {}
    for case in cases:
        result = train(case["strategy"], case.get("options", {}))
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, result.pop("samples"))  # each rank's own generation
        results[case["name"]] = {**result, "samples": every_rank}
    results["pids"] = [None] * dist.get_world_size()
    dist.all_gather_object(results["pids"], os.getpid())
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
