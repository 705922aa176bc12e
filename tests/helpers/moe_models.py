"""Tiny transformers mixtures of experts built from their configs (nothing downloaded), for ``paratrain plan
--model helpers.moe_models:mixtral`` and the dry run: 8 experts of top 2, and Qwen3-MoE's query/key norms, widened
heads and a dense block."""
from __future__ import annotations

from torch import nn

MIXTRAL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4, vocab_size=1024, num_local_experts=8, num_experts_per_tok=2,
               max_position_embeddings=512)
QWEN3_MOE = dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1024, num_experts=16,
                 num_experts_per_tok=4, mlp_only_layers=[0], max_position_embeddings=512)


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**MIXTRAL))


def qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE))


def routed_mixtral(experts: int = 4) -> nn.Module:
    """A Mixtral small enough to train in a test many times over (2 blocks of ``experts`` experts, top 2, width 32,
    vocabulary 64), the same weights on every call: what the monitor's tokens-per-expert tests route."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                            num_local_experts=experts, num_experts_per_tok=2,
                                            max_position_embeddings=16, tie_word_embeddings=False))
