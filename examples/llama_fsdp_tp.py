"""FSDP x tensor parallel on a Llama-shaped model (transformers' LlamaForCausalLM, built from a config): each
layer's weights split over ``--tp`` ranks, and those groups sharded FSDP-style over the rest — torchtitan's
2-D layout, stated once: ``Parallel("zero3", tp=2)``.

    paratrain run -n 4 examples/llama_fsdp_tp.py                  # 2 shard groups x tp=2
    paratrain run -n 2 examples/llama_fsdp_tp.py --strategy tp    # tensor parallel alone
    paratrain run -n 4 examples/llama_fsdp_tp.py --strategy ddp   # DDP x tp=2

Ranks of one tensor-parallel group read the same batch (``par.data_parallel_rank`` names the replica); the loss
runs on logits split over the vocabulary, never gathered whole.
"""

import argparse
import logging

import torch
from torch.nn import functional as F

import paratrain

# test-launch: paratrain run -n 2 --steps 4

VOCAB, SEQ = 256, 32


def build() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )


def loss_fn(out, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="zero3", help="zero3, zero2 or ddp with --tp; or tp alone")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    options = {} if args.strategy == "tp" else {"tp": args.tp}
    par = paratrain.Parallel(args.strategy, precision=args.precision, clip_grad_norm=1.0, seed=0, **options)
    model = build()
    model, optimizer = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    g = torch.Generator().manual_seed(par.data_parallel_rank)  # one stream per replica, shared inside a tp group
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
        tokens[:, 1::2] = tokens[:, 0::2][:, : SEQ // 2]  # a learnable pattern: every odd token repeats its neighbour
        x, y = tokens[:, :-1].to(par.device), tokens[:, 1:].to(par.device)
        with par.step(model, optimizer):
            loss = par.forward_backward(model, x, y, loss_fn)
        if step % 10 == 0 or step == args.steps - 1:
            par.print(f"step {step:3d}  loss {par.mean(loss):.4f}  grad norm {par.last_grad_norm:.3f}")
    state = par.full_state_dict(model)  # consolidated on rank 0: loadable into the plain model
    if par.is_main:
        build().load_state_dict(state)
        par.print(f"{par.strategy.describe()}: full state dict of {len(state)} tensors gathered on rank 0")
    par.close()


if __name__ == "__main__":
    main()
