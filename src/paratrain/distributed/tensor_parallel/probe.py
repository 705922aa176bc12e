"""Checking an inferred split on one process, before any rank applies it (``tp_plan="auto"``, :mod:`.infer`).

Names and shapes only suggest which layer is a query or an output projection; whether a block still computes the
same thing once split depends on its forward, which may reshape by an attribute paratrain did not adjust or by the
width of its input (nanoGPT's ``C // n_head``) and then run silently wrong or fail. So every proposed split is
tried: the model runs on a few token ids until its first block is called (those are the block's real arguments:
masks, rotary angles), and that block is run as each tensor-parallel rank would run it — its split layers cut to
the rank's slices, its bookkeeping adjusted — with the all-reduce after each row-split layer emulated by summing
the ranks' partial outputs. A split is kept only when every rank's output equals the unsplit block's; one that keeps
a latent whole (a layer whose output every rank's heads read) is also run backward, and kept only when every rank's
gradients equal the unsplit block's too (:func:`_gradients`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .styles import is_conv1d

_TOKENS = 4


@dataclass(frozen=True)
class Split:
    """Layers of one block (names relative to it) and how each is split."""

    columns: dict[str, int]
    """Column-split layers → how many equal blocks their output holds side by side (1: a plain split)."""
    rows: tuple[str, ...]
    """Row-split layers (their outputs all-reduced)."""
    adjust: tuple[tuple[str, str], ...] = ()
    """(module, attribute): counts and widths the block's code reads, divided by the degree on every rank."""
    heads: tuple[str, ...] = ()
    """Modules whose own parameters are indexed by head along dimension 0 (attention sinks): split with the heads."""
    summed: tuple[str, ...] = ()
    """Modules left whole that see this rank's heads only (per-head norms): their gradients summed over the ranks."""
    latent: tuple[str, ...] = ()
    """Layers left whole whose output every rank's heads read (DeepSeek-V3's ``wkv_a``): the gradient of their output
    summed over the ranks."""

    def __add__(self, other: Split) -> Split:
        return Split(
            columns={**self.columns, **other.columns},
            rows=self.rows + other.rows,
            adjust=self.adjust + other.adjust,
            heads=self.heads + other.heads,
            summed=self.summed + other.summed,
            latent=self.latent + other.latent,
        )

    def layers(self) -> set[str]:
        """Every layer the split names."""
        return {*self.columns, *self.rows, *self.heads, *self.latent}


def dims(layer: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of an ``nn.Linear`` or transformers' ``Conv1D``; None for anything else."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if is_conv1d(layer):
        return layer.weight.shape[0], layer.nf
    return None


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode without gradients (no dropout, no statistics updated), its modes restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes:
            m.training = mode


class _Called(Exception):
    pass


def block_call(model: nn.Module, block: nn.Module, vocab: int) -> tuple[tuple, dict] | str:
    """The arguments ``block`` gets when ``model`` runs on a few token ids below ``vocab`` (the model stops there),
    or why they could not be had. Caches are left out, so the block can be run again and again."""
    weight = next(model.parameters())
    if weight.is_meta:
        return "the model is on the meta device"
    seen: list[tuple[tuple, dict]] = []

    def stop(_: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((tuple(_no_cache(a) for a in args), {k: _no_cache(v) for k, v in kwargs.items()}))
        raise _Called

    ids = torch.randint(0, vocab, (1, _TOKENS), generator=torch.Generator().manual_seed(0)).to(weight.device)
    handle = block.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        model(ids)
    except _Called:
        pass
    except Exception as err:  # any model: whatever its forward raises on plain token ids
        return f"a forward on token ids failed ({type(err).__name__}: {str(err).splitlines()[0][:80]})"
    finally:
        handle.remove()
    if not seen:
        return "a forward on token ids never reached the blocks"
    args, kwargs = seen[0]
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def attention_owners(block: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """The modules of ``block`` (names relative to it) inside which an attention kernel runs when it is called with
    ``args``, ``kwargs``: scaled-dot-product or flex attention, or a softmax over scores of four dimensions (eager
    attention's ``[batch, heads, query, key]``; a router's softmax has two), innermost module first, outermost last,
    for each call; empty when the block's forward fails."""
    active: list[str] = []
    calls: list[list[str]] = []

    def enter(name: str) -> Callable[..., None]:
        return lambda *_: active.append(name)

    def leave(*_: Any) -> None:
        active.pop()

    class Kernels(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, a: tuple = (), kw: dict | None = None) -> Any:
            name = getattr(func, "__name__", "")
            four_d = bool(a) and isinstance(a[0], torch.Tensor) and a[0].dim() >= 4
            if name in ("scaled_dot_product_attention", "flex_attention") or (name == "softmax" and four_d):
                calls.append(active[::-1])
            return func(*a, **(kw or {}))

    modules = list(block.named_modules())
    handles = [m.register_forward_pre_hook(enter(n)) for n, m in modules]
    handles += [m.register_forward_hook(leave, always_call=True) for _, m in modules]
    try:
        with Kernels():
            block(*args, **kwargs)
    except Exception:  # noqa: BLE001 - any model: a block that cannot run has no attention found this way
        return []
    finally:
        for handle in handles:
            handle.remove()
    return [name for call in calls for name in call]


def token_readers(model: nn.Module, embeddings: dict[str, nn.Embedding], stop_at: nn.Module | None) -> set[str] | None:
    """The names of ``embeddings`` that look up the model's own input when it runs on a few token ids (the token
    embedding, BERT's word and token-type tables fed zeros aside: ids are chosen unlike positions and zeros), or
    None when the model cannot be run so (on meta, or its forward fails before ``stop_at``, its first block)."""
    if not embeddings or next(model.parameters()).is_meta:
        return None
    smallest = min(m.num_embeddings for m in embeddings.values())
    ids = ((torch.arange(_TOKENS) * 7 + 3) % smallest).unsqueeze(0).to(next(model.parameters()).device)
    fed: set[str] = set()

    def record(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple) -> None:
            if (
                args
                and isinstance(args[0], torch.Tensor)
                and args[0].shape[-1:] == ids.shape[-1:]
                and bool((args[0].reshape(-1, _TOKENS) == ids).all())
            ):
                fed.add(name)

        return hook

    def stop(*_: Any) -> None:
        raise _Called

    handles = [m.register_forward_pre_hook(record(n)) for n, m in embeddings.items()]
    if stop_at is not None:
        handles.append(stop_at.register_forward_pre_hook(stop))
    try:
        with evaluating(model):
            model(ids)
    except _Called:
        pass
    except Exception:  # noqa: BLE001 - any model: whatever its forward raises on plain token ids
        return None
    finally:
        for handle in handles:
            handle.remove()
    return fed


def _no_cache(value: Any) -> Any:
    return None if type(value).__name__.endswith("Cache") else value


def verify(block: nn.Module, split: Split, degree: int, args: tuple, kwargs: dict) -> str | None:
    """None when ``block`` split by ``split`` over ``degree`` ranks computes, on every rank, what it computes
    whole (see the module docstring); else why not, in a few words."""
    want = _first(block(*args, **kwargs))
    try:
        ranks = [_rank_copy(block, split, degree, r) for r in range(degree)]
        totals: dict[str, torch.Tensor] = {}
        for _ in range(len(split.rows) + 1):
            partials: dict[str, list[torch.Tensor]] = {}
            order: list[str] = []
            outs = [_run(local, split.rows, totals, partials, order, args, kwargs) for local in ranks]
            pending = [n for n in order if n not in totals]
            if not pending:
                break
            totals[pending[0]] = sum(partials[pending[0]]) + _bias(block.get_submodule(pending[0]))
        else:
            return "its row-split layers do not run once each"
    except Exception as err:  # the block's own code failing on its split weights: the split is not for it
        return f"split, its forward fails ({type(err).__name__}: {str(err).splitlines()[0][:80]})"
    for out in outs:
        if out.shape != want.shape:
            return f"split, its output has shape {tuple(out.shape)}, not {tuple(want.shape)}"
        if not _close(out, want):
            return f"split, its output differs from one process's by {float((out - want).abs().max()):.2g}"
    return _gradients(block, split, degree, args, kwargs) if split.latent else None


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    tol = 1e-4 if want.dtype in (torch.float32, torch.float64) else 2e-2
    return torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()))


def _gradients(block: nn.Module, split: Split, degree: int, args: tuple, kwargs: dict) -> str | None:
    """None when each rank's gradients, as the split's styles make them, equal the unsplit block's: of the block's
    input and of the parameters it keeps whole (summed over the ranks for ``summed`` modules); else why not. A
    latent layer's output read by the heads of every rank (:attr:`Split.latent`) is where a split can compute the
    right output and still the wrong gradient, so such splits are also run backward: for each rank in turn, the
    others read that rank's tensors where a style sums the gradient over the ranks on the way back (a column-split
    layer's input, a latent's output), so its backward gets every rank's part there, as the all-reduce gives it."""
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
        return None
    with torch.enable_grad():
        whole = copy.deepcopy(block)
        x = args[0].detach().clone().requires_grad_()
        out = _first(whole(x, *args[1:], **kwargs))
        back = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
        (out * back).sum().backward()
        want = {n: p.grad.clone() for n, p in whole.named_parameters() if p.grad is not None}
        ranks = [_rank_copy(block, split, degree, r) for r in range(degree)]
        cut = (*split.columns, *split.rows, *split.heads)
        summed: dict[str, torch.Tensor] = {}
        for rank in range(degree):
            leaves = [args[0].detach().clone().requires_grad_() for _ in ranks]
            (_emulated(block, ranks, rank, split, leaves, args[1:], kwargs) * back).sum().backward()
            if not _close(leaves[rank].grad, x.grad):  # type: ignore[arg-type]
                return "split, the gradient of its input differs from one process's"
            for name, param in ranks[rank].named_parameters():
                if name not in want or param.grad is None or _inside(name, cut):
                    continue
                if _inside(name, split.summed):
                    summed[name] = summed.get(name, 0) + param.grad
                elif not _close(param.grad, want[name]):
                    return f"split, the gradient of {name} differs from one process's"
            for local in ranks:
                local.zero_grad(set_to_none=True)
    wrong = next((n for n, g in summed.items() if not _close(g, want[n])), None)
    return None if wrong is None else f"split, the gradient of {wrong} summed over the ranks differs from one process's"


def _inside(name: str, modules: tuple[str, ...]) -> bool:
    return any(name.startswith(f"{m}.") for m in modules)


def _emulated(
    block: nn.Module, ranks: list[nn.Module], first: int, split: Split, leaves: list, args: tuple, kwargs: dict
) -> torch.Tensor:
    """Rank ``first``'s output, every rank's forward kept for the backward (the all-reduce after a row-split layer
    summing their partial outputs); the others read rank ``first``'s input of each column-split layer and output of
    each latent one."""
    totals: dict[str, torch.Tensor] = {}
    order_ranks = [first, *(r for r in range(len(ranks)) if r != first)]
    for _ in range(len(split.rows) + 1):
        partials: dict[str, list[torch.Tensor]] = {}
        order: list[str] = []
        seen: dict[tuple[str, int], torch.Tensor] = {}
        outs = {}
        for r in order_ranks:
            handles = _sharing(ranks[r], split, seen, r == first)
            try:
                outs[r] = _run(ranks[r], split.rows, totals, partials, order, (leaves[r], *args), kwargs)
            finally:
                for handle in handles:
                    handle.remove()
        pending = [n for n in order if n not in totals]
        if not pending:
            break
        bias = _bias(block.get_submodule(pending[0]))
        totals[pending[0]] = sum(partials[pending[0]]) + (bias.detach() if isinstance(bias, torch.Tensor) else bias)
    return outs[first]


def _sharing(local: nn.Module, split: Split, seen: dict, first: bool) -> list:
    """Hooks on one rank's copy: rank ``first`` records its column-split layers' inputs and its latents' outputs,
    by call; the others read those instead of their own."""
    calls: dict[str, int] = {}

    def key(name: str) -> tuple[str, int]:
        calls[name] = calls.get(name, -1) + 1
        return name, calls[name]

    def inputs(name: str) -> Callable[..., Any]:
        def hook(_: nn.Module, a: tuple) -> tuple | None:
            k = key(name)
            if first:
                seen[k] = a[0]
                return None
            return (seen[k], *a[1:]) if k in seen else None

        return hook

    def outputs(name: str) -> Callable[..., Any]:
        def hook(_: nn.Module, a: tuple, out: torch.Tensor) -> torch.Tensor | None:
            k = key(f"{name}/out")
            if first:
                seen[k] = out
                return None
            return seen.get(k)

        return hook

    return [local.get_submodule(n).register_forward_pre_hook(inputs(n)) for n in split.columns] + [
        local.get_submodule(n).register_forward_hook(outputs(n)) for n in split.latent
    ]


def _first(out: Any) -> torch.Tensor:
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the block returns no tensor")
    return leaves[0]


def _run(
    local: nn.Module, rows: tuple[str, ...], totals: dict, partials: dict, order: list, args: tuple, kwargs: dict
) -> torch.Tensor:
    handles = [local.get_submodule(n).register_forward_hook(partial(_reduce, n, totals, partials, order)) for n in rows]
    try:
        return _first(local(*args, **kwargs))
    finally:
        for h in handles:
            h.remove()


def _reduce(
    name: str, totals: dict, partials: dict, order: list, _: nn.Module, args: Any, out: torch.Tensor
) -> torch.Tensor:
    """A row-split layer's output: the emulated all-reduce once known, else this rank's partial sum."""
    if name in totals:
        return totals[name]
    if name not in order:
        order.append(name)
    partials.setdefault(name, []).append(out)
    return out


def _bias(layer: nn.Module) -> torch.Tensor | float:
    return layer.bias if getattr(layer, "bias", None) is not None else 0.0


def _rank_copy(block: nn.Module, split: Split, degree: int, rank: int) -> nn.Module:
    """``block`` as rank ``rank`` of ``degree`` holds it: its slices of the split layers, its counts adjusted."""
    local = copy.deepcopy(block)
    for name, parts in split.columns.items():
        layer = local.get_submodule(name)
        out = dims(layer)[1]  # type: ignore[index]
        keep = torch.cat([b.tensor_split(degree)[rank] for b in torch.arange(out).chunk(parts)])
        _cut(layer, out_index=keep)
    for name in split.rows:
        layer = local.get_submodule(name)
        _cut(layer, in_index=torch.arange(dims(layer)[0]).tensor_split(degree)[rank])  # type: ignore[index]
    for name in split.heads:
        module = local.get_submodule(name)
        for attr, param in list(module.named_parameters(recurse=False)):
            setattr(module, attr, nn.Parameter(param.detach().tensor_split(degree)[rank].clone()))
    for owner, attr in split.adjust:
        module = local.get_submodule(owner)
        setattr(module, attr, getattr(module, attr) // degree)
    return local


def _cut(layer: nn.Module, out_index: torch.Tensor | None = None, in_index: torch.Tensor | None = None) -> None:
    conv = is_conv1d(layer)
    w = layer.weight.detach()
    if out_index is not None:
        w = w[:, out_index] if conv else w[out_index]
        if layer.bias is not None:
            layer.bias = nn.Parameter(layer.bias.detach()[out_index].clone())
        if conv:
            layer.nf = len(out_index)
        else:
            layer.out_features = len(out_index)
    if in_index is not None:
        w = w[in_index] if conv else w[:, in_index]
        if layer.bias is not None:  # added once, after the emulated all-reduce
            layer.bias = nn.Parameter(torch.zeros_like(layer.bias))
        if not conv:
            layer.in_features = len(in_index)
    layer.weight = nn.Parameter(w.clone())
