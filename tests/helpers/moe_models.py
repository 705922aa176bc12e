"""Tiny transformers mixtures of experts built from their configs (nothing downloaded), for ``paratrain plan
--model helpers.moe_models:mixtral`` and the dry run: 8 experts of top 2, and Qwen3-MoE's query/key norms, widened
heads and a dense block."""

from __future__ import annotations

from torch import nn

MIXTRAL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
)
QWEN3_MOE = dict(
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=1024,
    num_experts=16,
    num_experts_per_tok=4,
    mlp_only_layers=[0],
    max_position_embeddings=512,
)


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
    return MixtralForCausalLM(
        MixtralConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
            num_local_experts=experts,
            num_experts_per_tok=2,
            max_position_embeddings=16,
            tie_word_embeddings=False,
        )
    )


# The zoo's mixtures of experts (tests/helpers/zoo.py ``MOE_ZOO``): the zoo's sizes (vocabulary 65, 8 tokens, width
# 32, 2 blocks), 4 experts of top 2, the same initial weights on every call.
_TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 65,
    "max_position_embeddings": 8,
    "num_experts_per_tok": 2,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


def _built(model_class: type, config: object) -> nn.Module:
    import logging

    import torch

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    return model_class(config)


def tiny_mixtral(aux_loss: float = 0.0) -> nn.Module:
    """``aux_loss``: the router's load-balancing loss, weighted so, added to ``labels=``'s loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        **_TINY,
        intermediate_size=48,
        num_local_experts=4,
        tie_word_embeddings=False,
        output_router_logits=aux_loss > 0,
        router_aux_loss_coef=aux_loss,
    )
    return _built(MixtralForCausalLM, config)


def tiny_qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **_TINY,
        intermediate_size=64,
        moe_intermediate_size=16,
        head_dim=8,
        num_experts=4,
        mlp_only_layers=[0],
        tie_word_embeddings=False,
    )
    return _built(Qwen3MoeForCausalLM, config)


def tiny_qwen2_moe() -> nn.Module:
    """With Qwen2-MoE's shared expert and its sigmoid gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        **_TINY,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        shared_expert_intermediate_size=24,
        tie_word_embeddings=False,
    )
    return _built(Qwen2MoeForCausalLM, config)


def tiny_gpt_oss() -> nn.Module:
    """Biases on the router and the experts; attention sinks, which only the eager attention has on the CPU."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **_TINY,
        intermediate_size=16,
        head_dim=8,
        num_local_experts=4,
        sliding_window=4,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )
    config._attn_implementation = "eager"
    return _built(GptOssForCausalLM, config)


def tiny_olmoe(aux_loss: float = 0.0) -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        **_TINY,
        intermediate_size=16,
        num_experts=4,
        tie_word_embeddings=False,
        output_router_logits=aux_loss > 0,
        router_aux_loss_coef=aux_loss,
    )
    return _built(OlmoeForCausalLM, config)


def tiny_gpt_experts() -> nn.Module:
    """paratrain's own GPT with mixture-of-experts blocks and a shared expert."""
    import torch

    from paratrain.planner.moe import MoE
    from paratrain.workloads.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(layers=2, hidden=32, heads=2, seq_len=8, vocab=65, moe=MoE(experts=4, top_k=2, ffn=16, shared=16))
    )
