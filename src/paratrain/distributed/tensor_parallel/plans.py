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
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleOutput

from ...errors import ConfigError
from ...model.structure import find_blocks, outer_modules
from .names import head, spec_of, style


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
    warning: str | None = None
    """One line, warned on every rank: the parts of the blocks an inferred plan leaves whole, and why."""
    heads: frozenset[str] = frozenset()
    """Modules where ``"colwise"`` means the output head, split over the vocabulary (:func:`heads_of`)."""

    def per_module(self, model: nn.Module) -> list[tuple[str, ParallelStyle]]:
        """(module name, style) for every module the plan names, in plan order; a pattern matching no module is a
        mistake (a typo, another model) and raises."""
        names = [n for n, _ in model.named_modules() if n]
        out = []
        for pattern, value in self.styles.items():
            matched = [n for n in names if matches(pattern, n)]
            if not matched:
                raise ConfigError(
                    f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__} "
                    f"(modules are named like {names[min(len(names) - 1, 3)]!r}); fix the pattern"
                )
            out.extend((n, self.style(value, pattern, n)) for n in matched)
        return out

    def style(self, value: str | ParallelStyle, pattern: str, name: str) -> ParallelStyle:
        """The style the entry ``pattern: value`` gives the module ``name``."""
        if not isinstance(value, str):
            if not isinstance(value, ParallelStyle):
                raise ConfigError(
                    f"tp_plan entry {pattern!r}: {value!r} is neither a style name nor a "
                    "torch.distributed.tensor.parallel ParallelStyle"
                )
            return value
        return head() if value.strip() == "colwise" and name in self.heads else style(value)

    def printed(self) -> dict[str, str]:
        """The plan as ``tp_plan=`` takes it: patterns → style names."""
        return {pattern: spec_of(value) for pattern, value in self.styles.items()}


def matches(pattern: str, name: str) -> bool:
    """``name`` is matched by ``pattern`` part by part, ``*`` standing for one part."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatchcase(b, a) for a, b in zip(p, n))


def sequence_shards() -> ParallelStyle:
    """The first block's input (of the model, or of a pipeline stage): replicated → this rank's slice of the
    sequence."""
    return style("split_sequence")


def whole_sequence() -> ParallelStyle:
    """A pipeline stage's last block's output: the sequence slices all-gathered into a plain tensor."""
    return PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True)


def heads_of(model: nn.Module, styles: Mapping[str, str | ParallelStyle]) -> frozenset[str]:
    """The modules of ``model`` where a plan's ``"colwise"`` is the output head: those after its repeated blocks
    (the final norm's neighbours), or in a model without blocks the ones a ``colwise`` entry names with no
    ``rowwise`` entry after it (its output is the model's, not the input of a row split)."""
    names = [n for n, _ in model.named_modules() if n]
    blocks = find_blocks(model)
    if blocks is not None:
        after = outer_modules(model, blocks)[1]
        return frozenset(n for n in names if any(n == a or n.startswith(f"{a}.") for a in after))
    values = list(styles.items())
    last_row = max((i for i, (_, v) in enumerate(values) if isinstance(v, str) and v.startswith("rowwise")), default=-1)
    return frozenset(
        n for i, (p, v) in enumerate(values) if i > last_row and v == "colwise" for n in names if matches(p, n)
    )


def gpt2_plan() -> TPPlan:
    """transformers' ``GPT2LMHeadModel``: fused ``c_attn`` (``[q | k | v]``), ``Conv1D`` layers, tied head."""
    block = "transformer.h.*"

    def adjust(model: nn.Module, degree: int) -> None:
        for module in model.modules():
            if type(module).__name__ == "GPT2Attention":
                module.split_size = module.embed_dim // degree  # its c_attn output is now this rank's q, k, v

    return TPPlan(
        name="GPT-2",
        sequence_parallel=True,
        adjust=adjust,
        styles={
            "transformer.wte": style("rowwise"),
            "transformer.wpe": style("replicate"),
            "transformer.drop": style("split_sequence"),
            f"{block}.ln_1": style("sequence_parallel"),
            f"{block}.attn": style("gather_sequence"),
            f"{block}.attn.c_attn": style("fused_colwise(3)"),
            f"{block}.attn.c_proj": style("rowwise(output=sequence)"),
            f"{block}.ln_2": style("sequence_parallel"),
            f"{block}.mlp": style("gather_sequence"),
            f"{block}.mlp.c_fc": style("colwise"),
            f"{block}.mlp.c_proj": style("rowwise(output=sequence)"),
            "transformer.ln_f": style("sequence_parallel"),
            "lm_head": head(),
        },
        divisible=lambda model: {
            "n_head": model.config.n_head,
            "n_inner": model.config.n_inner or 4 * model.config.n_embd,
        },
    )


def llama_plan() -> TPPlan:
    """transformers' ``LlamaForCausalLM`` (grouped-query attention: key/value heads split too)."""
    layer = "model.layers.*"
    return TPPlan(
        name="Llama",
        sequence_parallel=True,
        styles={
            "model.embed_tokens": style("rowwise"),
            "model.layers.0": style("split_sequence"),
            f"{layer}.input_layernorm": style("sequence_parallel"),
            f"{layer}.self_attn": style("gather_sequence(hidden_states)"),
            f"{layer}.self_attn.q_proj": style("colwise"),
            f"{layer}.self_attn.k_proj": style("colwise"),
            f"{layer}.self_attn.v_proj": style("colwise"),
            f"{layer}.self_attn.o_proj": style("rowwise(output=sequence)"),
            f"{layer}.post_attention_layernorm": style("sequence_parallel"),
            f"{layer}.mlp": style("gather_sequence"),
            f"{layer}.mlp.gate_proj": style("colwise"),
            f"{layer}.mlp.up_proj": style("colwise"),
            f"{layer}.mlp.down_proj": style("rowwise(output=sequence)"),
            "model.norm": style("sequence_parallel"),
            "lm_head": head(),
        },
        divisible=lambda model: {
            "num_attention_heads": model.config.num_attention_heads,
            "num_key_value_heads": model.config.num_key_value_heads,
            "intermediate_size": model.config.intermediate_size,
        },
    )


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
            raise ConfigError(
                "tp_plan must be 'auto' or a non-empty dict of module-name patterns to styles, e.g. "
                "{'layers.*.mlp.up': 'colwise', 'layers.*.mlp.down': 'rowwise'}"
            )
        return TPPlan(name="tp_plan", styles=dict(user), heads=heads_of(model, user))
    own = getattr(model, "paratrain_tp_plan", None)
    if callable(own):
        return own()
    kind = type(model).__name__
    build = _BUILT_IN.get(kind)
    if build is None:
        raise ConfigError(
            f"tensor parallelism has no plan for {kind} (built in: GPT-2, Llama, paratrain's GPT); "
            "infer one (tp_plan='auto') or give one: Parallel('tp', tp_plan={'layers.*.mlp.up': "
            "'colwise', 'layers.*.mlp.down': 'rowwise', ...})"
        )
    return build(model)
