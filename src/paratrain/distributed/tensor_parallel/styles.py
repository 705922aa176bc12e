"""The ways one module is split over the tensor-parallel ranks: PyTorch's ``ParallelStyle`` classes, by name, plus
three small extensions of them for layers PyTorch's styles do not take.

* ``colwise`` / ``rowwise`` also take transformers' ``Conv1D`` (GPT-2's linear layers, whose weight is stored
  transposed: ``in x out``), by sharding the other weight dimension; ``nn.Linear`` and ``nn.Embedding`` go to
  PyTorch's own code.
* ``fused_colwise(parts)`` is a column split of a projection whose output is ``parts`` blocks side by side (GPT-2's
  ``c_attn`` computes ``[q | k | v]``). A plain column split would give rank 0 all of q and half of k; here the
  weight is split plainly (so checkpoints and resharding see an ordinary ``Shard``), and the output is gathered
  once and each rank keeps its heads of every block. That costs one all-gather of the projection's output per
  call, which a layout interleaved per head (our GPT's) does not need.
* ``FirstInput`` prepares a module's first positional input only, however many more it is called with (a
  transformers block also gets its cache and mask positionally), where ``PrepareModuleInput`` needs one layout
  per input.
* ``replicate`` keeps a module's parameters whole on every rank, as DTensors, so that every parameter of a tensor
  parallel model is a DTensor on one mesh (clipping and FSDP need that); inputs and outputs stay plain tensors.
  ``replicate(grad=sum)``: a module inside split attention (Qwen3's per-head query/key norms) sees only this rank's
  heads, so each rank's gradient is a part of the whole one: it is summed over the ranks on the way back.
  ``replicate(output_grad=sum)``: a layer whose output every rank's heads read (DeepSeek-V3's latent projection
  ``wkv_a``) gets from each rank the gradient of that rank's heads only: it is summed over the ranks where the
  output leaves the layer (Megatron's "copy to the tensor-parallel region"), so the layer and its input get the whole
  one.
* ``heads`` splits a module's own parameters indexed by attention head (GPT-OSS's attention sinks) with the heads
  its column-split projections give each rank (``Shard(0)``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel
from torch.utils._pytree import tree_leaves

from ...errors import ConfigError


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: a linear layer with an ``in x out`` weight."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _shard_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Any], src: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(
            name,
            nn.Parameter(
                distribute_tensor(param, mesh, [placements[name]], src_data_rank=src), requires_grad=param.requires_grad
            ),
        )


def _conv1d_partition(_: str, module: nn.Module, mesh: DeviceMesh, src_data_rank: int | None) -> None:
    """A ``Conv1D``'s weight split on its output dimension (its columns), its bias alike."""
    _shard_params(module, mesh, {"weight": Shard(1), "bias": Shard(0)}, src_data_rank)


class Colwise(ColwiseParallel):
    """``ColwiseParallel`` that also splits a ``Conv1D`` (weight ``Shard(1)``, bias ``Shard(0)``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if is_conv1d(module):
            partition = partial(_conv1d_partition, src_data_rank=self.src_data_rank)
        elif isinstance(module, nn.Embedding):
            partition = self._partition_embedding_fn
        elif isinstance(module, nn.Linear):
            partition = self._partition_linear_fn
        else:
            raise ConfigError(f"colwise splits nn.Linear, nn.Embedding and Conv1D layers, not {type(module).__name__}")
        return distribute_module(
            module,
            device_mesh,
            partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            self._output(),
        )

    def _output(self) -> Callable[..., Any]:
        return partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)


class Rowwise(RowwiseParallel):
    """``RowwiseParallel`` that also splits a ``Conv1D`` (weight ``Shard(0)``, bias replicated), and an
    ``nn.Embedding`` over its rows (the vocabulary) reading whole token ids unless told otherwise: torch's default
    input layout, ``Shard(-1)``, is a row-split linear layer's, and token ids have no feature dimension to split."""

    def __init__(self, *, input_layouts: Any = None, **kwargs: Any) -> None:
        super().__init__(input_layouts=input_layouts, **kwargs)
        self._input_given = input_layouts is not None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise ConfigError(
                    f"rowwise splits nn.Linear, nn.Embedding and Conv1D layers, not {type(module).__name__}"
                )
            if isinstance(module, nn.Embedding) and not self._input_given:  # a copy: one style may serve many
                return Rowwise(
                    input_layouts=Replicate(),
                    output_layouts=self.output_layouts[0],
                    use_local_output=self.use_local_output,
                )._apply(module, device_mesh)
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            lambda _, m, mesh: _shard_params(m, mesh, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class VocabHead(Colwise):
    """The output head split over the vocabulary: its logits come out a ``Shard(-1)`` DTensor whatever the layout of
    its input (the final norm's sequence slices, whole hidden states, a plain tensor), so the loss can run on them
    split (``loss_parallel``); :mod:`.outputs` gathers them for any other code that reads them."""

    def __init__(self) -> None:
        super().__init__(output_layouts=Shard(-1), use_local_output=False)

    @staticmethod
    def _prepare_input_fn(
        input_layouts: Any, desired_input_layouts: Any, mod: nn.Module, inputs: Any, device_mesh: DeviceMesh
    ) -> Any:
        x = inputs[0]
        if not isinstance(x, DTensor):
            return DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
        return x if x.placements == (Replicate(),) else x.redistribute(placements=(Replicate(),), async_op=True)


class FusedColwise(Colwise):
    """A column split of a projection computing ``parts`` equal blocks side by side; each rank's output is its
    slice of every block, concatenated (see the module docstring)."""

    def __init__(self, parts: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.parts = parts

    def _output(self) -> Callable[..., Any]:
        return partial(_own_slices, self.parts)


def _own_slices(parts: int, module: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    # Each rank's backward reaches only its own slices: the gathered tensor's gradient is a partial sum.
    full = out.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    rank, size = mesh.get_local_rank(), mesh.size()
    return torch.cat([block.tensor_split(size, dim=-1)[rank] for block in full.chunk(parts, dim=-1)], dim=-1)


class FirstInput(PrepareModuleInput):
    """``PrepareModuleInput`` with one layout, for the first positional input; the others pass unchanged."""

    def _prepare_input_fn(self, inputs: Any, device_mesh: DeviceMesh) -> Any:
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        return (*super()._prepare_input_fn(inputs[:1], device_mesh), *inputs[1:])


class Replicated(ParallelStyle):
    """Parameters whole on every rank (``Replicate`` DTensors); plain tensors in and out. ``output_shard=d``: each
    rank keeps its slice of the output along ``d`` (no communication; the backward all-gathers the gradient), as a
    position table added to sequence-sharded token embeddings needs.

    The parameters stay DTensors (clipping's norm over shards, checkpoints, FSDP over ``(dp, tp)`` want one mesh),
    but the forward runs on their local tensors when it can: a module that holds no state below itself and no
    buffers, called on plain tensors, outside ``torch.compile``'s tracing. Each parameter is swapped for
    ``to_local()`` (differentiable: its gradient comes back a ``Replicate`` DTensor, as DTensor's own ops give)
    for the call and put back after it, also when the call raises, as FSDP2 swaps its unsharded parameters. The
    numbers are the same; what goes is DTensor's dispatch on every op of a norm's forward and backward (§20 of
    benchmarks/RESULTS.md §20). Otherwise the module computes on DTensors,
    its plain inputs made ``Replicate`` ones. The optimizer's step updates these parameters on their local tensors
    too (:mod:`.local_step`)."""

    def __init__(self, output_shard: int | None = None, summed: bool = False, output_summed: bool = False) -> None:
        super().__init__()
        self.output_shard = output_shard
        self.summed = summed
        self.output_summed = output_summed

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)  # every parameter and buffer a Replicate DTensor; no hooks
        leaf = not any(True for _ in module.buffers()) and all(
            not any(True for _ in m.parameters(recurse=False)) for m in module.modules() if m is not module
        )
        if self.summed and not leaf:
            raise ConfigError(
                f"replicate(grad=sum) takes a module holding parameters only itself and no buffers (a "
                f"norm), not {type(module).__name__}; name its parameter-holding children instead"
            )
        swapped: list[dict[str, DTensor] | None] = []  # one entry per call in flight (a module may nest in itself)

        def enter(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if not leaf or torch.compiler.is_compiling() or _holds_dtensor(args, kwargs):
                swapped.append(None)
                return tuple(
                    DTensor.from_local(a, device_mesh, [Replicate()], run_check=False)
                    if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                    else a
                    for a in args
                ), kwargs
            params = {
                n: p
                for n, p in mod._parameters.items()
                if isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements)
            }
            for name, param in params.items():
                mod._parameters[name] = _summed_grad(param) if self.summed else param.to_local()
            swapped.append(params)
            return args, kwargs

        def leave(mod: nn.Module, args: tuple, out: Any) -> Any:
            params = swapped.pop()
            if params is not None:
                mod._parameters.update(params)
                if self.output_shard is None and not (self.output_summed and isinstance(out, torch.Tensor)):
                    return out
                out = DTensor.from_local(out, device_mesh, [Replicate()], run_check=False)
            if not isinstance(out, DTensor):
                return out
            if self.output_shard is not None:
                return out.redistribute(placements=[Shard(self.output_shard)]).to_local()
            return out.to_local(grad_placements=[Partial()] if self.output_summed else None)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, always_call=True)
        return module


def _summed_grad(param: DTensor) -> torch.Tensor:
    """``param``'s local tensor, its gradient summed over the ranks on the way back (the backward of a ``Partial``
    gradient redistributed to ``param``'s ``Replicate``)."""
    whole = DTensor.from_local(param.to_local(), param.device_mesh, param.placements, run_check=False)
    return whole.to_local(grad_placements=[Partial()])


class PerHead(ParallelStyle):
    """A module's own parameters indexed by attention head along dimension 0 (GPT-OSS's sinks), split with the
    heads (``Shard(0)``); its forward reads this rank's part as plain tensors, swapped in for the call and put back
    after it, as :class:`Replicated` does. Its children keep the styles the plan gives them."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        own = {n: Shard(0) for n, _ in module.named_parameters(recurse=False)}
        _shard_params(module, device_mesh, own, 0)
        swapped: list[dict[str, Any]] = []

        def enter(mod: nn.Module, args: tuple) -> None:
            params = {n: mod._parameters[n] for n in own}
            mod._parameters.update({n: p.to_local() for n, p in params.items()})
            swapped.append(params)

        def leave(mod: nn.Module, args: tuple, out: Any) -> None:
            mod._parameters.update(swapped.pop())

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        return module


def _holds_dtensor(args: tuple, kwargs: dict) -> bool:
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # a norm's call: one plain tensor
        return False
    return any(isinstance(t, DTensor) for t in tree_leaves((args, kwargs)))
