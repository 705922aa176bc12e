"""Sharded data parallel (ZeRO-1/2/3, FSDP, HSDP) on a small transformer, each block one sharding unit.

paratrain run -n 2 examples/sharded_transformer.py --strategy zero3
paratrain run -n 2 examples/sharded_transformer.py --strategy zero2 --precision bf16-mixed
paratrain run -n 4 examples/sharded_transformer.py --strategy hsdp      # 2 shard groups of 2
"""

import argparse

import torch
from torch import nn

import paratrain

# test-launch: paratrain run -n 2 --steps 4 | paratrain run -n 2 --strategy zero1 --precision bf16-mixed --steps 4


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.mlp(x)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="zero3")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    options = {"wrap_classes": [Block]} if args.strategy in ("zero2", "zero3", "fsdp", "hsdp") else {}
    par = paratrain.Parallel(args.strategy, precision=args.precision, clip_grad_norm=1.0, seed=0, **options)
    model = TinyLM()
    model, optimizer = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    g = torch.Generator().manual_seed(par.data_parallel_rank)
    for step in range(args.steps):
        tokens = torch.randint(0, 128, (8, 33), generator=g).to(par.device)
        tokens[:, 1::2] = tokens[:, 0::2][:, :16]  # a learnable pattern: every odd token repeats its neighbour
        with par.step(model, optimizer):
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 128), tokens[:, 1:].reshape(-1))
            par.backward(loss)
        if step % 10 == 0 or step == args.steps - 1:
            par.print(f"step {step:3d}  loss {par.mean(loss.detach()):.4f}  grad norm {par.last_grad_norm:.3f}")
    state = par.full_state_dict(model)  # consolidated on rank 0: loadable into a plain TinyLM
    if par.is_main:
        TinyLM().load_state_dict(state)
        par.print(f"{par.strategy.describe()}: full state dict of {len(state)} tensors gathered on rank 0")
    par.close()


if __name__ == "__main__":
    main()
