"""The running side of a pipeline: this rank's stages of the model and the ``torch.distributed.pipelining``
schedules that run its micro-batches (GPipe, 1F1B, interleaved 1F1B, looped BFS); the loss is computed on the last
stage and shared with every rank of the pipeline. The ``pipeline`` and ``hybrid`` strategies
(:mod:`paratrain.strategies.pipeline`) cut the model and build one of these.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..batch import ModelCall
from ..errors import ConfigError
from ..model.stages import LOSS_INPUT, TOKEN_IDS, OutputKind, StageModule
from ..options import stages_of
from ..precision import Precision


def no_graph(models: list[nn.Module], strategy: str) -> str:
    """The line for ``par.backward`` given a loss without a graph (of the prepared ``models``): a pipeline's forward
    runs no backward (its schedule runs both, in ``forward_backward``); otherwise the loss was made without
    gradients."""
    if any(isinstance(m, PipelinedModel) for m in models):
        return (
            f"par.backward got a loss with no graph: under {strategy!r} the model's forward runs the pipeline "
            "forward only (its schedule runs backward with it); train with loss = par.forward_backward(model, x, "
            "y, loss_fn) or par.forward_backward(model, ids, labels=ids)"
        )
    return (
        "par.backward got a loss that does not require grad (detached, or computed under torch.no_grad() or "
        "torch.inference_mode()); compute the training loss with gradients enabled"
    )


class PipelinedModel(nn.Module):
    """This rank's layers of the pipeline, under their original names, and the schedules that run them.

    A pipeline stage fixes its communication buffers to the shapes of the first batch it sees, so each input shape
    (batch size and sequence length: packed rows vary in length) of training and of evaluation gets stages and a
    schedule of their own, made on first use; only the last shape's are kept, so varying lengths do not pile up
    buffers. All ranks of a pipeline read the same batch, so they agree on the shape without talking.
    """

    def __init__(self, owned: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        for name, layer in owned:
            self.add_module(name, layer)
        self.parts: list[tuple[int, nn.Module]] = []  # (stage index, the stage's module), this rank's
        self.num_stages = 1
        self.device = torch.device("cpu")
        self.pp_group: dist.ProcessGroup | None = None
        self.last_rank: int = 0  # global rank holding the last stage
        self.microbatches = 1
        self.eval_outputs = "every"  # or "last": a forward-only call's output stays on the last stage
        self.schedule_name = "1f1b"
        self._schedules: dict[tuple[str, tuple[int, ...]], Any] = {}
        self._loss_fn: Callable | None = None
        self._call: tuple[ModelCall, float] | None = None  # the training call in flight and its loss factor
        self.stage_modules: dict[int, StageModule] = {}  # a model cut at its blocks: this rank's stages
        self.key_order: list[str] | None = None  # the plain model's state-dict order
        self.tied: list[tuple[dist.ProcessGroup, str]] = []  # (ranks holding it, its name here) per tied weight
        self.uncounted: set[str] = set()  # tied weights another rank counts in the gradient norm
        self.aliases: dict[str, str] = {}  # a tied weight held here under another name -> its first name
        self._eval_kind: OutputKind | None = None
        self.precision: Precision | None = None
        self.split_loss: Callable[[], AbstractContextManager] = nullcontext  # tensor parallel: the vocab-split loss

    def train(self, mode: bool = True) -> PipelinedModel:
        """Also the stages: a stage cut from a model holds copies of the modules above its blocks (the model's
        root), which are not children of this module."""
        super().train(mode)
        for _, part in self.parts:
            part.train(mode)
        return self

    @property
    def is_first(self) -> bool:
        return any(index == 0 for index, _ in self.parts)

    @property
    def is_last(self) -> bool:
        return any(index == self.num_stages - 1 for index, _ in self.parts)

    def _schedule(self, kind: str, shape: torch.Size, loss_fn: Callable | None = None) -> Any:
        key = (kind, tuple(shape))
        if key not in self._schedules:
            self._schedules = {k: v for k, v in self._schedules.items() if k[0] != kind}
            from torch.distributed.pipelining import PipelineStage

            stages = [
                PipelineStage(part, index, self.num_stages, self.device, group=self.pp_group)
                for index, part in self.parts
            ]
            per_rank = len(self.parts)
            pp = self.num_stages // per_rank

            def placement(rank: int) -> list[int]:
                return stages_of(self.schedule_name, rank, pp, per_rank)

            if kind == "eval":  # forward only: one micro-batch of any size, no bubble to hide
                self._schedules[key] = _make_schedule("gpipe", stages, 1, None, placement)
            else:
                self._schedules[key] = _make_schedule(self.schedule_name, stages, self.microbatches, loss_fn, placement)
        return self._schedules[key]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, through the whole pipeline; every rank gets the last stage's output (with the loss the
        model computed, when it was given the loss's inputs: ``model(x, y)``, ``model(x, labels=y)``). With
        ``eval_outputs="last"`` the other ranks get the loss alone (no logits), or None for a model without one."""
        call = ModelCall.of(
            args[0] if args else kwargs.pop("input_ids", None), args[1] if len(args) > 1 else None, None, kwargs
        )
        if len(args) > 2:
            raise ConfigError(
                "a pipeline's forward takes the input and the loss's target positionally, the rest by keyword"
            )
        x, inputs = self._inputs(call)
        schedule = self._schedule("eval", x.shape)
        # As in training, the stages hand on (and the last sends) their outputs in the compute dtype; this model's
        # own forward, wrapped by the precision, hands back fp32 outputs on every rank.
        with (
            nullcontext() if self.precision is None else self.precision.compute_dtype_outputs(),
            self._stages_given(inputs),
        ):
            out = schedule.eval(x, **inputs) if self.is_first else schedule.eval(**inputs)
        if self.eval_outputs == "every":
            out = _share_from_last(out, self)
        if not self.stage_modules:
            return out
        if self._eval_kind is None:  # the model's kind of output, known on the last stage: told to every rank
            kind = [self.output_kind()]
            dist.broadcast_object_list(kind, src=self.last_rank, group=self.pp_group)
            self._eval_kind = kind[0]
        loss = None
        if call.target is not None or call.loss_kwargs:  # the model computed its loss on the last stage
            last = self.stage_modules.get(self.num_stages - 1)
            held = last.loss if last is not None and last.loss is not None else torch.zeros((), device=self.device)
            loss = _share_loss(held, self)
        return None if out is None and loss is None else self._eval_kind.wrap(out, loss)

    def output_kind(self) -> OutputKind:
        """How the last stage's tensor becomes what the plain model returns (a ``ModelOutput`` with ``logits``)."""
        last = self.stage_modules.get(self.num_stages - 1)
        return last.kind if last is not None else OutputKind()

    def forward_backward(self, call: ModelCall, scale: float) -> torch.Tensor:
        """One batch through the schedule (forward and backward); returns the batch loss on every rank. The loss is
        ``call``'s ``loss_fn`` on the last stage's output, or the one the model computes on the last stage."""
        x, inputs = self._inputs(call)
        _check_divisible(x, self.microbatches)
        if call.own_loss and call.target is None and not call.loss_kwargs:
            raise ConfigError(
                "forward_backward without a loss_fn needs the inputs of the model's own loss: a target "
                "(model(x, y)) or labels="
            )
        loss_fn = call.loss_fn if call.loss_fn is not None else _OWN_LOSS
        if loss_fn is not self._loss_fn:
            self._loss_fn = loss_fn
            self._schedules = {k: v for k, v in self._schedules.items() if k[0] == "eval"}
        # Each micro-batch's loss is divided here, not by the schedule's scale_grads: that rescales every
        # gradient in place and would shrink gradients accumulated over earlier steps again. A loss divided by the
        # batch's target count (a model's own given num_items_in_batch, a loss_fn's weighed by ModelCall.items: a
        # packed batch's real tokens) is each micro-batch's share already: summed, not averaged. The schedule keeps
        # the first call's `loss` for its shape, so what changes between calls is read from `self._call`.
        counted = call.items is not None or (call.own_loss and call.loss_kwargs.get("num_items_in_batch") is not None)
        self._call = (call, scale if counted else scale / self.microbatches)
        precision = self.precision

        def loss(out: Any, tgt: torch.Tensor) -> torch.Tensor:
            assert self._call is not None
            now, factor = self._call
            if loss_fn is _OWN_LOSS:
                return out * factor  # the last stage handed on the model's own loss
            with nullcontext() if precision is None else precision.forward_context(self.device):
                return now.weigh(loss_fn(self.output_kind().wrap(out), tgt), tgt) * factor

        schedule = self._schedule("train", x.shape, loss)
        losses: list[torch.Tensor] = []
        target = call.target if call.loss_fn is not None else torch.zeros(x.shape[0], device=self.device)
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.is_last else {}
        if "return_outputs" in inspect.signature(schedule.step).parameters:  # torch >= 2.10
            kwargs["return_outputs"] = False  # only the losses are read: the last stage keeps no micro-batch logits
        # As forward_backward without stages: the stages hand on (and the loss reads) their outputs in the compute
        # dtype, not cast to fp32 — the same values one process computes, and no fp32 copy of the logits.
        with (
            nullcontext() if precision is None else precision.compute_dtype_outputs(),
            self.split_loss(),
            self._stages_given(inputs, hand_on_loss=call.own_loss),
        ):
            if self.is_first:
                schedule.step(x, **kwargs, **inputs)
            else:
                schedule.step(**kwargs, **inputs)
        from ..distributed.tensor_parallel.outputs import plain

        losses = [plain(part) for part in losses]
        loss = torch.stack(losses).sum().detach() / scale if losses else torch.zeros((), device=self.device)
        return _share_loss(loss, self)

    def _inputs(self, call: ModelCall) -> tuple[torch.Tensor, dict[str, Any]]:
        """The first stage's input and the keyword tensors every stage gets (the loss's own under
        :data:`~paratrain.model.stages.LOSS_INPUT`, the input itself under
        :data:`~paratrain.model.stages.TOKEN_IDS` where a later stage runs the model's forward on it); keyword
        inputs that are no tensors are handed to the stages directly (:meth:`_stages_given`)."""
        kwargs = dict(call.kwargs)
        x = call.x if call.x is not None else kwargs.pop("input_ids", None)
        if not isinstance(x, torch.Tensor):
            raise ConfigError(
                "a pipeline needs the batch's input as a tensor: forward_backward(model, x, ...) or an "
                "input_ids= keyword"
            )
        own = dict(call.loss_kwargs) if call.own_loss else {}
        if call.own_loss and call.target is not None:
            own[""] = call.target
        if own and not self.stage_modules:
            raise ConfigError("an nn.Sequential pipeline computes no loss of its own; give forward_backward a loss_fn")
        inputs = {**kwargs, **{LOSS_INPUT + k: v for k, v in own.items()}}
        if any(stage.takes_ids for stage in self.stage_modules.values()):
            inputs[TOKEN_IDS] = x  # every rank of a pipeline reads the same batch
        return x, inputs

    @contextmanager
    def _stages_given(self, inputs: dict[str, Any], hand_on_loss: bool = False) -> Iterator[None]:
        """Inside: this rank's stages take ``inputs``' non-tensors and single values (``num_items_in_batch``: no
        batch dimension to split into micro-batches) as constants (popped from ``inputs``), and the last stage hands
        on the model's own loss when ``hand_on_loss``."""
        constants = {
            k: inputs.pop(k) for k in list(inputs) if not isinstance(inputs[k], torch.Tensor) or inputs[k].dim() == 0
        }
        for stage in self.stage_modules.values():
            stage.constants, stage.hands_on_loss = constants, hand_on_loss
        try:
            yield
        finally:
            for stage in self.stage_modules.values():
                stage.constants, stage.hands_on_loss = {}, False


def _OWN_LOSS(out: Any, target: Any) -> torch.Tensor:
    """Stands for "the model's own loss" where a pipeline keys its schedules by the loss function."""
    raise AssertionError("never called")


def _check_divisible(t: torch.Tensor, microbatches: int) -> None:
    if t.shape[0] % microbatches:
        raise ConfigError(
            f"a batch of {t.shape[0]} does not split into {microbatches} equal micro-batches; "
            f"use a batch size divisible by {microbatches} (DataLoader drop_last=True helps) or change microbatches"
        )


def _share_loss(loss: torch.Tensor, model: PipelinedModel) -> torch.Tensor:
    """The last stage's batch loss on every rank of the pipeline: one broadcast of a scalar, once a step."""
    if model.pp_group is None:
        return loss
    value = loss.detach().float().reshape(()) if model.is_last else torch.zeros((), device=model.device)
    dist.broadcast(value, src=model.last_rank, group=model.pp_group)
    return value


SENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
"""The dtypes a last stage's output is sent in, as they are (one number in the header names it); others as fp32."""


def _share_from_last(value: Any, model: PipelinedModel) -> torch.Tensor:
    """Broadcast the last stage's tensor to every rank of the pipeline in its own dtype (its dtype and shape sent
    first), so no fp32 copy of bf16 logits is made or sent."""
    if model.pp_group is None:
        return value
    header = torch.full((9,), -1, dtype=torch.long)
    if model.is_last:
        value = value if value.dtype in SENT_DTYPES else value.float()
        header[0] = SENT_DTYPES.index(value.dtype)
        header[1 : 1 + value.dim()] = torch.tensor(value.shape)
    header = header.to(model.device)
    dist.broadcast(header, src=model.last_rank, group=model.pp_group)
    dtype, *dims = [int(d) for d in header.tolist()]
    if model.is_last:
        buf = value.detach().contiguous()
    else:
        buf = torch.empty([d for d in dims if d >= 0], dtype=SENT_DTYPES[dtype], device=model.device)
    dist.broadcast(buf, src=model.last_rank, group=model.pp_group)
    return buf


def stage_states(
    local: dict[str, torch.Tensor], model: PipelinedModel, dst: int | None
) -> list[dict[str, torch.Tensor]]:
    """The ``local`` states of the pipeline's ranks, in its rank order: on global rank ``dst`` alone (the others get
    ``[]``; a pipeline without it sends nothing) or, when ``dst`` is None, on every rank. One stage is in flight at a
    time, sent to the ranks that need it, so no rank's device holds more than one stage of another rank's state."""
    group, me, device = model.pp_group, dist.get_rank(), model.device
    ranks = [me] if group is None else dist.get_process_group_ranks(group)
    if dst is not None and dst not in ranks:
        return []
    parts = []
    for src in ranks:
        box = [local if src == me else None]
        if dst is None and len(ranks) > 1:
            dist.broadcast_object_list(box, src=src, group=group, device=device)
        elif dst is not None and src != dst and me == dst:
            dist.recv_object_list(box, src=src, group=group, device=device)
        elif dst is not None and src != dst and me == src:
            dist.send_object_list(box, dst=dst, group=group, device=device)
        parts.append(box[0])
    return parts if dst is None or me == dst else []


def _make_schedule(
    name: str, stages: list[Any], microbatches: int, loss_fn: Callable | None, placement: Callable[[int], list[int]]
) -> Any:
    """Torch's schedule called ``name`` over this rank's ``stages`` (``placement``: the stages each pipeline rank
    holds). Several stages per rank under ``gpipe`` (a forward-only run) take :func:`_forward_first`."""
    from torch.distributed.pipelining import schedules

    if len(stages) > 1 and name == "gpipe":
        return _forward_first(stages, microbatches, placement)
    if len(stages) > 1:
        cls = getattr(schedules, _MULTI[name], None)
        if cls is None:  # torch < 2.9
            raise ConfigError(f"schedule {name!r} needs a newer torch: {torch.__version__} lacks {_MULTI[name]}")
        return cls(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    cls = schedules.ScheduleGPipe if name == "gpipe" else schedules.Schedule1F1B
    return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)


_MULTI = {
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""Torch's classes of the schedules that run several stages per rank, by our name."""


def _forward_first(stages: list[Any], microbatches: int, placement: Callable[[int], list[int]]) -> Any:
    """A forward-only run of several stages per rank: each local stage's micro-batches at once, earlier stages first
    (looped BFS, whose torch class assumes a loop), over any placement, a V (``zbv``, ``dualpipev``: stages r and
    2p - 1 - r) included. Its backward actions, which torch's checks ask for, are dropped once it is lowered: with two
    adjacent stages on one rank, a backward hands a gradient between them even when the schedule runs none."""
    from torch.distributed.pipelining import ScheduleLoopedBFS
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    backward = {"FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "SEND_B", "RECV_B", "REDUCE_GRAD"}

    class ForwardFirst(ScheduleLoopedBFS):
        def _calculate_single_rank_operations(self, rank: int) -> list[Any]:
            mine, micro = sorted(placement(rank)), range(self._n_microbatches)
            ops: list[Any] = [None] * rank + [_Action(s, _ComputationType.FORWARD, m) for s in mine for m in micro]
            ops += [None] * (2 * (self.pp_group_size - 1 - rank))
            return ops + [_Action(s, _ComputationType.FULL_BACKWARD, m) for s in mine[::-1] for m in micro[::-1]]

        def _prepare_schedule_with_comms(self, actions: dict, format: str = "compute_only") -> None:
            super()._prepare_schedule_with_comms(actions, format)
            lowered = self.pipeline_order_with_comms.items()
            self.pipeline_order_with_comms = {
                r: [a for a in ops if a.computation_type.name not in backward] for r, ops in lowered
            }

    return ForwardFirst(stages, microbatches, scale_grads=False)
