"""The ways one transformer block's attention and MLP may split over tp ranks, best first, or why there are none:
what :mod:`.infer` tries on one process (:mod:`.probe`) before it keeps a split.

Attention's query/key/value projections are known by their usual names (separate, or one fused projection) and
checked by their shapes; attention without such names is the module around an attention kernel's call
(:func:`.probe.attention_owners`: DeepSeek-V3's latent attention, whose latent projection stays whole and the layers
it feeds split with the heads). The MLP is a down projection and the up (and gate) projections that feed it.
"""

from __future__ import annotations

from itertools import combinations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ...errors import ConfigError
from .probe import Split, attention_owners, dims

QUERY = {"q_proj", "q", "query", "wq", "to_q", "q_lin", "query_proj"}
KEY = {"k_proj", "k", "key", "wk", "to_k", "k_lin", "key_proj"}
VALUE = {"v_proj", "v", "value", "wv", "to_v", "v_lin", "value_proj"}
FUSED = {"c_attn", "qkv", "qkv_proj", "wqkv", "query_key_value", "to_qkv", "att_proj", "in_proj", "attn_proj"}
OUTPUT = {
    "o_proj",
    "out_proj",
    "c_proj",
    "proj",
    "dense",
    "wo",
    "o",
    "out",
    "to_out",
    "out_lin",
    "attn_out",
    "output",
    "proj_out",
}
HEADS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "nheads")
KV_HEADS = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads")
NO_MLP = "no up and down projections recognised"
_TRIED = 8
"""At most this many splits of an attention found by what it does are tried."""
WIDTHS = ("n_embd", "embed_dim", "hidden_size", "all_head_size", "split_size", "inner_dim", "d_model", "dim")


def layer_names(split: Split) -> str:
    """The layers a split divides, for messages."""
    return ", ".join([*split.columns, *split.rows])


def _child(layers: dict[str, nn.Module], owner: str, role: set[str]) -> str | None:
    """The first layer directly under ``owner`` whose own name has ``role``."""
    return next((n for n in layers if n.rpartition(".")[0] == owner and n.rpartition(".")[2].lower() in role), None)


def attention_splits(
    block: nn.Module,
    layers: dict[str, nn.Module],
    degree: int,
    where: str,
    sizes: dict[str, int],
    call: tuple[tuple, dict] | str,
) -> list[Split] | str:
    """The ways attention's layers may split, best first, or why there are none; a one-line error when its heads
    do not divide by ``degree``. Query/key/value projections are known by their usual names; without them,
    attention is the module around an attention kernel's call (:func:`.probe.attention_owners`)."""
    for owner in dict.fromkeys(n.rpartition(".")[0] for n in layers):
        q, k, v = (_child(layers, owner, role) for role in (QUERY, KEY, VALUE))
        fused = _child(layers, owner, FUSED)
        if q and k and v:
            columns = [{q: 1, k: 1, v: 1}]
            widths = dims(layers[q])[1], dims(layers[k])[1]  # type: ignore[index]
            break
        if fused and dims(layers[fused])[1] % 3 == 0:  # type: ignore[index]
            columns = [{fused: 3}, {fused: 1}]  # [q | k | v] side by side, or laid out per head
            widths = (dims(layers[fused])[1] // 3,) * 2  # type: ignore[index]
            break
    else:
        return _latent_attention(block, layers, degree, where, sizes, call)
    out = _output(layers, owner, set(columns[0]), widths[0])
    if out is None:
        return f"no output projection taking {widths[0]} features next to {', '.join(columns[0])}"
    module = block.get_submodule(owner)
    adjust = _heads(module, owner, degree, where, sizes, widths)
    if any(w % degree for w in widths):
        return f"its widths {widths} do not split over tp={degree}"
    heads, summed = _per_head(module, owner, {*columns[0], out})
    return [
        Split(columns=c, rows=(out,), adjust=a, heads=heads, summed=summed)
        for c in columns
        for a in dict.fromkeys((adjust, ()))
    ]


def _heads(
    module: nn.Module, owner: str, degree: int, where: str, sizes: dict[str, int], widths: tuple[int, ...]
) -> tuple[tuple[str, str], ...]:
    """The head counts and widths attention keeps (to divide by ``degree`` on every rank); a one-line error when
    its heads do not divide by ``degree``."""
    at = f"{where}.{owner}" if owner else where
    for attrs in (HEADS, KV_HEADS):
        attr, count = _count(module, attrs)
        if count is not None:
            if count % degree:
                raise ConfigError(
                    f"tp_plan='auto': {at} has {attr}={count} heads, which do not split over "
                    f"tp={degree}; choose a tp that divides {count}"
                )
            sizes[f"{at}.{attr}"] = count
    return tuple((owner, a) for a in (*HEADS, *KV_HEADS) if int_attribute(module, a) is not None) + tuple(
        (owner, a) for a in WIDTHS if int_attribute(module, a) in widths
    )


def _latent_attention(
    block: nn.Module,
    layers: dict[str, nn.Module],
    degree: int,
    where: str,
    sizes: dict[str, int],
    call: tuple[tuple, dict] | str,
) -> list[Split] | str:
    """Attention found by what it does: the innermost module around an attention kernel's call that holds linear
    layers, its output projection the one giving the block's width back. Its other layers are column-split, but
    for those left whole as a latent every rank's heads read (DeepSeek-V3's ``wkv_a``: its output's gradient summed
    over the ranks, the layers it feeds split with the heads); the splits, fewest layers left whole first, are
    the probe's to try."""
    unknown = "no query/key/value projections recognised"
    if isinstance(call, str):
        return f"{unknown} ({call})"
    owner = next((o for o in attention_owners(block, *call) if len(_direct(layers, o)) >= 2), None)
    if owner is None:
        return f"{unknown}, and no attention kernel called next to linear layers"
    direct = _direct(layers, owner)
    hidden = _width(call)
    outs = [n for n in direct if dims(layers[n])[1] == hidden]  # type: ignore[index]
    out = next((n for n in outs if n.rpartition(".")[2].lower() in OUTPUT), outs[0] if len(outs) == 1 else None)
    if out is None:
        return f"{unknown}; {where}.{owner} calls attention but has no one output projection to {hidden} features"
    rest = [n for n in direct if n != out]
    reads = [n for n in rest if dims(layers[n])[0] == hidden]  # type: ignore[index]
    module = block.get_submodule(owner)
    widths = tuple(dims(layers[n])[1] for n in rest) + (dims(layers[out])[0],)  # type: ignore[index]
    adjust = _heads(module, owner, degree, where, sizes, widths)
    splits = []
    for kept in (c for k in range(len(reads) + 1) for c in combinations(reads, k)):
        split = [n for n in rest if n not in kept]
        fed = tuple(n for n in split if n not in reads)
        if (fed and not kept) or any(dims(layers[n])[1] % degree for n in split):  # type: ignore[index]
            continue
        heads, summed = _per_head(module, owner, {*split, *kept, out})
        splits.append(
            Split(
                columns={n: 1 for n in split if n in reads},
                rows=(out,),
                adjust=adjust,
                heads=heads + fed,
                summed=summed,
                latent=kept,
            )
        )
    if dims(layers[out])[0] % degree or not splits:  # type: ignore[index]
        return f"{where}.{owner}'s projections do not split over tp={degree}"
    return splits[:_TRIED]


def _direct(layers: dict[str, nn.Module], owner: str) -> list[str]:
    """The layers directly under ``owner``."""
    return [n for n in layers if n.rpartition(".")[0] == owner]


def _width(call: tuple[tuple, dict]) -> int | None:
    """The block's width: the last dimension of the first floating-point tensor it is called with."""
    tensors = [t for t in tree_flatten(call)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return tensors[0].shape[-1] if tensors else None


def _per_head(module: nn.Module, owner: str, split: set[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What else of a split attention module sees only this rank's heads: the module itself when its own
    parameters are indexed by head (GPT-OSS's sinks: split with the heads), and the modules under it that hold
    parameters and are not split (Qwen3's per-head query/key norms: whole, their gradients summed)."""
    if not owner:
        return (), ()
    _, count = _count(module, HEADS)
    own = list(module.parameters(recurse=False))
    heads = (owner,) if own and all(p.dim() and p.shape[0] == count for p in own) else ()
    prefix = f"{owner}." if owner else ""
    summed = tuple(
        f"{prefix}{n}"
        for n, m in module.named_modules()
        if n
        and f"{prefix}{n}" not in split
        and not any(f"{prefix}{n}".startswith(f"{s}.") for s in split)
        and any(True for _ in m.parameters(recurse=False))
    )
    return heads, summed


def _output(layers: dict[str, nn.Module], owner: str, columns: set[str], width: int) -> str | None:
    """Attention's output projection: beside the q/k/v layers, or else beside the module holding them (BERT's
    ``attention.output.dense`` next to ``attention.self``)."""

    def takes(n: str) -> bool:
        return n not in columns and n.rpartition(".")[2].lower() in OUTPUT and dims(layers[n])[0] == width  # type: ignore

    found = next((n for n in layers if n.rpartition(".")[0] == owner and takes(n)), None)
    if found is None and owner:
        up = owner.rpartition(".")[0]
        found = next(
            (n for n in layers if (not up or n.startswith(f"{up}.")) and not n.startswith(f"{owner}.") and takes(n)),
            None,
        )
    return found


def int_attribute(module: nn.Module, attr: str) -> int | None:
    """``module.attr`` when it is an int (a head count or width an attention module keeps), else None."""
    value = getattr(module, attr, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _count(module: nn.Module, attrs: tuple[str, ...]) -> tuple[str, int | None]:
    """A head count the module keeps, or its transformers config says."""
    for owner in (module, getattr(module, "config", None)):
        for attr in attrs:
            if owner is not None and (value := int_attribute(owner, attr)) is not None:
                return attr, value
    return "", None


def mlp_splits(layers: dict[str, nn.Module], hidden: int | None, degree: int) -> list[Split] | str:
    """The MLP's splits, best first, or why there are none: a down projection ``F -> hidden`` and the layers that
    feed it, ``hidden -> F`` (up, gate) or one ``hidden -> 2F`` (gate and up fused); with ``hidden`` unknown (no
    attention recognised), the layers feeding it are among those defined before it."""
    names = list(layers)
    for i, (down, layer) in enumerate(layers.items()):
        width, h = dims(layer)  # type: ignore[misc]
        if width == h or (hidden is not None and h != hidden):
            continue
        # without attention's width to tell up from down, the up projections are the ones defined first
        feeding = names if hidden is not None else names[:i]
        ups = [n for n in feeding if n != down and dims(layers[n]) in ((h, width), (h, 2 * width))]
        fused = [n for n in ups if dims(layers[n])[1] == 2 * width]  # type: ignore[index]
        if not ups or len(ups) > 2 or (fused and len(ups) > 1):
            continue
        if width % degree:
            return f"its width {width} does not split over tp={degree}"
        if fused:
            return [Split(columns={fused[0]: 2}, rows=(down,)), Split(columns={fused[0]: 1}, rows=(down,))]
        return [Split(columns=dict.fromkeys(ups, 1), rows=(down,))]
    return NO_MLP
