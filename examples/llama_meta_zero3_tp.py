"""A model larger than one host's memory, the way it is started: built on the meta device (no memory), laid out as
zero3 x tensor parallel, each rank allocating only its shard, and a safetensors checkpoint read straight into the
shards (each rank reads only its slices). See docs/large-models.md.

    paratrain run -n 4 examples/llama_meta_zero3_tp.py                         # 2 shard groups x tp=2
    paratrain run -n 4 examples/llama_meta_zero3_tp.py --weights ./my-llama    # a save_pretrained folder of yours
    paratrain dry-run --world 128 --strategy zero3 --tp 8 --model-config ./my-llama   # before you launch

Without ``--weights`` rank 0 first writes a small random Llama checkpoint with transformers' ``save_pretrained``
(sharded safetensors and their index), standing in for a downloaded one.
"""

import argparse
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch.nn import functional as F

import paratrain

# test-launch: paratrain run -n 2 --steps 4

VOCAB, SEQ = 256, 32


def config():
    from transformers import LlamaConfig

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return LlamaConfig(
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


def loss_fn(out, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def main() -> None:
    from transformers import LlamaForCausalLM

    p = argparse.ArgumentParser()
    p.add_argument("--weights", help="a safetensors file or save_pretrained folder (default: write a random one)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    # init_fn="empty": allocate the shards without initializing them, since the checkpoint fills them next
    par = paratrain.Parallel(
        "zero3", tp=args.tp, clip_grad_norm=1.0, seed=0, model=paratrain.ModelConfig(init_fn="empty")
    )
    weights = args.weights or str(Path(tempfile.gettempdir()) / f"paratrain-llama-{os.environ.get('MASTER_PORT')}")
    if args.weights is None and par.is_main:
        LlamaForCausalLM(config()).save_pretrained(weights, max_shard_size="100KB")
    par.barrier()

    with torch.device("meta"):
        model = LlamaForCausalLM(config())  # shapes only: nothing allocated
    model, optimizer = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    read = par.load_weights(model, weights)
    par.print(
        f"loaded {read['tensors']} tensors from {read['files']} file(s); rank 0 read {read['bytes_read']:,} bytes"
    )

    g = torch.Generator().manual_seed(par.data_parallel_rank)  # one stream per replica, shared inside a tp group
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
        tokens[:, 1::2] = tokens[:, 0::2][:, : SEQ // 2]  # a learnable pattern: every odd token repeats its neighbour
        x, y = tokens[:, :-1].to(par.device), tokens[:, 1:].to(par.device)
        with par.step(model, optimizer):
            loss = par.forward_backward(model, x, y, loss_fn)
        if step % 10 == 0 or step == args.steps - 1:
            par.print(f"step {step:3d}  loss {par.mean(loss):.4f}  grad norm {par.last_grad_norm:.3f}")
    par.close()


if __name__ == "__main__":
    main()
