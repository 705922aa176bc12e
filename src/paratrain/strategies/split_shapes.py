"""What tensor and context parallelism would split of a traced model, as the runtime decides it, for the planner.

``paratrain plan`` traces a model it has no closed forms for (a user's ``module:factory``) to find its sizes; whether
and how ``tp`` and ``cp`` split it is the runtime's to say, so this module asks the runtime instead of requiring a
transformer's shape:

* tp: the plan ``prepare`` would apply (:func:`~paratrain.distributed.tensor_parallel.infer.choose_plan`: the model's
  own or built-in plan, else one inferred from its blocks, each split tried on this process). The planner counts the
  parameters that plan splits in each wrap unit; the activations as the Megatron count does where the plan splits
  attention and the MLP of every block (whole between them: an inferred plan has no sequence parallelism), else
  whole. The plan is inferred for the degree asked, or for 2, 4 and 8: the largest degree it splits alike bounds
  the degrees planned. Trying the splits needs the model's weights, so it is built on this CPU where it fits.
* cp: attention as cp finds it, the attention kernel calls (``F.scaled_dot_product_attention``, an
  ``is_attention_kernel`` module) of one forward on the meta device (on this CPU where the meta device cannot run
  it: a router's counts), read through
  :class:`~paratrain.model.attention.SDPACall`: their count, heads, key/value heads, head size and sequence length.

Where the runtime would refuse (nothing tp can split; no attention found, or a forward that takes no positions),
its own line is kept in ``ModelStats.refused`` and the plan shows it instead of the rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ..errors import ConfigError
from ..model.attention import SDPACall
from ..model.structure import find_blocks
from ..planner.inputs import TrainingCall
from ..planner.model_stats import CPShape, ModelStats, TPShape, check_fits_host
from .tp_shape import split_per_unit

SEARCHED = (2, 4, 8)
"""The tensor-parallel degrees a plan is inferred for when none is asked (a node's)."""


def runtime_splits(
    factory: Callable[[], nn.Module], call: TrainingCall
) -> Callable[[ModelStats, int | None, int | None], ModelStats]:
    """``RunnableModel.splits`` for the model ``factory`` builds, called as ``call`` says."""
    return partial(with_splits, factory, call)


def with_splits(
    factory: Callable[[], nn.Module], call: TrainingCall, stats: ModelStats, tp: int | None, cp: int | None
) -> ModelStats:
    """``stats`` with the TP and CP shapes the runtime gives the model at degree ``tp`` and ``cp`` (None: those the
    planner searches; 1: none asked), or the runtime's reason to refuse each."""
    refused: dict[str, str] = {}
    tp_shape = None if tp == 1 else _or_refused(refused, "tp", lambda: tp_shape_of(factory, call, stats, tp))
    cp_shape = None if cp == 1 else _or_refused(refused, "cp", lambda: cp_shape_of(factory, call))
    return replace(stats, tp=tp_shape, cp=cp_shape, refused=refused)


def _or_refused(refused: dict[str, str], flag: str, find: Callable[[], Any]) -> Any:
    try:
        return find()
    except ConfigError as err:
        refused[flag] = str(err)
        return None


def tp_shape_of(factory: Callable[[], nn.Module], call: TrainingCall, stats: ModelStats, tp: int | None) -> TPShape:
    """The TP shape of the plan the runtime gives the model over ``tp`` ranks (None: over 2, checked up to 8)."""
    from ..distributed.tensor_parallel.infer import choose_plan

    check_fits_host(
        factory,
        stats.name,
        why="inferring its tensor-parallel plan (each split tried on this process)",
        instead="plan its shape instead (--model-config or --params)",
    )
    with torch.random.fork_rng(devices=[]):  # the caller's random stream stays as it was
        torch.manual_seed(0)
        model = factory()
    degrees = (tp,) if tp is not None else SEARCHED
    plan = choose_plan(model, None, degrees[0])  # the runtime's refusal, as prepare would raise it
    largest = degrees[0]
    for degree in degrees[1:]:
        try:
            if choose_plan(model, None, degree).printed() != plan.printed():
                break
        except ConfigError:
            break
        largest = degree
    blocks = find_blocks(model)
    layers = blocks.modules(model) if blocks is not None else []
    return TPShape(
        layers=len(layers),
        hidden=_width(layers[0]) if layers else 0,
        seq_len=call.input.shape[0] if call.input.shape else 1,
        split=split_per_unit(model, plan, [unit for unit, _ in stats.units]),
        divides=tuple(plan.divisible(model).items()),
        sequence_parallel=plan.sequence_parallel,
        splits_activations=plan.warning is None and bool(layers),
        largest=largest if tp is None else None,
    )


def _width(block: nn.Module) -> int:
    """The width of a block's input: the input features of its first linear layer (attention's projection)."""
    from ..distributed.tensor_parallel.probe import dims

    return next((d[0] for m in block.modules() if (d := dims(m)) is not None), 0)


def cp_shape_of(factory: Callable[[], nn.Module], call: TrainingCall) -> CPShape:
    """The CP shape of the model's attention as cp finds it, from one forward on the meta device; the runtime's
    one line where it would refuse."""
    from ..distributed.context_parallel.kernels import no_attention
    from ..distributed.context_parallel.sequence import no_positions, positions_keyword

    with torch.device("meta"):
        model = factory()
    if positions_keyword(model) is None:
        raise ConfigError(no_positions(model))
    try:
        calls = _attention_calls(model, call, "meta")
    except Exception:  # noqa: BLE001 - a forward that reads tensor values (a router's counts): run it on this CPU
        calls = _attention_calls(_on_host(factory), call, "cpu")
    if not calls:
        raise ConfigError(no_attention(model))
    q, k = calls[0]
    return CPShape(layers=len(calls), seq_len=q[-2], heads=q[1], kv_heads=k[1], head_dim=q[-1])


def _on_host(factory: Callable[[], nn.Module]) -> nn.Module:
    """The model built on this CPU, once it is known to fit, for a forward the meta device cannot run."""
    check_fits_host(
        factory,
        "the model",
        why="finding its attention (its forward cannot run on the meta device)",
        instead="plan its shape instead (--model-config or --params)",
    )
    with torch.random.fork_rng(devices=[]):
        return factory()


class _KernelCalls(TorchFunctionMode):
    """Notes the q and k shapes of every ``scaled_dot_product_attention`` call, as cp's exchange reads them."""

    def __init__(self, calls: list[tuple[torch.Size, torch.Size]]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            sdpa = SDPACall(*args, **kwargs)
            self.calls.append((sdpa.query.shape, sdpa.key.shape))
        return func(*args, **kwargs)


def _attention_calls(model: nn.Module, call: TrainingCall, device: str) -> list[tuple[torch.Size, torch.Size]]:
    """(q, k) shapes ``[b, h, s, d]`` of each attention of one forward of a sample made on ``device``: an
    ``is_attention_kernel`` module's inputs (nothing inside it is noted again), else each SDPA call. The forward's
    own error, if any, is raised."""
    calls: list[tuple[torch.Size, torch.Size]] = []
    inside = [0]

    def enter(_: nn.Module, args: tuple) -> None:
        if not inside[0]:
            calls.append((args[0].shape, args[1].shape))
        inside[0] += 1

    def leave(*_: Any) -> None:
        inside[0] -= 1

    kernels = [m for m in model.modules() if getattr(m, "is_attention_kernel", False)]
    handles = [h for m in kernels for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    mode = _KernelCalls([])
    try:
        x, targets = call.inputs(model, 1, device)
        with torch.no_grad(), mode:
            model(x, **targets)
    finally:
        for handle in handles:
            handle.remove()
    return calls or mode.calls
