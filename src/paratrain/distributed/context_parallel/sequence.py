"""Each rank's slice of the sequences a context-parallel model is called with, and its loss over every token.

The script hands the model whole sequences, as without cp. A forward pre-hook on the model (:meth:`SequenceSplit.
before`) gives it this rank's 1/C of each along dimension 1 (contiguous under Ulysses; under the all-gather, whose
causal work grows along the sequence, head-tail balanced: of 2C chunks rank i holds chunks i and 2C-1-i): the
inputs (``input_ids``, ``inputs_embeds``, the first positional input, a 2-D ``attention_mask``), the global
positions of the slice (``position_ids=`` or ``positions=``, ``[1, seq/C]`` unless the call gave its own: rotary
angles and learned positions are the whole sequence's, in the order the rank holds its tokens), and the loss's
targets. A causal LM's ``labels=`` are shifted before the split (``shift_labels=``:
the last token of a slice predicts the first of the next), and the whole sequence's token count is handed to the
model as ``num_items_in_batch``, so each rank's loss is its tokens' sum over the whole count; other targets are
split as they are, each rank's mean weighted by its share of the counted tokens (``ignore_index=-100`` is not
counted). A packed row's documents (positions restarting at each, :mod:`paratrain.model.packed`) are found from the
whole sequences' positions before the cut, for attention to stay within each (:attr:`SequenceSplit.documents`). A
forward hook (:meth:`SequenceSplit.after`) sums the ranks' parts (an autograd all-reduce over the cp
group): every rank returns the loss over all tokens, and its backward hands each rank the gradient of its part
times C, which the data-parallel mean over dp x cp divides back. Outputs other than the loss (logits) stay the
rank's slice of the sequence.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_reduce, wait_tensor

from ...batch import counted, find_loss
from ...errors import ConfigError
from .masks import Documents, Padding, read_documents, read_padding

IGNORE_INDEX = -100
_FIRST_INPUTS = ("input_ids", "inputs_embeds", "idx", "x")
_TARGETS = ("labels", "targets", "target")


def positions_keyword(model: nn.Module) -> str | None:
    """The keyword of ``model``'s forward for the global positions of its tokens (None: it takes none)."""
    params = inspect.signature(model.forward).parameters
    return next((p for p in ("position_ids", "positions") if p in params), None)


def no_positions(model: nn.Module) -> str:
    """Why cp refuses a model whose forward takes no positions (``positions_keyword`` None)."""
    return (
        f"cp hands each rank the global positions of its slice through position_ids= or positions=, but "
        f"{type(model).__name__}.forward takes neither; add one (an offset into the position table or rotary "
        "angles), or train without cp"
    )


class SequenceSplit:
    """The sequence split of one prepared model over a cp group, and what the current call's attention and loss
    need of the whole sequence."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, balanced: bool = False) -> None:
        self.group = group
        self.rank, self.ranks = dist.get_rank(group), dist.get_world_size(group)
        self.balanced = balanced
        """Head-tail chunks (the all-gather's layout) instead of one contiguous slice (Ulysses')."""
        self.pieces = 2 * self.ranks if balanced else self.ranks
        """Equal pieces each sequence is cut into."""
        params = inspect.signature(model.forward).parameters
        self.positions = positions_keyword(model)
        """The forward's keyword for the global positions of its tokens (None: it takes none)."""
        self.no_cache = {"use_cache": False} if "use_cache" in params else {}
        """A key/value cache would hold only this rank's slice of the keys: a split forward runs without one."""
        self.shifts_labels = _causal_lm(model)
        self.padding: Padding | None = None
        """The padding of the current call's whole sequences (None: nothing padded)."""
        self.documents: Documents | None = None
        """The packed documents of the current call's whole sequences (None: one sequence a row)."""
        self.keeps_documents = False
        """Whether every attention of the model keeps a packed row's documents apart (transformers attention
        modules: :mod:`.attention`); packed calls are refused otherwise."""
        self.share: torch.Tensor | None = None
        """This rank's share of the current call's counted target tokens; None where the model's loss is already a
        sum over the whole count (``num_items_in_batch``)."""
        self.pending = False

    def check_positions(self, model: nn.Module) -> None:
        """A one-line error when ``model`` cannot be told the global positions of a slice."""
        if self.positions is None:
            raise ConfigError(no_positions(model))

    def chunks(self, length: int) -> tuple[int, ...]:
        """Where this rank's pieces of a sequence of ``length`` tokens start, in the order it holds them (each
        ``length // pieces`` long)."""
        size = length // self.pieces
        if not self.balanced:
            return (self.rank * size,)
        return (self.rank * size, (self.pieces - 1 - self.rank) * size)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``t`` along the sequence (dimension 1): its pieces, in :meth:`chunks`' order."""
        size = t.shape[1] // self.pieces
        return torch.cat([t.narrow(1, start, size) for start in self.chunks(t.shape[1])], dim=1).contiguous()

    def counted_share(self, target: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``target``'s counted tokens (:func:`~paratrain.batch.counted`)."""
        return counted(self.local(target)) / counted(target).clamp(min=1)

    def whole_loss(self, loss: torch.Tensor, share: torch.Tensor | None) -> torch.Tensor:
        """The loss over every token of the cp group from this rank's ``loss``: its mean weighted by ``share``, or
        (None) already a sum over the whole count; summed over the group with autograd."""
        if type(loss) is not torch.Tensor and hasattr(loss, "full_tensor"):
            loss = loss.full_tensor()  # a replicated DTensor (tp's vocabulary-split loss)
        if share is not None:
            loss = torch.where(share > 0, loss * share, torch.zeros_like(loss))  # a slice of ignored tokens: 0, not nan
        return wait_tensor(all_reduce(loss, "sum", self.group))  # differentiable: its backward sums the gradients

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """The forward pre-hook: the call's inputs, positions and targets cut to this rank's slice."""
        first = args[0] if args else next((kwargs[k] for k in _FIRST_INPUTS if kwargs.get(k) is not None), None)
        if not isinstance(first, torch.Tensor) or first.dim() < 2:
            raise ConfigError(
                "cp splits the sequence of the model's first input (input_ids, inputs_embeds or the "
                "first positional argument, [batch, seq, ...]); call the model with one"
            )
        length = first.shape[1]
        if length % self.pieces:
            how = " (two a rank, head and tail, for the all-gather's balance)" if self.balanced else ""
            raise ConfigError(
                f"cp={self.ranks} cuts each sequence into {self.pieces} equal slices{how}, but this batch's "
                f"sequences have {length} tokens; pad them to a multiple of {self.pieces}"
            )
        kwargs = {**kwargs, **self.no_cache}
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ConfigError(
                f"cp takes a 2-D attention_mask [batch, seq] (padding) and builds the whole sequence's "
                f"mask itself; got {mask.dim()}-D: pass the padding mask instead"
            )
        self.padding = read_padding(mask, first.device)
        self.share = None
        self.pending = self._targets(args, kwargs, first.device)
        given = kwargs.get(self.positions) if self.positions is not None else None
        if self.positions is not None:
            kwargs[self.positions] = self._positions(given, length, first.device)
        self.documents = self._documents(given, kwargs.get("cu_seq_lens_q"), first.shape[0], length, first.device)

        def split(value: Any) -> Any:  # a tensor along the sequence: this rank's slice of it
            sequence = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length
            return self.local(value) if sequence else value

        return tuple(split(a) for a in args), {k: split(v) for k, v in kwargs.items()}

    def _documents(
        self, given: torch.Tensor | None, cu_seq_lens: torch.Tensor | None, rows: int, length: int, device: torch.device
    ) -> Documents | None:
        """The call's packed documents, found from the positions the call ``given`` for its whole sequences (checked,
        not yet cut) or the collator's ``cu_seq_lens_q``: one host read where either is given."""
        found = read_documents(given, cu_seq_lens, rows, length, device)
        if found is not None and not self.keeps_documents:
            raise ConfigError(
                "packed batch (positions restarting inside a row) under cp, which keeps documents apart in "
                "transformers attention modules and attention kernel modules that take documents= "
                "(packs_documents); pad each document to its own row, or train without cp"
            )
        if found is not None and self.padding is not None:
            raise ConfigError(
                "cp takes a packed batch (position_ids restarting at each document) or a padding mask, not both; "
                "fill a packed row with one more document whose labels are -100 instead of padding it"
            )
        return found

    def _positions(self, given: torch.Tensor | None, length: int, device: torch.device) -> torch.Tensor:
        """The global positions of the call's tokens: none given, ``[1, seq]`` (transformers' ``position_ids``,
        torchtitan's ``positions``: a row broadcast over the batch), cut with the inputs below; a given tensor keeps
        its shape, a 1-D one (``[seq]``) sliced here, ``[batch or 1, seq, ...]`` cut below."""
        if given is None:
            return torch.arange(length, device=device)[None]
        if given.dim() == 1 and given.shape[0] == length:
            return self.local(given[None])[0]
        if given.dim() < 2 or given.shape[1] != length:
            raise ConfigError(
                f"cp cuts {self.positions}= along the sequence as it does the inputs: [seq] or [batch or 1, seq], "
                f"got {list(given.shape)} for sequences of {length} tokens; pass one of those shapes"
            )
        return given

    def _targets(self, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> bool:
        """Prepare the call's loss targets (in ``kwargs``) for the split; whether the call has any."""
        labels = kwargs.get("labels")
        if self.shifts_labels and labels is not None:
            shifted = kwargs.get("shift_labels")
            if shifted is None:
                shifted = nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
            kwargs["labels"] = kwargs["shift_labels"] = shifted
            if kwargs.get("num_items_in_batch") is None:
                kwargs["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum().to(device)
            return True
        target = next((kwargs[k] for k in _TARGETS if kwargs.get(k) is not None), None)
        if target is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            target = args[1]  # nanoGPT's model(x, targets)
        if target is None:
            return False
        self.share = self.counted_share(target)
        return True

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        """The forward hook: the model's own loss replaced by the loss over every token of the cp group."""
        loss = find_loss(out) if self.pending else None
        self.pending = False
        return out if loss is None else _with_loss(out, loss, self.whole_loss(loss, self.share))


def _causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers causal LM, whose loss shifts ``labels=`` itself."""
    if not type(model).__module__.startswith("transformers."):
        return False
    from transformers.loss.loss_utils import ForCausalLMLoss

    return getattr(model, "loss_function", None) is ForCausalLMLoss


def _with_loss(out: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    """``out`` with its loss ``old`` replaced by ``new``."""
    if isinstance(out, torch.Tensor):
        return new
    if isinstance(out, (tuple, list)):
        return type(out)(new if item is old else item for item in out)
    if isinstance(out, Mapping):
        out["loss"] = new  # type: ignore[index]
        return out
    out.loss = new
    return out
