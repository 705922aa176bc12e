"""One training step of a layout as rank ``r`` of an ``N``-GPU job, on a CPU: ``paratrain dry-run --step``.

What a CPU run cannot show is where tensors live on CUDA: which GPU each rank computes on, which tensors the NCCL
group is handed, how much memory a rank peaks at. This step shows it. In a child process made CUDA-shaped, the
model goes through ``Parallel(accelerator="cuda")`` and ``prepare`` as rank ``r`` (on ``cuda:LOCAL_RANK``), then one
forward, backward, clipped optimizer step, all on torch's fake tensors (``FakeTensorMode``: shapes, devices and
dtypes, no data) over the dry run's fake process group. It fails where a launch would:

* a tensor on another rank's GPU (an op mixing devices raises ``FakeTensorDeviceMismatchError``; FSDP2 refuses a
  parameter not on the current device) or a parameter, gradient or optimizer state off the rank's device;
* the current CUDA device not set to ``LOCAL_RANK`` once the group started (object collectives, FSDP2 and pin
  memory then use GPU 0 on every rank);
* a collective handed a tensor its group cannot take: a CPU tensor on an NCCL-only group ("No backend type
  associated with device type cpu"), a CUDA tensor of another GPU;
* CUDA's default optimizer path (the multi-tensor ``foreach`` one) refusing the parameters (DTensor and plain
  tensors in one group).

The rank's peak memory is measured as torch allocates it (``torch.distributed._tools.mem_tracker.MemTracker``: the
live storages of the fake tensors on the rank's GPU, parameters to activations) over a second step, the steady
state: optimizer states allocated, one-time work done.

CUDA-shaped: a CPU-only torch has no CUDA device guard and no CUDA hooks, and its autograd engine refuses CUDA
tensors. A small C++ library (:data:`SHIM_SOURCE`, compiled once per machine with torch's ``cpp_extension`` and
cached) registers a no-op device guard and hooks that report CUDA present; it must be loaded before torch caches
its hooks, so every step runs in a child process that loads it first and is never used for anything else. The
Python side of ``torch.cuda`` (current device, streams, events) is stood in for there too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import ConfigError
from .model.attention import SDPACall

SHIM_SOURCE = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace at {
// the registry creates the hooks named "CUDAHooks"; these report a CUDA build with devices, and own none
struct CUDAHooks : at::CUDAHooksInterface {
  CUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 64; }
  int getNumGPUs() const override { return 64; }
};
REGISTER_CUDA_HOOKS(CUDAHooks);
}  // namespace at

namespace {
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
}
"""

STEP_TIMEOUT_S = 600.0
_STAGES = (
    "not run: pipeline stages learn their inputs' shapes from each other's messages, which the fake process "
    "group does not carry"
)
_CHILD = (
    "import ctypes, sys; [ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL) for p in sys.argv[1:4]]; "
    "from paratrain.cuda_step import child_main; child_main(sys.argv[4])"
)


@dataclass(frozen=True)
class StepResult:
    """One probed rank's first step: whether it passes (else the error a launch would hit) and its peak bytes."""

    rank: int
    device: str
    passed: bool
    peak: int = 0
    error: str | None = None
    note: str | None = None
    ran: bool = True
    """False where the step cannot run on fake devices (``error`` says why): nothing is known either way."""


def shim_library() -> Path:
    """The compiled shim: built on first use (a child process, so this one stays a CPU process), then cached."""
    name = "paratrain_fake_cuda_" + hashlib.sha256(SHIM_SOURCE.encode()).hexdigest()[:10]
    from torch.utils.cpp_extension import _get_build_directory, is_ninja_available

    folder = Path(_get_build_directory(name, verbose=False))
    library = folder / f"{name}.so"
    if library.exists():
        return library
    if shutil.which(os.environ.get("CXX", "c++")) is None or not is_ninja_available():
        raise ConfigError(
            "dry-run --step compiles a small C++ library once: install a C++ compiler (g++) and "
            "ninja (pip install ninja)"
        )
    build = (
        "import sys; from torch.utils.cpp_extension import load_inline; from paratrain.cuda_step import "
        "SHIM_SOURCE; load_inline(sys.argv[1], cpp_sources=SHIM_SOURCE, is_python_module=False)"
    )
    done = subprocess.run(
        [sys.executable, "-c", build, name], check=False, capture_output=True, text=True, env=_child_env()
    )
    if done.returncode != 0 or not library.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(f"dry-run --step could not compile its C++ library: {tail[0]}")
    return library


def first_steps(specs: list[dict[str, Any]]) -> list[StepResult]:
    """Each spec's rank's first step, in one CUDA-shaped child process (see the module's docstring). A spec:
    ``rank``, ``world``, ``per_node``, ``strategy``, ``options``, ``precision``, ``model``/``model_config``/``input``
    (as ``paratrain dry-run`` takes them), ``batch``, ``seq_len``, ``clip``."""
    libs = Path(torch.__file__).parent / "lib"
    args = [
        sys.executable,
        "-c",
        _CHILD,
        str(libs / "libc10.so"),
        str(libs / "libtorch_cpu.so"),
        str(shim_library()),
        json.dumps(specs),
    ]
    try:
        done = subprocess.run(
            args, check=False, capture_output=True, text=True, timeout=STEP_TIMEOUT_S * len(specs), env=_child_env()
        )
        out, why = done.stdout, f"the step's process died (exit {done.returncode})"
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
    except subprocess.TimeoutExpired as late:
        out, why, tail = late.stdout or "", f"the step's process ran past {late.timeout:.0f} s", ["killed"]
        out = out.decode() if isinstance(out, bytes) else out
    results = [StepResult(**json.loads(line)) for line in out.splitlines() if line.startswith('{"rank"')]
    return results + [
        StepResult(rank=s["rank"], device="?", passed=False, error=f"{why}: {tail[0]}") for s in specs[len(results) :]
    ]


def _child_env() -> dict[str, str]:
    """This process's environment, its import path included (models named ``module:factory``)."""
    paths = [p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def child_main(specs_json: str) -> None:
    """The child's entry: one step per spec, each result as one JSON line."""
    for spec in json.loads(specs_json):
        try:
            result = _step(spec)
        except Exception as err:  # noqa: BLE001  # the step's failure is its result: the error a launch would hit
            text = str(err).strip().splitlines()
            local = spec["rank"] % min(spec["per_node"], spec["world"])
            staged = type(err).__name__ == "PipeliningMetadataError"
            result = StepResult(
                rank=spec["rank"],
                device=f"cuda:{local}",
                passed=False,
                ran=not staged,
                error=_STAGES if staged else f"{type(err).__name__}: {text[0] if text else ''}",
            )
        print(json.dumps(asdict(result)), flush=True)


class _Stand:
    """A stream or event that does nothing: fake tensors have no work to order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:  # done
        return True

    def is_capturing(self) -> bool:  # no CUDA graph
        return False

    def record_event(self, event: _Stand | None = None) -> _Stand:
        return event or _Stand()

    def __getattr__(self, name: str) -> Any:  # wait_stream, wait_event, synchronize, ...: nothing to do
        return lambda *args, **kwargs: None


class FakeCuda:
    """``torch.cuda``'s Python side in the child, with the current device as CUDA keeps it: 0 until set."""

    def __init__(self, count: int, fake: Any) -> None:
        self.current, self.count, self.fake = 0, count, fake

    def set_device(self, device: int | str | torch.device) -> None:
        self.current = device if isinstance(device, int) else torch.device(device).index or 0

    def tensor(self, data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        """``torch.tensor`` on a CUDA device: copied by torch's C++ outside the fake mode, so made here through it."""
        made = _REAL_TENSOR(data, *args, **kwargs)
        return made if device is None else self.fake.from_tensor(made).to(device)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import DeviceMesh
        from torch.nn.parallel import distributed as ddp

        real_rng = torch.random.set_rng_state

        def set_rng_state(state: torch.Tensor) -> None:  # a state broadcast over the fake group has no values
            if not isinstance(state, FakeTensor):
                real_rng(state)

        from torch.distributed.fsdp._fully_shard import _fsdp_init

        real_move = _fsdp_init._move_states_to_device

        def move_states(params: list[torch.Tensor], buffers: list[torch.Tensor], device: torch.device) -> None:
            """FSDP2 moves a plain tensor by ``.data =``, which a fake tensor's device does not follow: swapped
            here as torch swaps a tensor subclass, then FSDP2's own move sees them in place."""
            for t in [*params, *buffers]:
                if isinstance(t, FakeTensor) and t.device not in (device, torch.device("meta")):
                    with torch.no_grad():
                        moved = t.to(device)
                    torch.utils.swap_tensors(
                        t, torch.nn.Parameter(moved, t.requires_grad) if isinstance(t, torch.nn.Parameter) else moved
                    )
            real_move(params, buffers, device)

        def outside_fake(method: Any) -> Any:
            """A device mesh's rank tables are real tensors: made and read outside the fake mode."""

            def run(*args: Any, **kwargs: Any) -> Any:
                with unset_fake_temporarily():
                    return method(*args, **kwargs)

            return run

        c = torch.cuda
        stands = {
            "is_available": lambda: True,
            "device_count": lambda: self.count,
            "set_device": self.set_device,
            "current_device": lambda: self.current,
            "Stream": _Stand,
            "Event": _Stand,
            "current_stream": lambda *a: _Stand(),
            "default_stream": lambda *a: _Stand(),
            "stream": lambda *a: contextlib.nullcontext(),
            "synchronize": lambda *a: None,
            "_lazy_init": lambda: None,
            "is_initialized": lambda: True,
            "get_device_capability": lambda *a: (9, 0),
            "get_device_name": lambda *a: "fake",
            "is_current_stream_capturing": lambda: False,
            # fake tensors draw no random numbers: the generators' states are the host's, never read
            "get_rng_state": lambda *a: _REAL_GET_RNG(),
            "get_rng_state_all": lambda: [_REAL_GET_RNG()],
            **dict.fromkeys(
                ("set_rng_state", "set_rng_state_all", "manual_seed", "manual_seed_all", "seed", "seed_all"),
                lambda *a: None,
            ),
        }
        a = torch.accelerator  # the device-generic spelling of the same calls
        accelerator = {
            "is_available": lambda: True,
            "device_count": lambda: self.count,
            "current_accelerator": lambda *args, **kwargs: torch.device("cuda"),
            **dict.fromkeys(("set_device_index", "set_device_idx"), self.set_device),
            **dict.fromkeys(("current_device_index", "current_device_idx"), lambda: self.current),
            "current_stream": lambda *args, **kwargs: _Stand(),
            "synchronize": lambda *args: None,
        }
        patches = [
            *((c, k, v) for k, v in stands.items()),
            *((a, k, v) for k, v in accelerator.items()),
            (torch, "tensor", self.tensor),
            (torch, "set_rng_state", set_rng_state),
            (torch.random, "set_rng_state", set_rng_state),
            # fake parameters are swapped in place; the fake mode's memo holds weak references to them
            (torch.utils, "weakref", types.SimpleNamespace(getweakrefs=lambda t: [])),
            # DDP reads every rank's parameter shapes in C++: fake tensors hold nothing to read
            (ddp, "_verify_param_shape_across_processes", lambda *a, **k: None),
            (_fsdp_init, "_move_states_to_device", move_states),
            *(
                (DeviceMesh, name, outside_fake(getattr(DeviceMesh, name)))
                for name in ("__init__", "__getitem__", "_flatten", "_unflatten")
            ),
        ]
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
        for obj, name, value in patches:
            setattr(obj, name, value)
        try:
            yield
        finally:
            for obj, name, value in saved:
                setattr(obj, name, value)


_REAL_TENSOR = torch.tensor
_REAL_GET_RNG = torch.get_rng_state

_DATA_SIZED = {  # sized as the most they can hold: every element nonzero, every count below minlength
    torch.ops.aten.nonzero.default: lambda x: torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device),
    torch.ops.aten.bincount.default: lambda x, weights=None, minlength=0: torch.zeros(
        max(minlength, 1), dtype=torch.long if weights is None else weights.dtype, device=x.device
    ),
}


def served(backend: str) -> set[str]:
    """The device types a group started with ``backend`` takes tensors of (``"nccl"``: CUDA alone)."""
    types_ = set()
    for part in backend.split(","):
        device, _, name = part.rpartition(":")
        types_ |= {device} if device else {"cuda"} if name == "nccl" else {"cpu", "cuda"}
    return types_


class PlacementError(RuntimeError):
    """A collective handed a tensor its group cannot take."""


class Placement(TorchDispatchMode):
    """Fails a collective handed a tensor its group cannot take (see the module's docstring) and answers reads of
    a fake tensor's value (``.item()``, ``float(norm)``): the step checks placement, not values."""

    def __init__(self, backend: str, device: torch.device) -> None:
        super().__init__()
        self.backend, self.device = backend, device
        self.guessed = False
        """Whether a value was answered without data (a count, a size): shapes after it may not agree."""
        from torch.distributed._tools.fake_collectives import collective_ops

        self.collectives = collective_ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.guessed = True
            return 1.0 if args[0].dtype.is_floating_point else 1
        if func is torch.ops.aten._pin_memory.default:  # page-locked host memory: host memory to fake tensors
            return torch.empty_like(args[0])
        if isinstance(args[0], FakeTensor) and func in _DATA_SIZED:  # an output sized by values it cannot read
            self.guessed = True
            return _DATA_SIZED[func](*args, **kwargs)
        if func in self.collectives:
            self.check(str(func.overloadpacket), [*args, *kwargs.values()])
        return func(*args, **kwargs)

    def check(self, name: str, args: list[Any]) -> None:
        from torch.utils._pytree import tree_leaves

        for t in (x for x in tree_leaves(args) if isinstance(x, torch.Tensor)):
            if t.device.type not in served(self.backend):
                raise PlacementError(
                    f"{name} sent a {t.device.type} tensor to the job's {self.backend!r} group: No "
                    f"backend type associated with device type {t.device.type}"
                )
            if t.device.type == "cuda" and t.device != self.device:
                raise PlacementError(f"{name} sent a tensor on {t.device} from the rank on {self.device}")


class FusedAttention(TorchFunctionMode):
    """Attention as CUDA runs it: ``scaled_dot_product_attention`` picks a fused kernel there (flash attention for
    half precision without a mask, memory-efficient attention otherwise), which keeps no ``[s, s]`` scores; a
    CPU-only torch would decompose it into the math path and count them. A call the fused kernels cannot take runs
    as it was."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and args[0].device.type == "cuda":
            try:
                return _fused_attention(SDPACall(*args, **kwargs))
            except (RuntimeError, ValueError, TypeError):
                pass
        return func(*args, **kwargs)


def _fused_attention(call: SDPACall) -> torch.Tensor:
    """What a fused CUDA kernel returns for ``call`` (flash attention in half precision without a mask, else
    memory-efficient attention)."""
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = call
    if enable_gqa and key.size(-3) != query.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16):
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[
            0
        ]
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA turns a boolean mask into a bias
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
    )[0]


def _step(spec: dict[str, Any]) -> StepResult:
    """Prepare the model as ``spec``'s rank and take one step on fake CUDA tensors (see the module's docstring)."""
    import torch.distributed as dist
    import torch.distributed.optim  # its optimizers compile with TorchScript: before torch.tensor is stood in for
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from . import session
    from .dry_run.probe import model_builder, model_sample
    from .env import ClusterEnv
    from .loop import finish_step
    from .parallel import Parallel
    from .settings import JobConfig

    rank, world, per_node = spec["rank"], spec["world"], spec["per_node"]
    local = min(per_node, world)
    device = torch.device("cuda", rank % local)
    env = ClusterEnv(rank=rank, local_rank=rank % local, world_size=world, local_world_size=local, launched=True)
    backends: list[str] = []

    def start(
        env: ClusterEnv,
        device: torch.device,
        timeout_s: float,
        needs_group: bool,
        backend: str | None = None,
        alone: bool = False,
    ) -> bool:  # the group the job would start, faked
        backends.append(backend or "nccl")
        dist.init_process_group("fake", store=FakeStore(), rank=env.rank, world_size=env.world_size)
        return False

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    cuda = FakeCuda(local, fake)
    session.start_process_group = start
    with torch.device("meta"):
        model = model_builder(spec.get("model"), spec.get("model_config"))()
    with cuda.installed():
        par = Parallel(
            spec["strategy"],
            job=JobConfig(env=env),
            accelerator="cuda",
            precision=spec["precision"],
            monitor=False,
            **spec["options"],
        )
        try:
            if cuda.current != device.index:
                raise RuntimeError(
                    f"the current CUDA device is cuda:{cuda.current}, not {device}, once the group "
                    "started: object collectives, FSDP2 and pin memory would run on GPU "
                    f"{cuda.current}"
                )
            with fake, Placement(backends[0], device) as placement, FusedAttention():
                model.to_empty(device="cpu")  # as a script builds it, before prepare places it
                optimizer = torch.optim.AdamW(model.parameters(), foreach=True)  # CUDA's default path
                wrapped, optimizer = par.prepare(model, optimizer)
                _fake_group_ddp(wrapped)
                allowed = {device} | ({torch.device("cpu")} if spec["options"].get("cpu_offload") else set())
                call = model_sample(spec.get("model"), spec.get("model_config"), spec.get("input"), spec["seq_len"])
                note = _forward_backward(call, wrapped, spec["batch"], par.device, placement)
                _check_placed(par.strategy.unwrap(wrapped), None, allowed)
                finish_step(par.strategy, wrapped, optimizer, par.precision, spec["clip"])
                _check_placed(par.strategy.unwrap(wrapped), optimizer, allowed)
                # measured on the second step: the optimizer's states exist, and the first step's one-time work
                # (DTensor's sharding propagation runs on fake tensors of the full shapes, then is cached) is done
                tracker = MemTracker()
                tracker.track_external(wrapped, optimizer)
                with tracker:
                    _forward_backward(call, wrapped, spec["batch"], par.device, placement)
                    finish_step(par.strategy, wrapped, optimizer, par.precision, spec["clip"])
            peak = tracker.get_tracker_snapshot("peak").get(device, {}).get("Total", 0)
            return StepResult(rank=rank, device=str(device), passed=True, peak=int(peak), note=note)
        finally:
            dist.destroy_process_group()


def _forward_backward(
    call: Any, wrapped: torch.nn.Module, batch: int, device: torch.device, placement: Placement
) -> str | None:
    """Forward and backward; where the forward's shapes depend on values (a mixture of experts' routing: counts
    decide how many tokens each expert gets, so fake tensors cannot size what follows, or sizes guessed without
    the counts disagree), gradients of the parameters' own placement stand in for backward's, and the note says so
    (the peak then leaves the activations out). A tensor on the wrong device still fails the step."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorDeviceMismatchError,
    )

    placement.guessed = False
    try:
        call.run(wrapped, batch, device)[1].loss.backward()
        return None
    except (PlacementError, FakeTensorDeviceMismatchError):
        raise
    except (RuntimeError, ValueError, IndexError) as err:
        if not (placement.guessed or isinstance(err, (DynamicOutputShapeException, DataDependentOutputException))):
            raise
        for p in wrapped.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        return f"forward skipped ({type(err).__name__}: {err}): the step ran on stand-in gradients"


def _fake_group_ddp(wrapped: torch.nn.Module) -> None:
    """DDP over the fake group: its C++ reducer reads its all-reduce's result from a future the fake group leaves
    empty (the same all-reduce, made in Python so the group's check sees it, fills it); its logger times iterations
    with CUDA events a CPU-only torch has none of, and its second iteration rebuilds its buckets in the order
    every rank's first backward gave, which fake tensors cannot say: both are left out."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(wrapped, DistributedDataParallel):
        return

    def hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP refuses a bucket annotated other than GradBucket
        import torch.distributed as dist

        buffer = bucket.buffer()
        dist.all_reduce(buffer, group=group)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done

    wrapped.register_comm_hook(wrapped.process_group, hook)
    wrapped.logger = _Answering(wrapped.logger, set_runtime_stats_and_log=None)
    wrapped.reducer = _Answering(wrapped.reducer, _rebuild_buckets=False)  # its rebuild reads every rank's order


class _Answering:
    """``target`` with the calls named in ``answers`` answered without it."""

    def __init__(self, target: Any, **answers: Any) -> None:
        self.target, self.answers = target, answers

    def __getattr__(self, name: str) -> Any:
        if name in self.answers:
            return lambda *args, **kwargs: self.answers[name]
        return getattr(self.target, name)


def _check_placed(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, allowed: set[torch.device]) -> None:
    """Raise unless every parameter, gradient and optimizer state (their local shards) sits on an allowed device."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    held = [(f"parameter {n}", p) for n, p in model.named_parameters()]
    held += [(f"gradient of {n}", p.grad) for n, p in model.named_parameters() if p.grad is not None]
    inner = getattr(optimizer, "optim", optimizer)
    for state in inner.state.values() if inner is not None else []:
        held += [(f"optimizer state {k}", v) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim()]
    for what, t in held:
        if local(t).device not in allowed:
            raise RuntimeError(f"{what} is on {local(t).device}, not {' or '.join(map(str, sorted(allowed, key=str)))}")
