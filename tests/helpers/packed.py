"""Packed batches on transformers models: documents of uneven lengths packed by transformers'
``DataCollatorWithFlattening`` (one row per replica, ``position_ids`` restarting at each document, -100 labels at
each document's first token), trained under a strategy, against one plain process that runs each document as a
row of its own and divides the summed loss by the real tokens of the global batch.

The replicas hold different numbers of real tokens, so a loss averaged per replica would differ from the reference;
the attention of a document that saw its neighbours would too.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

import paratrain
from helpers.zoo import HIDDEN, VOCAB, _quiet_transformers, _sgd, llama
from paratrain.workloads.gpt import GPT

STEPS, DOCS = 3, 3
MODELS = ("llama", "qwen2", "qwen3", "mixtral")


def _qwen(kind: str) -> nn.Module:
    import transformers

    _quiet_transformers()
    torch.manual_seed(0)
    config = getattr(transformers, f"{kind.capitalize()}Config")(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return getattr(transformers, f"{kind.capitalize()}ForCausalLM")(config)


def mixtral() -> nn.Module:
    """A tiny Mixtral: 4 experts, top 2, no router auxiliary loss (its load-balancing term is a replica's own,
    not the global batch's)."""
    import transformers

    _quiet_transformers()
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=False,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return transformers.MixtralForCausalLM(config)


def gpt() -> nn.Module:
    """paratrain's GPT: learned positions (restarting with each document), a tied head, a loss_fn over its logits."""
    from paratrain.workloads.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(layers=2, hidden=HIDDEN, heads=2, seq_len=32, vocab=VOCAB))


def gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A script's loss over the logits: the mean over the targets (-100: none, a document's last token)."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class OwnLossGPT(nn.Module):
    """paratrain's GPT computing its own loss from ``model(x, y)`` (nanoGPT's way): a mean over one replica's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = gpt()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor) -> tuple:
        logits = self.gpt(idx, positions=positions)
        return logits, gpt_loss(logits, targets)


BUILD = {
    "gpt": gpt,
    "gpt_own": OwnLossGPT,
    "llama": llama,
    "qwen2": functools.partial(_qwen, "qwen2"),
    "qwen3": functools.partial(_qwen, "qwen3"),
    "mixtral": mixtral,
}


def documents(step: int, replica: int) -> list[list[int]]:
    """Replica ``replica``'s documents at ``step``: ``DOCS`` of 2 to 9 tokens, so replicas hold uneven counts; an
    even total, as tp's sequence parallelism asks of a row."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    lengths = torch.randint(2, 9, (DOCS,), generator=g).tolist()
    lengths[-1] += sum(lengths) % 2
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def packed(docs: list[list[int]], multiple: int = 1) -> dict[str, torch.Tensor]:
    """The documents as transformers' flattening collator packs them, the row filled up to a length ``multiple``
    divides (cp's pieces) with one more document that holds no targets (labels -100)."""
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d} for d in docs])
    fill = -batch["input_ids"].shape[1] % multiple
    if not fill:
        return batch
    extra = {
        "input_ids": torch.zeros(1, fill),
        "labels": torch.full((1, fill), -100),
        "position_ids": torch.arange(fill),
    }
    return {k: torch.cat([v, extra[k].view(1, fill).to(v.dtype)], dim=1) for k, v in batch.items()}


def rows_of(step: int, replica: int, rows: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """Replica ``replica``'s batch at ``step``: one collated row, or (a pipeline's micro-batches) ``rows`` rows,
    row ``i`` holding ``documents(step, rows * replica + i)``, each filled to the longest with one-token documents
    (position 0, no target: they change no loss or gradient); a length ``multiple`` divides (:func:`packed`)."""
    if rows == 1:
        return packed(documents(step, replica), multiple)
    found = [packed(documents(step, rows * replica + i), multiple) for i in range(rows)]
    width = max(row["input_ids"].shape[1] for row in found)
    fill = {"input_ids": 0, "labels": -100, "position_ids": 0}
    return {k: torch.cat([F.pad(row[k], (0, width - row[k].shape[1]), value=fill[k]) for row in found]) for k in fill}


def alone_loss(model: nn.Module, docs: list[list[int]]) -> torch.Tensor:
    """Each document as a row of its own: the summed next-token loss over the real tokens, divided by their count."""
    total = 0.0
    for doc in docs:
        ids = torch.tensor([doc])
        logits = model(ids) if isinstance(model, GPT) else model(input_ids=ids).logits
        total = total + F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
    return total / sum(len(d) - 1 for d in docs)


@functools.cache
def reference(model_name: str, replicas: int) -> dict[str, torch.Tensor]:
    """One process: ``STEPS`` SGD steps, each on every replica's documents, each document alone. Read, never
    change: cached for every case of a model."""
    model = BUILD[model_name]()
    opt = _sgd(model)
    for s in range(STEPS):
        alone_loss(model, [d for r in range(replicas) for d in documents(s, r)]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_packed(model_name: str, strategy: str, options: dict, folder: str, multiple: int = 1) -> dict:
    """``STEPS`` steps of packed batches under ``strategy``, each row filled up to a length ``multiple`` divides;
    the full state dict (``folder`` unused: no resume)."""
    par = paratrain.Parallel(strategy, monitor=False, **options)
    model = BUILD[model_name]()
    model, opt = par.prepare(model, _sgd(model))
    rows = options.get("microbatches", 1)
    for s in range(STEPS):
        with par.step(model, opt):
            batch = {k: v.to(par.device) for k, v in rows_of(s, par.data_parallel_rank, rows, multiple).items()}
            if model_name.startswith("gpt"):  # next-token targets, aligned (-100 past each document's end)
                target = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
                loss_fn = gpt_loss if model_name == "gpt" else None
                par.forward_backward(model, batch["input_ids"], target, loss_fn, positions=batch["position_ids"])
            else:
                par.forward_backward(model, batch)
    state = par.full_state_dict(model, rank0_only=False)
    par.close()
    return {"state": state, "resumed": 0.0, "problems": []}
