"""Materialize a model built on the meta device: each rank allocates only what it holds (its shard, its stage, its
tensor-parallel slice) and fills it with the values the model's own initialization gives.

Why a replay: a model built on ``meta`` has shapes but no values, and after sharding each rank holds pieces of
tensors. Running ``reset_parameters`` on a shard would draw other random numbers than the full tensor gets in one
process, so the result would depend on the layout. Instead the *init program* (what a normal build runs) is replayed
on a pristine meta copy of the model, one module at a time: the tensors one module's init touches are swapped for
full-size scratch tensors, the init runs exactly as in one process (same order, same random stream), and each
rank keeps only the slices it holds. Peak memory is a rank's share plus the largest module's tensors outside the
repeated blocks (or one block), never the whole model.

The program, by what the model offers:

* ``init_fn`` given: ``init_fn(module)`` on every module, children first, as ``model.apply(init_fn)`` calls it.
* a transformers model: its construction's random draws (replayed on scratch, so the stream advances as a normal
  build's does), then its own ``initialize_weights`` (``_init_weights`` per module; rotary tables and position ids
  are recomputed there).
* any other model: ``reset_parameters()`` of every module that has one, in registration order, as their
  constructors ran it.

A tied tensor keeps the value its first owner (``named_parameters``' first name: the embedding) gives it: the
other owners' inits draw into throw-away tensors, as a normal build's head drew into its own weight before
``tie_weights`` replaced it. A tensor no init writes is refused, naming it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ConfigError
from .structure import find_blocks

InitFn = Callable[[nn.Module], None]
EMPTY = "empty"
"""``init_fn=EMPTY``: allocate without initializing, for weights loaded next (``par.load_weights``)."""


def is_meta(model: nn.Module) -> bool:
    """True when any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from (b for b in model.buffers() if b is not None)


@dataclass
class Materializer:
    """Fills the meta tensors of a prepared model (or one pipeline stage of it) on ``device``."""

    skeleton: nn.Module
    """A meta copy of the user's model, taken before any wrapping: the init program runs on it."""
    device: torch.device
    init_fn: InitFn | str | None = None
    rng_state: torch.Tensor = field(default_factory=torch.get_rng_state)
    """The random state ``prepare`` found, where the model's build left it: every replay starts from it."""
    canonical: dict[str, str] = field(default_factory=dict)
    """Every name of every tensor → the name its value is kept under (a tie's first name)."""
    buffers: set[str] = field(default_factory=set)
    """The buffers' names."""

    @classmethod
    def of(cls, model: nn.Module, device: torch.device, init_fn: InitFn | str | None = None) -> Materializer | None:
        """A materializer for ``model`` when it has meta tensors (None otherwise; ``init_fn`` then is refused)."""
        if not is_meta(model):
            if init_fn is not None:
                raise ConfigError(
                    "init_fn initializes a model built on the meta device, but this model's tensors are "
                    "already allocated; build it under `with torch.device('meta'):` or drop init_fn"
                )
            return None
        if not all(t.is_meta for t in _tensors(model)):
            real = next(n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta)
            raise ConfigError(
                f"the model is partly on the meta device ({real!r} is not): build all of it under "
                "`with torch.device('meta'):` (or none of it)"
            )
        skeleton = copy.deepcopy(model)
        canonical: dict[str, str] = {}
        for kind in (skeleton.named_parameters, skeleton.named_buffers):
            first: dict[int, str] = {}
            for name, t in kind(remove_duplicate=False):
                canonical[name] = first.setdefault(id(t), name)
        if isinstance(init_fn, str) and init_fn != EMPTY:
            raise ConfigError(f"init_fn must be a function of a module or {EMPTY!r}, got {init_fn!r}")
        return cls(
            skeleton=skeleton,
            device=device,
            init_fn=init_fn,
            canonical=canonical,
            buffers={n for n, _ in skeleton.named_buffers(remove_duplicate=False)},
        )

    def __call__(self, module: nn.Module) -> nn.Module:
        """Allocate ``module``'s tensors on the device and write the init program's values into them."""
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)  # keep the Parameter objects an optimizer holds
        try:
            module.to_empty(device=self.device)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)
        held: dict[str, list[torch.Tensor]] = {}
        seen: set[int] = set()
        for name, t in [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            held.setdefault(self._user_name(name), []).append(t)
        written = self._replay(held)
        missing = [n for n in held if n not in written and (self.init_fn != EMPTY or n in self.buffers)]
        if missing:
            raise ConfigError(
                f"after building on the meta device nothing initialized {missing[:3]}"
                f"{' …' if len(missing) > 3 else ''}: give their modules a reset_parameters() or "
                "pass init_fn= to Parallel"
            )
        return module

    def _user_name(self, name: str) -> str:
        """The canonical user name of a prepared tensor name (a pipeline stage prefixes ``stage.``)."""
        parts = name.split(".")
        for i in range(len(parts)):
            candidate = ".".join(parts[i:])
            if candidate in self.canonical:
                return self.canonical[candidate]
        raise ConfigError(
            f"the prepared model holds {name!r}, which the model built on the meta device has not; report it"
        )

    def _replay(self, held: dict[str, list[torch.Tensor]]) -> set[str]:
        torch.set_rng_state(self.rng_state)
        names = {id(m): n for n, m in reversed(list(self.skeleton.named_modules(remove_duplicate=False)))}
        writer = _Writer(held, self.canonical, _scopes(self.skeleton), names, params=self.init_fn != EMPTY)
        with torch.no_grad():
            if self.init_fn == EMPTY:  # parameters come from a checkpoint; buffers (rotary tables) are computed
                for m in self.skeleton.modules():
                    if any(b is not None for b in m._buffers.values()):
                        _buffer_init(self.skeleton, m, writer)
            elif callable(self.init_fn):
                init_fn = self.init_fn
                for m in _post_order(self.skeleton):
                    writer.run(m, lambda m=m: init_fn(m), who="init_fn")
            elif _is_transformers(self.skeleton):
                _transformers_init(self.skeleton, writer)
            else:
                for m in self.skeleton.modules():
                    reset = getattr(m, "reset_parameters", None)
                    if callable(reset):
                        writer.run(m, reset, who=f"{type(m).__name__}.reset_parameters")
        return writer.written


def _buffer_init(skeleton: nn.Module, module: nn.Module, writer: _Writer) -> None:
    """Compute ``module``'s buffers as its init does: the transformers model's ``_init_weights`` that owns it, or its
    ``reset_parameters``."""
    owner = None
    for m in skeleton.modules():  # the innermost transformers model holding ``module``
        if _is_transformers(m) and any(sub is module for sub in m.modules()):
            owner = m
    if owner is not None:
        writer.run(module, lambda: owner._init_weights(module), who=f"{type(owner).__name__}._init_weights")
    elif callable(getattr(module, "reset_parameters", None)):
        writer.run(module, module.reset_parameters, who=f"{type(module).__name__}.reset_parameters")


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _is_transformers(model: nn.Module) -> bool:
    return hasattr(model, "initialize_weights") and hasattr(model, "_initialize_weights") and hasattr(model, "config")


def _transformers_init(skeleton: nn.Module, writer: _Writer) -> None:
    """A transformers model's init, exactly as a normal build runs it: every ``_init_weights(module)`` call its
    constructor makes (a sub-model's ``post_init`` runs inside the outer constructor, between other draws), each from
    the random state it started at there, on scratch tensors of the skeleton's module of the same name."""
    events, final = _record_init_calls(skeleton)
    for owner_name, module_name, state in events:
        owner, module = skeleton.get_submodule(owner_name), skeleton.get_submodule(module_name)
        torch.set_rng_state(state)
        writer.run(
            module,
            lambda owner=owner, module=module: owner._init_weights(module),
            who=f"{type(owner).__name__}._init_weights",
        )
    torch.set_rng_state(final)


def _record_init_calls(skeleton: nn.Module) -> tuple[list[tuple[str, str, torch.Tensor]], torch.Tensor]:
    """Build the model once more from its config on meta, its random draws made on scratch CPU tensors so the random
    stream advances as a normal build's does, its weight init enabled (transformers skips it on meta): the
    ``(sub-model, module, random state)`` of every ``_init_weights`` call, and the random state at the end."""
    import sys

    classes = {type(m) for m in skeleton.modules() if _is_transformers(m)}
    calls: list[tuple[nn.Module, nn.Module, torch.Tensor]] = []
    depth = [0]
    saved = {cls: cls.__dict__.get("_init_weights") for cls in classes}

    def recorder(original: Callable) -> Callable:
        def _init_weights(self: nn.Module, module: nn.Module) -> None:
            if depth[0] == 0:
                calls.append((self, module, torch.get_rng_state()))
            depth[0] += 1
            try:
                original(self, module)
            finally:
                depth[0] -= 1

        return _init_weights

    home = sys.modules[next(c for c in type(skeleton).__mro__ if "init_weights" in c.__dict__).__module__]
    device_check = getattr(home, "get_torch_context_manager_or_global_device", None)
    try:
        for cls in classes:
            cls._init_weights = recorder(cls._init_weights)  # type: ignore[method-assign]
        if device_check is not None:
            home.get_torch_context_manager_or_global_device = lambda: None  # type: ignore[attr-defined]
        with torch.device("meta"), _DrawOnScratch():
            replay = type(skeleton)(skeleton.config)
    except Exception as err:  # a composite the config alone does not rebuild
        raise ConfigError(
            f"cannot rebuild {type(skeleton).__name__} from its config to replay its init on the meta "
            f"device ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); pass "
            "init_fn= to Parallel, or init_fn='empty' and load weights"
        ) from None
    finally:
        for cls, fn in saved.items():
            if fn is None:
                del cls._init_weights
            else:
                cls._init_weights = fn  # type: ignore[method-assign]
        if device_check is not None:
            home.get_torch_context_manager_or_global_device = device_check  # type: ignore[attr-defined]
    names = {id(m): n for n, m in reversed(list(replay.named_modules(remove_duplicate=False)))}
    events = [
        (names[id(owner)], names[id(module)], state)
        for owner, module, state in calls
        if id(owner) in names and id(module) in names
    ]
    return events, torch.get_rng_state()


_RANDOM_OPS = frozenset(
    {
        "normal_",
        "uniform_",
        "random_",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "randn",
        "rand",
        "randint",
        "randperm",
        "normal",
        "bernoulli",
        "multinomial",
        "rand_like",
        "randn_like",
        "randint_like",
    }
)


class _DrawOnScratch(TorchDispatchMode):
    """Runs every random op that targets the meta device once more on a CPU tensor of the same shape, so the
    global random stream advances exactly as a build on the CPU would advance it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.__name__.split(".")[0] in _RANDOM_OPS:
            cpu_kwargs = {k: (torch.device("cpu") if k == "device" else _to_cpu(v)) for k, v in kwargs.items()}
            func(*[_to_cpu(a) for a in args], **cpu_kwargs)
        return out


def _to_cpu(x: object) -> object:
    """A meta tensor's CPU stand-in (uninitialized), for a random op to draw into; anything else as it is."""
    return torch.empty(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) and x.is_meta else x


def _scopes(skeleton: nn.Module) -> dict[int, bool]:
    """id(module) → whether its init may touch its whole subtree (True) or only its own tensors: a module above the
    repeated blocks (the root, the blocks' container) gets its own tensors only, so no scratch ever spans the model."""
    blocks = find_blocks(skeleton)
    above: set[int] = set()
    if blocks is not None:
        for name in blocks.names:
            parts = name.split(".")
            above.update(id(skeleton.get_submodule(".".join(parts[:i]))) for i in range(len(parts)))
    return {id(m): id(m) not in above for m in skeleton.modules()}


_UNTOUCHED_INT = -(2**62)


@dataclass
class _Writer:
    """Runs one module's init on scratch tensors and writes what it set into this rank's held tensors."""

    held: dict[str, list[torch.Tensor]]
    canonical: dict[str, str]
    subtree: dict[int, bool]
    module_names: dict[int, str]
    """id(skeleton module) → its qualified name."""
    params: bool = True
    """False: only buffers are written (the parameters come from a checkpoint)."""
    written: set[str] = field(default_factory=set)

    def run(self, module: nn.Module, init: Callable[[], object], who: str) -> None:
        with self._scratch(module, who):
            init()

    @contextmanager
    def _scratch(self, module: nn.Module, who: str) -> Iterator[None]:
        slots = []  # (owner, key, is_param, original, scratch, the name it is kept under or None)
        recurse = self.subtree.get(id(module), False)
        for prefix, owner in module.named_modules(remove_duplicate=False) if recurse else [("", module)]:
            for key, original in [*owner._parameters.items(), *owner._buffers.items()]:
                is_param = key in owner._parameters
                if original is None or not original.is_meta or (is_param and not self.params):
                    continue
                name = self._path(module, prefix, key)
                keep = name if name is not None and self.canonical.get(name) == name else None
                scratch = _blank(original)  # a tie's other owners draw into a scratch of their own, thrown away
                value = nn.Parameter(scratch, requires_grad=original.requires_grad) if is_param else scratch
                (owner._parameters if is_param else owner._buffers)[key] = value
                slots.append((owner, key, is_param, original, value, keep))
        try:
            yield
            for owner, key, is_param, _, value, keep in slots:
                now = (owner._parameters if is_param else owner._buffers)[key]
                if keep is None:
                    continue
                if now is not value:
                    if now is None or now.is_meta:
                        raise ConfigError(
                            f"{who} left {keep!r} on the meta device; it must fill the module's own "
                            "tensors in place (as nn.init.* does)"
                        )
                    value = now
                state = _state(value)
                if state == "untouched":
                    continue
                if state == "partial":
                    raise ConfigError(
                        f"{who} initialized only part of {keep!r}; with a model built on the meta device "
                        "each init must fill a whole tensor (pass init_fn= to Parallel)"
                    )
                self._write(keep, value.detach())
        finally:
            for owner, key, is_param, original, _, _ in slots:
                (owner._parameters if is_param else owner._buffers)[key] = original

    def _path(self, root: nn.Module, prefix: str, key: str) -> str | None:
        base = self.module_names.get(id(root))
        return None if base is None else ".".join(p for p in (base, prefix, key) if p)

    def _write(self, name: str, full: torch.Tensor) -> None:
        self.written.add(name)
        for target in self.held.get(name, ()):
            place(target, full)


def _blank(like: torch.Tensor) -> torch.Tensor:
    """A CPU tensor shaped like ``like`` whose every element says 'not written yet'."""
    if like.dtype.is_floating_point or like.dtype.is_complex:
        return torch.full(like.shape, math.nan, dtype=like.dtype)
    if like.dtype == torch.bool:
        return torch.zeros(like.shape, dtype=like.dtype)
    return torch.full(like.shape, max(_UNTOUCHED_INT, torch.iinfo(like.dtype).min), dtype=like.dtype)


def _state(t: torch.Tensor) -> str:
    """'untouched', 'partial' or 'full', by how many elements still hold ``_blank``'s marker."""
    if t.numel() == 0 or t.dtype == torch.bool:
        return "full"
    if t.dtype.is_floating_point or t.dtype.is_complex:
        blank = torch.isnan(t)
    else:
        blank = t == max(_UNTOUCHED_INT, torch.iinfo(t.dtype).min)
    n = int(blank.sum())
    return "untouched" if n == t.numel() else "partial" if n else "full"


def place(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the part of the full tensor ``full`` that ``target`` holds (all of it, or a DTensor's local slice) into
    ``target``, converting its dtype; no communication. A host tensor is cut where ``target`` lives (left on the
    host, ``distribute_tensor`` would move it to the current device of the mesh's type)."""
    with torch.no_grad():
        if hasattr(target, "device_mesh") and hasattr(target, "placements"):
            from torch.distributed.tensor import distribute_tensor

            local = distribute_tensor(
                full.to(target.device), target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
            target.to_local().copy_(local)
        else:
            target.copy_(full)


def check_materialized(model: nn.Module, strategy: str) -> None:
    """Raise when a prepared model still has meta tensors: its strategy laid it out without materializing it."""
    left = next(
        (n for n, t in [*model.named_parameters(), *model.named_buffers()] if t is not None and t.is_meta), None
    )
    if left is not None:
        raise ConfigError(
            f"strategy {strategy!r} cannot materialize a model built on the meta device ({left!r} is "
            "still on meta); build the model normally, or use a paratrain strategy (ddp, zero3, tp, …)"
        )


def to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)``, except for a model still on the meta device (laid out first, materialized later)."""
    return model if is_meta(model) else model.to(device)
