"""torchtitan's own model files (Llama 3, Qwen3, DeepSeek-V3) under paratrain's layouts, each equal to one process.

The models are torchtitan's, unchanged, built from tiny configs on the CPU (SDPA attention, the for-loop experts);
only their files are imported: the packages' ``__init__`` (its trainer, datasets and Triton kernels) is bypassed, and
``torch.histc`` counts integer indices as CUDA does (CPU's histc takes floats only). Each world size is one launched
job that trains every (model, layout) for ``STEPS`` SGD steps on global batches of ``replicas x PER_RANK`` sequences;
the reference is one plain process on the same global batches. A layout is equal when every parameter ends within
``TOL`` of the reference; a refusal is its one line.

    git clone https://github.com/pytorch/torchtitan && git -C torchtitan checkout v0.2.2
    python benchmarks/torchtitan_layouts.py --torchtitan torchtitan --out torchtitan-layouts.json

torchtitan v0.2.2 imports ``tyro`` and ``torchdata`` at module level: ``pip install tyro torchdata`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

import torch
from torch.nn import functional as F

STEPS, PER_RANK, SEQ, VOCAB = 3, 4, 8, 128
TOL = 2e-5
MODELS = ("llama3", "qwen3", "deepseek_v3")
# (strategy, options, models it applies to: None = all)
WORLD2: list[tuple[str, dict, tuple[str, ...] | None]] = [
    ("ddp", {}, None),
    ("zero3", {}, None),
    ("ddp", {"activation_checkpointing": True}, None),
    ("tp", {}, None),
    ("pipeline", {}, None),
    ("ddp", {"cp": 2}, None),
    ("zero3", {"cp": 2}, None),
    ("ddp", {"ep": 2}, ("deepseek_v3",)),
    ("zero3", {"ep": 2}, ("deepseek_v3",)),
]
WORLD4: list[tuple[str, dict, tuple[str, ...] | None]] = [
    ("zero3", {"tp": 2}, None),
    ("hybrid", {}, None),
    ("zero3", {"cp": 2, "tp": 2}, None),
    ("zero3", {"tp": 2, "ep": 2}, ("deepseek_v3",)),
]


def load_torchtitan(root: str) -> None:
    """Make torchtitan's model files importable from the checkout at ``root`` without its trainer's imports."""
    sys.path.insert(0, root)
    for name in ("torchtitan.models.llama3", "torchtitan.models.deepseek_v3", "torchtitan.models.qwen3"):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = package
    kernels = types.ModuleType("torchtitan.models.moe.kernels")
    kernels.generate_permute_indices = None  # Triton's; the for-loop experts do not use it
    sys.modules["torchtitan.models.moe.kernels"] = kernels
    spec = types.ModuleType("torchtitan.protocols.train_spec")
    sys.modules["torchtitan.protocols.train_spec"] = spec
    from torchtitan.protocols.model import BaseModelArgs, ModelProtocol

    spec.BaseModelArgs, spec.ModelProtocol = BaseModelArgs, ModelProtocol
    histc = torch.histc
    torch.histc = lambda x, *a, **k: histc(x.float(), *a, **k).to(x.dtype)


def _initialised(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        model.init_weights()
    return model


def build(name: str) -> torch.nn.Module:
    """torchtitan's ``name`` from a tiny config, the same weights on every call."""
    torch.manual_seed(0)
    if name == "llama3":
        from torchtitan.models.llama3.model.args import TransformerModelArgs
        from torchtitan.models.llama3.model.model import Transformer

        args = TransformerModelArgs(
            dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=VOCAB, multiple_of=16, max_seq_len=32
        )
        return _initialised(Transformer(args))
    if name == "qwen3":
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
        from torchtitan.models.qwen3.model.model import Qwen3Model

        args = Qwen3ModelArgs(
            dim=64,
            n_layers=2,
            n_heads=8,
            n_kv_heads=4,
            head_dim=8,
            hidden_dim=96,
            vocab_size=VOCAB,
            max_seq_len=32,
            enable_weight_tying=True,
        )
        return _initialised(Qwen3Model(args))
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
    from torchtitan.models.moe import MoEArgs

    moe = MoEArgs(
        num_experts=4,
        num_shared_experts=1,
        top_k=2,
        use_grouped_mm=False,
        score_func="softmax",
        load_balance_coeff=None,
    )
    args = DeepSeekV3ModelArgs(
        vocab_size=VOCAB,
        dim=64,
        inter_dim=96,
        moe_inter_dim=32,
        n_layers=3,
        n_dense_layers=1,
        n_heads=4,
        max_seq_len=32,
        moe_args=moe,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
    )
    args.moe_impl = "standard"  # set by torchtitan's trainer from its job config
    return _initialised(DeepSeekV3Model(args))


def batch(step: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return ids[:, :-1], ids[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)


def reference(name: str, replicas: int) -> dict[str, torch.Tensor]:
    """One process, the global batch of ``replicas x PER_RANK`` as one forward a step."""
    model = build(name)
    opt = optimizer(model)
    for step in range(STEPS):
        x, y = batch(step, replicas * PER_RANK)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(name: str, strategy: str, options: dict) -> dict:
    import paratrain

    par = paratrain.Parallel(strategy, monitor=False, **options)
    try:
        model = build(name)
        model, opt = par.prepare(model, optimizer(model))
        split = tp_split(par.unwrap(model))
        size, rank = par.data_parallel_size, par.data_parallel_rank
        for step in range(STEPS):
            x, y = batch(step, size * PER_RANK)
            x, y = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
            with par.step(model, opt):
                par.forward_backward(model, x.to(par.device), y.to(par.device), loss_fn)
        return {"replicas": size, "tp_split": split, "state": par.full_state_dict(model, rank0_only=False)}
    finally:
        par.close()


def tp_split(model: torch.nn.Module) -> float | None:
    """The share of the blocks' parameters (by elements) that tensor parallelism splits; None without tp."""
    from torch.distributed.tensor import DTensor, Shard

    def split(p: torch.Tensor) -> bool:
        if not isinstance(p, DTensor) or "tp" not in (p.device_mesh.mesh_dim_names or ()):
            return False
        return isinstance(p.placements[p.device_mesh.mesh_dim_names.index("tp")], Shard)

    params = [p for n, p in model.named_parameters() if n.startswith("layers.")]
    if not any(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()) for p in params):
        return None
    return sum(p.numel() for p in params if split(p)) / sum(p.numel() for p in params)


def run_job(root: str, cases: list[tuple[str, str, dict]]) -> dict[str, dict]:
    """Every case of one world size, in one launched job, on one process group (each ``Parallel`` joins it); a case
    that raises is its one line."""
    import torch.distributed as dist

    from paratrain.distributed.process_group import finish_group
    from paratrain.errors import ParatrainError

    load_torchtitan(root)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")

    results = {}
    for name, strategy, options in cases:
        key = f"{name}/{strategy}{options or ''}"
        if os.environ.get("PARATRAIN_CHECK_TRACE"):
            print(f"rank {os.environ.get('RANK')}: {key}", file=sys.stderr, flush=True)
        try:
            results[key] = train(name, strategy, options)
        except ParatrainError as e:
            results[key] = {"error": str(e).splitlines()[0]}
    rank = dist.get_rank()
    finish_group()
    return results if rank == 0 else {}


def cases_for(world: int) -> list[tuple[str, str, dict]]:
    layouts = WORLD2 if world == 2 else WORLD4
    return [(m, s, o) for s, o, only in layouts for m in MODELS if only is None or m in only]


def layout_name(strategy: str, options: dict) -> str:
    parts = [strategy] + [f"{k}={v}" for k, v in options.items()]
    return " ".join(p.replace("activation_checkpointing=True", "checkpointing") for p in parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchtitan", required=True, help="a checkout of pytorch/torchtitan (v0.2.2)")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--out", help="write the table as JSON here")
    parser.add_argument("--only", help="only the layouts whose name contains this")
    args = parser.parse_args()
    root = str(Path(args.torchtitan).resolve())
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    load_torchtitan(root)
    from paratrain.testing import max_abs_diff, spawn

    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        cases = [c for c in cases_for(world) if not args.only or args.only in layout_name(c[1], c[2])]
        print(f"world {world}: {len(cases)} cases in one job", flush=True)
        results = spawn(run_job, world, (root, cases), timeout_s=1200)[0]
        for (name, strategy, options), result in zip(cases, results.values(), strict=True):
            row = {"world": world, "model": name, "layout": layout_name(strategy, options)}
            if "error" in result:
                row.update(verdict="refused", detail=result["error"])
            else:
                diff = max_abs_diff(result["state"], reference(name, result["replicas"]))
                row.update(verdict="equal" if diff <= TOL else "DIFFERS", max_diff=diff)
            rows.append(row)
            if result.get("tp_split") is not None:
                row["tp_split"] = result["tp_split"]
            detail = row.get("detail") or f"max |diff| {row['max_diff']:.1e}"
            if "tp_split" in row:
                detail += f", tp splits {row['tp_split']:.0%} of the blocks' parameters"
            print(f"  {world}  {name:12} {row['layout']:24} {row['verdict']:8} {detail}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
