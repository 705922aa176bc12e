"""``tp_plan="auto"``: a tensor-parallel plan inferred for a transformer paratrain has no plan for.

The model's repeated blocks (:mod:`paratrain.model.structure`) are read for the same pattern the built-in plans
write by hand (:mod:`.plans`): in each block, attention's query/key/value projections (separate, or one fused
projection) column-split and its output projection row-split; the MLP's up (and gate) projections column-split
and its down projection row-split; the token embedding and the output head split over the vocabulary, a tie kept.
Counts the attention module keeps for its reshapes (``n_head``, ``num_heads``, ``n_embd``, ``split_size`` ...) are
divided by the degree on every rank; ``head_dim`` stays. Layers are found by their usual names and checked by
their shapes; attention without such names is the module around an attention kernel's call (DeepSeek-V3's latent
attention: its latent projection stays whole, the layers it feeds split with the heads). Each shape of block (a
dense first block, then mixtures of experts, whose routed experts stay whole on every rank) is read on its own, and
every split of a block is tried on one process before it is kept (:mod:`.probe`): what does not compute what the
unsplit block computes stays replicated, and the plan's warning says so on every rank. No sequence parallelism:
the norms and the residual stream stay whole on every rank, which asks nothing of the model's code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ...errors import ConfigError
from ...model.experts import find_expert_layers
from ...model.facts import ModelFacts
from ...model.structure import Blocks, find_blocks, outer_modules
from ...model.ties import Ties, find_ties
from . import names
from .adapters import inside_lora, is_lora, plain_lora_base, with_adapters
from .block_splits import NO_MLP, attention_splits, int_attribute, layer_names, mlp_splits
from .names import style
from .plans import TPPlan, has_plan, matches, plan_for
from .probe import Split, block_call, dims, evaluating, token_readers, verify


def choose_plan(
    model: nn.Module,
    user: Mapping[str, str | ParallelStyle] | str | None,
    degree: int | None,
    facts: ModelFacts | None = None,
) -> TPPlan:
    """The plan a job over ``degree`` tp ranks uses: inferred for ``user="auto"``, and for a model with no plan
    when the user gave none; else :func:`~.plans.plan_for`'s (the user's, the model's own, the built-in one)."""
    if isinstance(user, str) and user != "auto":
        raise ConfigError(f"tp_plan must be 'auto' or a dict of module-name patterns to styles, not {user!r}")
    if user == "auto" or (user is None and not has_plan(model)):
        if degree is None:
            raise ConfigError("tp_plan='auto' infers a plan for a tp degree; give tp=N")
        return infer_plan(model, degree, facts)
    return plan_for(model, user)  # type: ignore[arg-type]


def infer_plan(model: nn.Module, degree: int, facts: ModelFacts | None = None) -> TPPlan:
    """The plan ``tp_plan="auto"`` gives ``model`` over ``degree`` ranks (see the module docstring); a one-line
    ``ConfigError`` when attention's heads do not divide by ``degree`` or nothing can be split."""
    kind = type(model).__name__
    blocks = facts.blocks if facts is not None else find_blocks(model)
    ties = facts.ties if facts is not None else find_ties(model)
    styles: dict = {}
    said: list[str] = []
    whole: list[str] = []
    sizes: dict[str, int] = {}
    vocab, head = _vocabulary(model, blocks, ties, styles, said, whole)
    around = len(whole)
    adjust: list[tuple[str, str]] = []
    if blocks is None:
        whole.append("no repeated blocks found")
    else:
        with evaluating(model):
            adjust = _split_blocks(model, blocks, degree, vocab, styles, said, whole, sizes)
    if head is not None:  # after the blocks' entries, as the model runs them
        styles[head] = names.head()
    if not styles:
        raise ConfigError(
            f"tp_plan='auto' found nothing in {kind} it can split safely ({'; '.join(whole)}); give a "
            "tp_plan={'layers.*.mlp.up': 'colwise', 'layers.*.mlp.down': 'rowwise', ...}"
        )
    summary = (
        f"paratrain: tp_plan='auto' for {kind} over tp={degree} (no sequence parallelism):",
        *(f"  {line}" for line in said),
        *(f"  replicated: {w}" for w in [*whole, "everything else"]),
    )
    left = whole[around:]
    warning = (
        f"tp_plan='auto' for {kind} over tp={degree} leaves whole on every rank (no memory saved, no "
        f"compute split there): {'; '.join(left)}; give tp_plan= to split them"
        if left
        else None
    )
    return TPPlan(
        name=f"tp_plan='auto' for {kind}",
        styles=styles,
        summary=summary,
        divisible=lambda m: dict(sizes),
        adjust=lambda m, d: _adjust(m, adjust, d),
        warning=warning,
    )


def _vocabulary(
    model: nn.Module, blocks: Blocks | None, ties: Ties, styles: dict, said: list[str], whole: list[str]
) -> tuple[int, str | None]:
    """Split the token embedding over the vocabulary; returns the vocabulary size (for the probe's token ids) and
    the output head to split with it (both when they are tied, or neither), which the plan names after the
    blocks."""
    before, after = outer_modules(model, blocks) if blocks is not None else ([""], [])
    wrappers = {n for n, m in model.named_modules() if is_lora(m)}
    embeddings = {
        n: m
        for n, m in _under(model, before)
        if isinstance(m, nn.Embedding) and n not in wrappers and not inside_lora(n, wrappers)
    }
    if not embeddings:
        whole.append("no token embedding before the blocks")
        return 2, None
    linears = [(n, m) for n, m in _under(model, after) if isinstance(m, nn.Linear)]
    embedding = _token_embedding(model, blocks, embeddings, linears, ties)
    vocab = embeddings[embedding].num_embeddings
    tied = {g for group in ties.groups for g in group}
    heads = [n for n, m in linears if m.out_features == vocab]
    head = next((n for n in heads if f"{n}.weight" in tied), heads[-1] if heads else None)
    pair = {f"{embedding}.weight"} | ({f"{head}.weight"} if head else set())
    partners = {name for group in ties.groups if pair & set(group) for name in group}
    if partners - pair:
        whole.append(f"{embedding}{' and ' + head if head else ''} (tied to {sorted(partners - pair)[0]})")
        return vocab, None
    styles[embedding] = style("rowwise")
    said.append(f"{embedding} -> rowwise (vocabulary)")
    if head is not None:
        tie = f"; tied to {embedding}" if f"{head}.weight" in tied else ""
        said.append(f"{head} -> colwise (vocabulary, logits left split for the loss{tie})")
    return vocab, head


def _token_embedding(
    model: nn.Module,
    blocks: Blocks | None,
    embeddings: dict[str, nn.Embedding],
    linears: list[tuple[str, nn.Linear]],
    ties: Ties,
) -> str:
    """The embedding that holds the vocabulary, found by what it is rather than by its size (a character-level
    model's position table is larger than its vocabulary): the one tied to a layer after the blocks; else, among
    those that look up the model's own token ids, one as large as a layer's output after the blocks, else the
    largest."""
    by_weight = {f"{n}.weight": n for n in embeddings}
    after = {f"{n}.weight" for n, _ in linears}
    for group in ties.groups:
        tied = [by_weight[g] for g in group if g in by_weight]
        if tied and after & set(group):
            return tied[0]
    fed = token_readers(model, embeddings, blocks.modules(model)[0] if blocks is not None else None)
    pool = [n for n in embeddings if n in fed] if fed else list(embeddings)
    outputs = {m.out_features for _, m in linears}
    sized = [n for n in pool if embeddings[n].num_embeddings in outputs]
    return max(sized or pool, key=lambda n: embeddings[n].num_embeddings)


def _under(model: nn.Module, names: Iterable[str]) -> list[tuple[str, nn.Module]]:
    out = []
    for name in names:
        prefix = f"{name}." if name else ""
        out.extend((f"{prefix}{n}" if n else name, m) for n, m in model.get_submodule(name).named_modules())
    return out


def _split_blocks(
    model: nn.Module,
    blocks: Blocks,
    degree: int,
    vocab: int,
    styles: dict,
    said: list[str],
    whole: list[str],
    sizes: dict[str, int],
) -> list[tuple[str, str]]:
    """Find attention and the MLP in the first block of each shape (DeepSeek-V3's dense first block, then mixtures
    of experts), keep each split the probe confirms, and give the patterns for every block; returns the (module
    pattern, attribute) pairs to divide by the degree."""
    pattern = f"{blocks.container}.*" if blocks.container else "*"
    shapes = _shapes(model, blocks)
    found = []
    experts = []
    for group in shapes:
        where = pattern if len(shapes) == 1 else _label(blocks, group)
        found.append((group, _split_block(model, group[0], degree, vocab, where, whole, sizes)))
        routed = _experts(model.get_submodule(group[0]))
        experts.extend(f"{where}.{n}: whole on every rank (routed experts)" for n in routed)
    adjust: list[tuple[str, str]] = []
    for group, (entries, owners) in found:
        for entry in entries:
            name, spec, why = entry
            for key in _keys(model, pattern, found, group, name, lambda f, e=entry: e in f[0]):
                if key not in styles:
                    styles[key] = style(spec)
                    said.append(f"{key} -> {spec} ({why})")
        for owner, attr in owners:
            for key in _keys(model, pattern, found, group, owner, lambda f, o=(owner, attr): o in f[1]):
                if (key, attr) not in adjust:
                    adjust.append((key, attr))
    said.extend(experts)
    if adjust:
        said.append(f"per rank, divided by {degree}: {', '.join(f'{o}.{a}' for o, a in adjust)}")
    return adjust


Found = tuple[list[tuple[str, str, str]], list[tuple[str, str]]]
"""What one shape of block splits: (layer name in the block, style, why) and (module, attribute) to divide."""


def _shapes(model: nn.Module, blocks: Blocks) -> list[tuple[str, ...]]:
    """The blocks grouped by shape (their parameters' names and sizes), in model order."""
    groups: dict[tuple, list[str]] = {}
    for name in blocks.names:
        shape = tuple((n, tuple(p.shape)) for n, p in model.get_submodule(name).named_parameters())
        groups.setdefault(shape, []).append(name)
    return [tuple(names) for names in groups.values()]


def _label(blocks: Blocks, names: tuple[str, ...]) -> str:
    """``layers.{1,2}``: some of the blocks, as messages name them."""
    if len(names) == 1:
        return names[0]
    prefix = f"{blocks.container}." if blocks.container else ""
    return f"{prefix}{{{','.join(n.removeprefix(prefix) for n in names)}}}"


def _keys(
    model: nn.Module,
    pattern: str,
    found: list[tuple[tuple[str, ...], Found]],
    names: tuple[str, ...],
    name: str,
    chosen: Callable[[Found], bool],
) -> list[str]:
    """The plan's keys for ``name`` in the blocks ``names``: one pattern for every block where each block holding
    such a module splits it alike, else one key per block."""
    holding = [f for blocks_, f in found if _holds(model.get_submodule(blocks_[0]), name)]
    if all(chosen(f) for f in holding):
        return [f"{pattern}.{name}" if name else pattern]
    return [f"{n}.{name}" if name else n for n in names]


def _holds(block: nn.Module, name: str) -> bool:
    try:
        block.get_submodule(name)
    except AttributeError:
        return False
    return True


def _split_block(
    model: nn.Module,
    name: str,
    degree: int,
    vocab: int,
    where: str,
    whole: list[str],
    sizes: dict[str, int],
) -> Found:
    """Attention's and the MLP's splits in the block ``name`` that the probe confirms (``where`` names the blocks of
    its shape in messages); the routed experts of a mixture stay whole on every rank, and a mixture with no dense
    MLP beside them (no shared expert) is no MLP left whole."""
    block = model.get_submodule(name)
    layers = _layers(block)
    kept = sorted(n for n, m in block.named_modules() if is_lora(m) and plain_lora_base(m) is None)
    if kept:
        whole.append(
            f"{where}.{kept[0]}{f' and {len(kept) - 1} more' if len(kept) > 1 else ''} (a LoRA variant "
            "such as DoRA: only plain LoRA layers are split)"
        )
    call = block_call(model, block, vocab)
    attention = attention_splits(block, layers, degree, where, sizes, call)
    taken = set() if isinstance(attention, str) else {n for s in attention for n in s.layers()}
    hidden = None if isinstance(attention, str) else dims(layers[attention[0].rows[0]])[1]  # type: ignore[index]
    mlp = mlp_splits({n: m for n, m in layers.items() if n not in taken}, hidden, degree)
    chosen: list[tuple[str, Split]] = []
    for what, variants in (("attention", attention), ("MLP", mlp)):
        if not isinstance(variants, str):
            variants = [with_adapters(block, v) for v in variants]
        if variants == NO_MLP and _experts(block):
            continue  # a mixture's routed experts, whole by design (said with the plan)
        if isinstance(variants, str):
            whole.append(f"{where} {what} ({variants})")
        elif isinstance(call, str):
            whole.append(f"{where} {what} (a split cannot be checked: {call})")
        elif None in (reasons := [verify(block, v, degree, *call) for v in variants]):
            chosen.append((what, variants[reasons.index(None)]))
        else:
            whole.append(f"{where} {what} ({layer_names(variants[0])}: {reasons[0]})")
    if len(chosen) == 2 and not isinstance(call, str):
        why = verify(block, chosen[0][1] + chosen[1][1], degree, *call)
        if why is not None:
            whole.append(f"{where} MLP (with attention split too: {why})")
            chosen.pop()
    entries: list[tuple[str, str, str]] = []
    owners: list[tuple[str, str]] = []
    for what, split in chosen:
        entries.extend(
            (n, f"fused_colwise({parts})" if parts > 1 else "colwise", what) for n, parts in split.columns.items()
        )
        entries.extend((n, "rowwise", what) for n in split.rows)
        for n in split.heads:
            why = "fed by a latent," if n in layers else "its per-head parameters"
            entries.append((n, "heads", f"{what}: {why} split with the heads"))
        for names_, spec, why in (
            (split.summed, "replicate(grad=sum)", "sees this rank's heads"),
            (split.latent, "replicate(output_grad=sum)", "its output read by every rank's heads"),
        ):
            entries.extend((n, spec, f"{what}: {why}") for n in names_)
        owners.extend((owner, attr) for owner, attr in split.adjust)
    return entries, owners


def _experts(block: nn.Module) -> list[str]:
    """The block's routed experts (:func:`~paratrain.model.experts.find_expert_layers`: stacked per-expert weights
    called with the router's choice), by name in the block."""
    return [layer.name for layer in find_expert_layers(block)]


def _layers(block: nn.Module) -> dict[str, nn.Module]:
    """The block's linear layers by name; a PEFT LoRA layer stands for its base layer (its adapters are split with
    it: :mod:`.adapters`), and what is inside any LoRA layer is not a layer of its own."""
    modules = dict(block.named_modules())
    wrappers = {n for n, m in modules.items() if n and is_lora(m)}
    layers = {}
    for name, module in modules.items():
        layer = plain_lora_base(module) if name in wrappers else module
        if name and not inside_lora(name, wrappers) and layer is not None and dims(layer) is not None:
            layers[name] = layer
    return layers


def _adjust(model: nn.Module, adjust: list[tuple[str, str]], degree: int) -> None:
    """Divide the counts the split attention modules read by ``degree`` (on a pipeline stage, in the blocks it
    holds)."""
    for pattern, attr in adjust:
        for name, module in model.named_modules():
            if matches(pattern, name) and int_attribute(module, attr) is not None:
                setattr(module, attr, getattr(module, attr) // degree)
