"""Tensor-parallel plans: which module of a model is split how, as module-name patterns → styles.

Built in for transformers' GPT-2 and Llama causal LMs; a model class may carry its own (a ``paratrain_tp_plan()``
method, as our GPT in :mod:`paratrain.workloads.gpt` does). All follow one pattern (Megatron's, torchtitan's
``apply_tp``):

* the token embedding is split over the vocabulary (``rowwise`` of an embedding: each rank looks up its rows,
  the sum is all-reduced); the output head over the vocabulary too (``colwise``), its logits left sharded so the
  loss runs without gathering them; a tied embedding and head are one weight with one sharding, ``Shard(0)``;
* attention's query/key/value projections column-split (each rank computes its heads), its output projection
  row-split; the MLP's up projections column-split, its down projection row-split;
* sequence parallel between the blocks' halves: the residual stream, the norms and dropout hold a slice of the
  sequence (``Shard(1)``); it is all-gathered before attention and the MLP and reduce-scattered after them;
* everything else (GPT-2's position table) replicated.

A pattern matches a module's qualified name part by part, ``*`` standing for one part (``layers.*.mlp``). A user
plan replaces the built-in one; parameters it does not split are replicated. A model with no plan gets one
inferred from its blocks (``tp_plan="auto"``, :mod:`.infer`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput,
                                               PrepareModuleOutput, SequenceParallel)

from ...errors import ConfigError
from .styles import Colwise, FirstInput, FusedColwise, Replicated, Rowwise, style_of


@dataclass(frozen=True)
class TPPlan:
    """A model's tensor-parallel plan."""

    name: str
    """What it is for (said in messages)."""
    styles: Mapping[str, str | ParallelStyle]
    """Module-name patterns → styles, applied in order (a parent's input preparation before its children)."""
    sequence_parallel: bool = False
    """The plan shards activations over the sequence (dimension 1), which must then divide by the degree."""
    divisible: Callable[[nn.Module], dict[str, int]] = field(default=lambda model: {})
    """Sizes (heads, widths) that must divide by the degree, by name."""
    adjust: Callable[[nn.Module, int], None] = field(default=lambda model, degree: None)
    """Changes to the model's own bookkeeping once split (GPT-2's attention splits its output by width)."""
    summary: tuple[str, ...] = ()
    """What an inferred plan splits and leaves whole, as lines printed once on rank 0 (``tp_plan="auto"``)."""

    def resolve(self, model: nn.Module) -> list[tuple[str, ParallelStyle]]:
        """(module name, style) for every module the plan names, in plan order; a pattern matching no module is a
        mistake (a typo, another model) and raises."""
        names = [n for n, _ in model.named_modules() if n]
        out = []
        for pattern, value in self.styles.items():
            matched = [n for n in names if matches(pattern, n)]
            if not matched:
                raise ConfigError(f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__} "
                                  f"(modules are named like {names[min(len(names) - 1, 3)]!r}); fix the pattern")
            out.extend((n, style_of(value, pattern)) for n in matched)
        return out


def matches(pattern: str, name: str) -> bool:
    """``name`` is matched by ``pattern`` part by part, ``*`` standing for one part."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatchcase(b, a) for a, b in zip(p, n))


def sequence_shards() -> ParallelStyle:
    """The first block's input (of the model, or of a pipeline stage): replicated → this rank's slice of the
    sequence."""
    return FirstInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)


def whole_sequence() -> ParallelStyle:
    """A pipeline stage's last block's output: the sequence slices all-gathered into a plain tensor."""
    return PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
                               use_local_output=True)


def gathered(kwarg: str | None = None) -> ParallelStyle:
    """Attention's or the MLP's input: the sequence slices all-gathered."""
    if kwarg is None:
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True)
    return PrepareModuleInput(input_kwarg_layouts={kwarg: Shard(1)}, desired_input_kwarg_layouts={kwarg: Replicate()},
                              use_local_output=True)


def vocab_embedding() -> ParallelStyle:
    return Rowwise(input_layouts=Replicate(), output_layouts=Replicate())


def vocab_head() -> ParallelStyle:
    return Colwise(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)


def final_norm() -> ParallelStyle:
    # left a DTensor: GPT-2 reshapes it by the full sequence length before the head
    return SequenceParallel(use_local_output=False)


def gpt2_plan() -> TPPlan:
    """transformers' ``GPT2LMHeadModel``: fused ``c_attn`` (``[q | k | v]``), ``Conv1D`` layers, tied head."""
    block = "transformer.h.*"

    def adjust(model: nn.Module, degree: int) -> None:
        for module in model.modules():
            if type(module).__name__ == "GPT2Attention":
                module.split_size = module.embed_dim // degree  # its c_attn output is now this rank's q, k, v

    return TPPlan(name="GPT-2", sequence_parallel=True, adjust=adjust, styles={
        "transformer.wte": vocab_embedding(),
        "transformer.wpe": Replicated(),
        "transformer.drop": PrepareModuleInputOutput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=True),
        f"{block}.ln_1": SequenceParallel(),
        f"{block}.attn": gathered(),
        f"{block}.attn.c_attn": FusedColwise(3),
        f"{block}.attn.c_proj": Rowwise(output_layouts=Shard(1)),
        f"{block}.ln_2": SequenceParallel(),
        f"{block}.mlp": gathered(),
        f"{block}.mlp.c_fc": Colwise(),
        f"{block}.mlp.c_proj": Rowwise(output_layouts=Shard(1)),
        "transformer.ln_f": final_norm(),
        "lm_head": vocab_head(),
    }, divisible=lambda model: {"n_head": model.config.n_head, "n_inner": model.config.n_inner or
                                4 * model.config.n_embd})


def llama_plan() -> TPPlan:
    """transformers' ``LlamaForCausalLM`` (grouped-query attention: key/value heads split too)."""
    layer = "model.layers.*"
    return TPPlan(name="Llama", sequence_parallel=True, styles={
        "model.embed_tokens": vocab_embedding(),
        "model.layers.0": sequence_shards(),
        f"{layer}.input_layernorm": SequenceParallel(),
        f"{layer}.self_attn": gathered("hidden_states"),
        f"{layer}.self_attn.q_proj": Colwise(),
        f"{layer}.self_attn.k_proj": Colwise(),
        f"{layer}.self_attn.v_proj": Colwise(),
        f"{layer}.self_attn.o_proj": Rowwise(output_layouts=Shard(1)),
        f"{layer}.post_attention_layernorm": SequenceParallel(),
        f"{layer}.mlp": gathered(),
        f"{layer}.mlp.gate_proj": Colwise(),
        f"{layer}.mlp.up_proj": Colwise(),
        f"{layer}.mlp.down_proj": Rowwise(output_layouts=Shard(1)),
        "model.norm": final_norm(),
        "lm_head": vocab_head(),
    }, divisible=lambda model: {"num_attention_heads": model.config.num_attention_heads,
                                "num_key_value_heads": model.config.num_key_value_heads,
                                "intermediate_size": model.config.intermediate_size})


_BUILT_IN: dict[str, Callable[[nn.Module], TPPlan]] = {
    "GPT2LMHeadModel": lambda model: gpt2_plan(),
    "LlamaForCausalLM": lambda model: llama_plan(),
}


def has_plan(model: nn.Module) -> bool:
    """Whether ``model`` carries a plan of its own or has a built-in one."""
    return callable(getattr(model, "paratrain_tp_plan", None)) or type(model).__name__ in _BUILT_IN


def plan_for(model: nn.Module, user: Mapping[str, str | ParallelStyle] | None) -> TPPlan:
    """The user's plan when given, else the model's own (a ``paratrain_tp_plan()`` method returning a ``TPPlan``, as
    paratrain's GPT has), else the built-in one for ``model``'s class; a one-line error when none (the runtime
    infers one then: :func:`~paratrain.distributed.tensor_parallel.infer.choose_plan`)."""
    if user is not None:
        if not isinstance(user, Mapping) or not user:
            raise ConfigError("tp_plan must be 'auto' or a non-empty dict of module-name patterns to styles, e.g. "
                              "{'layers.*.mlp.up': 'colwise', 'layers.*.mlp.down': 'rowwise'}")
        return TPPlan(name="tp_plan", styles=dict(user))
    own = getattr(model, "paratrain_tp_plan", None)
    if callable(own):
        return own()
    kind = type(model).__name__
    build = _BUILT_IN.get(kind)
    if build is None:
        raise ConfigError(f"tensor parallelism has no plan for {kind} (built in: GPT-2, Llama, paratrain's GPT); "
                          "infer one (tp_plan='auto') or give one: Parallel('tp', tp_plan={'layers.*.mlp.up': "
                          "'colwise', 'layers.*.mlp.down': 'rowwise', ...})")
    return build(model)
