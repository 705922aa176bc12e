"""Mixture-of-experts blocks in closed form: their shape, what they hold and compute, and what they save.

A mixture-of-experts (MoE) block replaces the MLP with a router and E expert MLPs (Shazeer et al. 2017; Fedus et
al. 2022): the router scores each token against every expert, the token goes through its top k, and their outputs
are summed with the router's weights; some models add shared experts that every token goes through (DeepSeekMoE,
Qwen2-MoE). A model holds every expert but a token computes with k of them, so its *total* parameters size the
memory and its *active* ones (total less the experts a token skips) the FLOPs. What expert parallelism does with
them is :mod:`.expert_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class MoE:
    """The mixture-of-experts part of a transformer's shape (``GPTConfig.moe``)."""

    experts: int
    """Routed experts in each MoE block."""
    top_k: int
    """Experts each token goes through (its router's top k)."""
    ffn: int
    """One routed expert's MLP width (transformers' ``moe_intermediate_size``; Mixtral's ``intermediate_size``)."""
    shared: int = 0
    """Width of the shared experts every token also goes through, all of them as one MLP (Qwen2-MoE's
    ``shared_expert_intermediate_size``; DeepSeekMoE's n_shared x its expert width); 0: none."""
    shared_gate: bool = False
    """A sigmoid gate (hidden weights) on the shared experts' output (Qwen2-MoE)."""
    bias: bool = False
    """Biases on the router and the experts' matrices (GPT-OSS)."""
    dense_layers: tuple[int, ...] = ()
    """Blocks (by index) that keep a dense MLP of ``GPTConfig.ffn`` instead (Qwen's ``mlp_only_layers``)."""

    def __post_init__(self) -> None:
        if self.experts < 2 or self.ffn < 1 or self.shared < 0:
            raise ConfigError(
                f"an MoE needs at least 2 experts of width >= 1 (got {self.experts} of {self.ffn}) and "
                f"a shared width >= 0 (got {self.shared})"
            )
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"MoE top_k {self.top_k} must be between 1 and its {self.experts} experts")
        if self.shared_gate and not self.shared:
            raise ConfigError("an MoE's shared_gate gates its shared experts; give their width (shared) too")
        if any(i < 0 for i in self.dense_layers) or len(set(self.dense_layers)) != len(self.dense_layers):
            raise ConfigError(f"MoE dense_layers {self.dense_layers} must be distinct block indices >= 0")


def expert_params(moe: MoE, hidden: int, gated: bool) -> int:
    """One routed expert's parameters: an MLP of ``moe.ffn`` (SwiGLU: gate, up and down), with its biases."""
    inner = (2 if gated else 1) * moe.ffn
    return inner * hidden + moe.ffn * hidden + moe.bias * (inner + hidden)


def mlp_params(moe: MoE, hidden: int, gated: bool, bias: bool) -> tuple[int, int, int]:
    """One MoE block's MLP: (routed experts, router and shared experts, what tensor parallelism splits: nothing).
    The shared experts are a dense MLP (``bias``: the transformer's linear biases); paratrain's tensor parallelism
    runs the whole MoE block on every rank over the gathered sequence (router, shared and routed experts: the
    routed ones go by ep), so none of it is split."""
    inner = (2 if gated else 1) * moe.shared
    shared = inner * hidden + moe.shared * hidden + bias * (inner + hidden)
    router = moe.experts * (hidden + moe.bias)
    return moe.experts * expert_params(moe, hidden, gated), router + shared + hidden * moe.shared_gate, 0


def mlp_tensors(moe: MoE, hidden: int, gated: bool, bias: bool) -> tuple[int, ...]:
    """Sizes of an MoE block's MLP tensors in ``workloads.experts.MixtureOfExperts``' order: the router, each of the
    two expert matrices fused over the experts (one 3-D tensor each, as transformers holds them too: ZeRO-1 hands
    it out whole), their biases, the shared experts' matrices and gate."""
    e, f, inner = moe.experts, moe.ffn, (2 if gated else 1) * moe.ffn
    routed = (e * inner * hidden, e * f * hidden, *(e * inner, e * hidden) * moe.bias)
    s = (2 if gated else 1) * moe.shared
    shared = (hidden * s, *(s,) * bias, moe.shared * hidden, *(hidden,) * bias) if moe.shared else ()
    return (e * hidden, *(e,) * moe.bias, *routed, *shared, *(hidden,) * moe.shared_gate)


def idle_params(moe: MoE, hidden: int, gated: bool) -> int:
    """Parameters of the experts a token skips in one MoE block: what total has and active has not."""
    return (moe.experts - moe.top_k) * expert_params(moe, hidden, gated)


def mlp_activations(moe: MoE, hidden: int, gated: bool, *, act: int) -> float:
    """Bytes one token's pass through an MoE block's MLP saves for backward, besides its input (as
    ``workloads.experts.MixtureOfExperts`` runs it; ``act`` the matrix products' element size, as in
    ``transformer.transformer_activations``), with E experts, top k, expert width f and hidden h:

    - the router: its fp32 softmax (4·E), the top k's indices (8·k) and weights renormalised (4·k, and their
      sum);
    - the dispatch: each token's k rows gathered (act·k·h) and their int64 order (16·k), the expert MLPs' inner
      activations as a dense MLP's (SwiGLU 4·act·f a row, GELU 2), their outputs and those outputs weighted
      (2·act·k·h), and the weights cast to their dtype (act·k);
    - shared experts as a dense MLP of their width (and with a gate, its output and the sigmoid's).
    """
    k, inner = moe.top_k, 4 if gated else 2
    router = 4 * moe.experts + 8 * k + 4 * k + 4
    dispatch = act * k * hidden + 16 * k + act * k * inner * moe.ffn + 2 * act * k * hidden + act * k
    shared = act * inner * moe.shared + (act * (hidden + 1) if moe.shared_gate else 0)
    return float(router + dispatch + shared)


def routed_width(moe: MoE, gated: bool) -> int:
    """Elements a token's k expert MLPs' first matrices output (their inner activations, one tensor as a grouped
    kernel holds them): what backward may hold two gradients of at once."""
    return moe.top_k * (2 if gated else 1) * moe.ffn
