"""A GPT-2 training script in the shapes torchrun scripts have, ported to ``Parallel``: a loader class of its own
drawing offsets into a token tensor (no DataLoader), accumulation in ``for micro_step in range(par.accumulate)``, the
loss computed by the model, clipping, rank-0 printing and saving, an evaluation outside ``par.step``.

``paratrain run -n 2 tiny_gpt_train.py [--same-data] [--out DIR]``; ``--same-data`` seeds every rank's loader alike
(the bug ``paratrain verify tiny_gpt_train.py --same-data`` must name).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.nn import functional as F

import paratrain

VOCAB, BLOCK, EMBD, BATCH = 32, 8, 16, 4


class TinyGPT(nn.Module):
    """One causal attention block; the forward reads its input's shape and returns ``(logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBD), nn.Embedding(BLOCK, EMBD)
        self.ln, self.qkv, self.proj = nn.LayerNorm(EMBD), nn.Linear(EMBD, 3 * EMBD), nn.Linear(EMBD, EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD))
        self.head = nn.Linear(EMBD, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        q, k, v = self.qkv(self.ln(x)).split(EMBD, dim=2)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        x = x + self.mlp(x)
        logits = self.head(x)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


class TokenLoader:
    """Random windows of a token tensor, drawn from a generator of its own."""

    def __init__(self, tokens: torch.Tensor, seed: int) -> None:
        self.tokens, self.g = tokens, torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(self.tokens) - BLOCK - 1, (BATCH,), generator=self.g)
        x = torch.stack([self.tokens[i : i + BLOCK] for i in ix])
        y = torch.stack([self.tokens[i + 1 : i + 1 + BLOCK] for i in ix])
        return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--same-data", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()

    par = paratrain.Parallel("ddp", accumulate=2, clip_grad_norm=1.0, monitor=False)
    tokens = torch.randint(0, VOCAB, (4096,), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1337 + par.rank)  # each rank builds other weights; prepare starts them from rank 0's
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = par.prepare(model, optimizer)
    train = TokenLoader(tokens, seed=1234 if args.same_data else 1234 + par.data_parallel_rank)
    val = TokenLoader(tokens, seed=99)

    for it in range(args.iters):
        for _micro_step in range(par.accumulate):
            x, y = train.next_batch()
            with par.step(model, optimizer):
                _, loss = model(x.to(par.device), y.to(par.device))
                par.backward(loss)
        if it % 2 == 0:  # evaluation: every rank, outside par.step
            model.eval()
            with torch.no_grad():
                xv, yv = val.next_batch()
                _, val_loss = model(xv.to(par.device), yv.to(par.device))
            model.train()
            _, probe = model(xv.to(par.device), yv.to(par.device))  # in training mode, never backpropagated
            par.print(f"iter {it}: loss {loss.item():.4f} val {float(par.mean(val_loss)):.4f} probe {probe.item():.4f}")
            state = par.full_state_dict(model)  # every rank; rank 0 writes
            if par.is_main and args.out:
                torch.save(state, os.path.join(args.out, "ckpt.pt"))
    par.close()


if __name__ == "__main__":
    main()
