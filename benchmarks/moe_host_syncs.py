"""Host syncs per MoE layer per forward: how often a mixture of experts' forward reads device values on the host
(each read a wait for the GPU on CUDA), in one process and with its experts dispatched as ``ep=`` does.

    .venv/bin/python benchmarks/moe_host_syncs.py
    PYTHONPATH=/path/to/other/checkout/src .venv/bin/python benchmarks/moe_host_syncs.py   # another paratrain

Counted on CPU by :class:`paratrain.testing.host_syncs.HostSyncs` (``.tolist()``, ``.item()``/``bool()``/``int()``
of a tensor, and the operators whose output size CUDA reads on the host: ``nonzero``, ``bincount``, unsized
``repeat_interleave`` ...). The counter is loaded from this checkout by path, so the figures of any paratrain on
``PYTHONPATH`` (an older one without it too) are counted alike. The ``ep`` column dispatches every experts module
over a one-rank gloo group in this process: the same code as over ``ep`` ranks, the same reads.

Models: our GPT with experts and transformers' Mixtral, GPT-OSS and Qwen3-MoE, 2 MoE layers each, tiny; one forward
of 2 x 16 tokens after a warm-up one.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

COUNTER = Path(__file__).resolve().parents[1] / "src" / "paratrain" / "testing" / "host_syncs.py"


def _counter() -> type:
    spec = importlib.util.spec_from_file_location("host_syncs", COUNTER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HostSyncs


def gpt_moe() -> nn.Module:
    from paratrain.planner.moe import MoE
    from paratrain.planner.transformer import GPTConfig
    from paratrain.workloads.gpt import GPT

    return GPT(
        GPTConfig(
            layers=2,
            hidden=64,
            heads=4,
            seq_len=16,
            vocab=128,
            gated=True,
            bias=False,
            tied=False,
            learned_positions=False,
            moe=MoE(experts=8, top_k=2, ffn=64),
        )
    )


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
        )
    )


def gpt_oss() -> nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(
        GptOssConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            layer_types=["full_attention"] * 2,
        )
    )


def qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
        )
    )


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt_moe": gpt_moe,
    "mixtral": mixtral,
    "gpt_oss": gpt_oss,
    "qwen3_moe": qwen3_moe,
}


def reads(model: nn.Module, counter: type) -> tuple[int, Counter]:
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens)  # warm-up: lazy initialisation reads nothing twice
    with counter() as syncs:
        model(tokens)
    return syncs.count, syncs.calls


def main() -> None:
    import paratrain
    from paratrain.distributed.expert_parallel.experts import dispatch_experts, find_experts

    warnings.filterwarnings("ignore")
    counter = _counter()
    print(f"paratrain from {Path(paratrain.__file__).parent}, torch {torch.__version__}")
    print(f"{'model':<10}{'layers':>7}{'one process':>13}{'ep':>6}  per layer (ep), what")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name, build in MODELS.items():
            torch.manual_seed(0)
            model = build()
            alone, _ = reads(model, counter)
            layers = find_experts(model, 1)
            for layer in layers:
                dispatch_experts(layer, dist.group.WORLD)
            ep, calls = reads(model, counter)
            print(f"{name:<10}{len(layers):>7}{alone / len(layers):>13g}{ep / len(layers):>6g}  {dict(calls)}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
