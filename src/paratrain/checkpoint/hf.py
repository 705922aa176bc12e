"""A checkpoint's model in Hugging Face's format: safetensors shards, ``model.safetensors.index.json``, ``config.json``
(and ``generation_config.json``), loadable with ``from_pretrained``; and the way back into any layout.

The names are what ``save_pretrained`` writes: the plain model's, a tied weight once (under the name transformers
keeps), and weights transformers converts on load written in the hub's layout (Mixtral's fused 3-D experts as one
tensor per expert), by transformers' own reverse conversion. The config travels with the checkpoint: a save writes a
transformers model's config into ``hf-model/`` of the checkpoint folder (``hf-model_1/`` for a second model…); a
model of another kind needs ``config=`` (a folder with ``config.json``). torch's ``HuggingFaceStorageWriter`` writes
the files.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError

CONFIG_FILES = ("config.json", "generation_config.json")
SHARD_BYTES = 5 * 2**30
"""The default largest shard (what ``save_pretrained`` wrote by default before transformers 5)."""


def config_folder(folder: Path, model: int) -> Path:
    """Where a save puts model ``model``'s Hugging Face config inside checkpoint ``folder``."""
    return folder / ("hf-model" if model == 0 else f"hf-model_{model}")


def transformers_model(module: nn.Module) -> Any | None:
    """``module`` if it is a transformers ``PreTrainedModel`` (never importing transformers for other models)."""
    if not any(c.__module__.startswith("transformers.") for c in type(module).__mro__):
        return None
    from transformers import PreTrainedModel

    return module if isinstance(module, PreTrainedModel) else None


def write_config(module: nn.Module, folder: Path) -> None:
    """Write a transformers model's ``config.json`` (and ``generation_config.json``) into ``folder``; nothing for
    another model. ``architectures`` names the user's class, not a wrapper's (FSDP makes ``FSDPLlamaForCausalLM``)."""
    model = transformers_model(module)
    if model is None:
        return
    config = copy.deepcopy(model.config)
    config.architectures = [next(c for c in type(model).__mro__ if not c.__module__.startswith("torch.")).__name__]
    generation = getattr(model, "generation_config", None)
    try:
        config.save_pretrained(folder)
        if generation is not None and model.can_generate():
            generation.save_pretrained(folder)
    except (ValueError, TypeError) as err:  # what save_pretrained refuses too (generation settings in the config)
        shutil.rmtree(folder, ignore_errors=True)
        warnings.warn(
            f"this checkpoint holds no Hugging Face config: transformers refuses to write it ({_first(err)}); "
            "export --format hf will need --config DIR",
            stacklevel=2,
        )


def writer_class() -> type:
    """torch's ``HuggingFaceStorageWriter``, or a one-line error on a torch without it (before 2.9)."""
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
    except ImportError:
        raise ConfigError(
            f"export --format hf needs torch >= 2.9 (its HuggingFaceStorageWriter); this is torch {torch.__version__}: "
            "upgrade torch, or export --format pt"
        ) from None
    return HuggingFaceStorageWriter


def skeleton(config_dir: Path) -> Any:
    """The model ``config_dir``'s ``config.json`` describes, on the meta device (no memory): what names, ties and
    conversions the export follows."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(config_dir))
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read a Hugging Face config from {config_dir} ({_first(err)})") from None
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise ConfigError(
            f"{config_dir / 'config.json'} names no transformers model class in 'architectures' ({names}); "
            'write the class there, e.g. ["LlamaForCausalLM"]'
        )
    with torch.device("meta"):
        return cls._from_config(config)


def hub_state(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """``state`` (the plain model's names, full tensors) as ``save_pretrained`` writes it for ``model``: a tied weight
    once, keys transformers ignores on save dropped, converted weights back in the hub's layout."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    expected = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    _check_names(state, model, expected)
    first: dict[int, str] = {}
    state = dict(state)
    for name, t in expected.items():  # a tie shares one tensor, so that transformers sees it and keeps one name
        if name in state:
            state[name] = state[first.setdefault(id(t), name)]
    state = remove_tied_weights_from_state_dict(state, model)
    for key in model._keys_to_ignore_on_save or []:
        state.pop(key, None)
    return {k: v.contiguous() for k, v in revert_weight_conversion(model, state).items()}


def _check_names(state: dict[str, torch.Tensor], model: Any, expected: dict[str, torch.Tensor]) -> None:
    persistent = {n for n in model.state_dict()}
    missing = sorted(persistent - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        problem = f"it lacks {_few(missing)}" if missing else f"it has {_few(unexpected)}, which the config's has not"
        raise CheckpointError(
            f"the checkpoint's model is not the {type(model).__name__} its config describes ({problem}); "
            "pass --config with the model's own config folder"
        )


def shard_plan(state: dict[str, torch.Tensor], limit: int) -> dict[str, int]:
    """Each tensor's file (1, 2, …): in order, a new file once ``limit`` bytes would be passed (a larger tensor gets a
    file of its own), as ``save_pretrained``'s ``max_shard_size`` cuts."""
    plan, index, size = {}, 1, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > limit:
            index, size = index + 1, 0
        plan[name] = index
        size += nbytes
    return plan


def write_folder(state: dict[str, torch.Tensor], out: Path, config_dir: Path, limit: int) -> None:
    """Write ``state`` (hub names) as safetensors shards with their index, and the config files, into the new folder
    ``out``: first into a hidden sibling, then renamed, so a failed export leaves nothing that looks complete."""
    from torch.distributed.checkpoint import save

    writer = writer_class()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save(state, storage_writer=writer(str(tmp), fqn_to_index_mapping=shard_plan(state, limit)), no_dist=True)
        for name in CONFIG_FILES:
            if (config_dir / name).is_file():
                shutil.copyfile(config_dir / name, tmp / name)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass(frozen=True)
class Derived:
    """A model tensor transformers builds on load from several hub tensors (a fused expert tensor from each expert's
    matrices): the hub keys it needs, and how to build it from a reader of them."""

    keys: tuple[str, ...]
    build: Callable[[Callable[[str], torch.Tensor]], torch.Tensor]


def hub_tensors(
    module: nn.Module, shapes: dict[str, tuple[int, ...]], wanted: Iterable[str]
) -> tuple[dict[str, str], dict[str, tuple[Derived, tuple[int, ...]]]]:
    """For a transformers model and the ``wanted`` names a file of hub tensors of ``shapes`` lacks: those that
    transformers' load conversion renames (model name → hub key), and those it builds from several hub tensors, each
    with its shape (the conversion run on meta tensors). Nothing for another model."""
    model = transformers_model(module)
    if model is None:
        return {}, {}
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming, rename_source_key

    transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    wanted = set(wanted)
    renamed: dict[str, str] = {}
    groups: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    for key in sorted(shapes):
        target, pattern = rename_source_key(key, renamings, converters)
        if pattern is not None:
            groups.setdefault(target, (by_pattern[pattern], []))[1].append((key, pattern))
        elif target in wanted:
            renamed[target] = key
    derived: dict[str, tuple[Derived, tuple[int, ...]]] = {}
    for target, (converter, sources) in groups.items():
        convert = _conversion(model, converter, target, sources)
        keys = tuple(k for k, _ in sources)
        try:
            meta = convert(lambda k: torch.empty(shapes[k], device="meta"))
        except (RuntimeError, NotImplementedError, ValueError):  # a conversion meta tensors cannot run: left missing
            continue
        for name in wanted & set(meta):
            derived[name] = (Derived(keys, lambda read, c=convert, n=name: c(read)[n]), tuple(meta[name].shape))
    return renamed, derived


def _conversion(
    model: Any, converter: Any, target: str, sources: list[tuple[str, str]]
) -> Callable[[Callable[[str], torch.Tensor]], dict[str, torch.Tensor]]:
    """One group of hub tensors through transformers' converter: every model tensor it makes, by name, from a reader
    of the hub tensors."""

    def convert(read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        conversion = copy.deepcopy(converter)
        for key, pattern in sources:
            conversion.add_tensor(target, key, pattern, lambda k=key: read(k))
        return conversion.convert(target, model=model, config=model.config)

    return convert


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _first(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
