"""Pretrained weights read straight into a prepared model's shards (``par.load_weights``): a transformers
``save_pretrained`` folder (sharded safetensors with its index), a single safetensors file, a torch state-dict file;
into models built on the meta device or normally, under every kind of layout. Each equals ``load_state_dict`` of the
full file in one process, and a sharded rank reads less than the whole file; so does a ``paratrain export`` of a
checkpoint, read into zero3 at world 2. Refusals are one line."""

from __future__ import annotations

import pytest
import torch
from helpers.cli import run_cli
from helpers.weights_workers import run_weights_cases
from helpers.zoo import ZOO
from safetensors.torch import save_file

from paratrain.checkpoint.weights import load_weights
from paratrain.errors import CheckpointError
from paratrain.testing import max_abs_diff, spawn


def pretrained(model_name: str) -> torch.nn.Module:
    """The zoo model with weights unlike its init: what a checkpoint holds."""
    model = ZOO[model_name].build()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    gpt2 = pretrained("gpt2")
    gpt2.save_pretrained(root / "gpt2", max_shard_size="20KB")  # several files and model.safetensors.index.json
    assert (root / "gpt2" / "model.safetensors.index.json").exists()
    pretrained("llama").save_pretrained(root / "llama")
    save_file({k: v.contiguous() for k, v in pretrained("bert").state_dict().items()}, root / "bert.safetensors")
    torch.save(pretrained("nanogpt").state_dict(), root / "nanogpt.pt")
    return {
        "gpt2": str(root / "gpt2"),
        "llama": str(root / "llama"),
        "bert": str(root / "bert.safetensors"),
        "nanogpt": str(root / "nanogpt.pt"),
        "gpt2:export": exported(root),
    }


def exported(root) -> str:
    """``paratrain export`` (the command, in its own process) of a checkpoint that ``par.save`` wrote of the
    pretrained GPT-2 (tied head)."""
    import paratrain

    par = paratrain.Parallel("single", monitor=False)
    par.prepare(pretrained("gpt2"))
    saved = par.save(root / "ckpt")
    par.close()
    done = run_cli("export", str(saved), str(root / "gpt2-export.pt"), timeout=300)
    assert done.returncode == 0 and "wrote" in done.stdout, done.stderr
    return str(root / "gpt2-export.pt")


WORLD2 = [
    ("gpt2", "zero3", {}, True),
    ("llama", "zero3", {}, True),
    ("bert", "zero3", {}, True),
    ("nanogpt", "zero3", {}, True),
    ("llama", "tp", {}, True),
    ("gpt2", "tp", {}, True),
    ("gpt2", "pipeline", {}, True),
    ("llama", "ddp", {"precision": "bf16-true"}, True),
    ("nanogpt", "zero2", {}, False),
    ("bert", "ddp", {}, False),
    ("gpt2:export", "zero3", {}, True),
]
WORLD4 = [
    ("llama", "zero3", {"tp": 2}, True),
    ("nanogpt", "zero3", {"tp": 2}, True),
    ("gpt2", "hsdp", {}, True),
    ("llama", "hybrid", {"data": "fsdp"}, True),
]


def _run(files, cases, world):
    return spawn(run_weights_cases, world, ([(m, s, o, files[m], meta) for m, s, o, meta in cases],), timeout_s=600)[0]


@pytest.fixture(scope="module")
def world2(files):
    return _run(files, WORLD2, 2)


@pytest.fixture(scope="module")
def world4(files):
    return _run(files, WORLD4, 4)


def _check(result: dict, model_name: str, options: dict, sharded: bool) -> None:
    assert "error" not in result, result.get("error")
    model_name = model_name.split(":")[0]  # "gpt2:export": the zoo's gpt2, its weights from another file
    expected = pretrained(model_name).state_dict()
    if options.get("precision") == "bf16-true":
        expected = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in expected.items()}
        assert all(v.dtype == expected[k].dtype for k, v in result["state"].items())
    assert max_abs_diff(result["state"], expected) == 0.0
    normal = dict(ZOO[model_name].build().named_buffers())  # init_fn="empty" still computes rotary tables
    for name, value in result["buffers"].items():
        assert torch.equal(value, normal[name].to(value.dtype)), name
    total = sum(v.numel() * v.element_size() for v in pretrained(model_name).state_dict().values())
    if sharded:
        assert max(result["bytes"]) < total, "a rank that holds a shard read the whole model"


def _key(m, s, o, meta):
    return f"{m}/{s}{o or ''}/{'meta' if meta else 'built'}"


@pytest.mark.launched
@pytest.mark.parametrize("m, s, o, meta", WORLD2, ids=[_key(*c) for c in WORLD2])
def test_load_weights_world2_equals_full_load(world2, m, s, o, meta):
    _check(world2[_key(m, s, o, meta)], m, o, sharded=s not in ("ddp",))


@pytest.mark.launched
@pytest.mark.parametrize("m, s, o, meta", WORLD4, ids=[_key(*c) for c in WORLD4])
def test_load_weights_world4_equals_full_load(world4, m, s, o, meta):
    _check(world4[_key(m, s, o, meta)], m, o, sharded=True)


def test_base_model_checkpoint_loads_into_the_model_with_a_head(tmp_path):
    source = pretrained("gpt2")
    source.transformer.save_pretrained(tmp_path / "base")  # keys without the "transformer." prefix
    model = ZOO["gpt2"].build()
    load_weights(model, tmp_path / "base")
    assert max_abs_diff(model.state_dict(), source.state_dict()) == 0.0


def _refused(path, model_name="llama") -> str:
    with pytest.raises(CheckpointError) as err:
        load_weights(ZOO[model_name].build(), path)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.launched
def test_bad_weights_are_one_line(files, tmp_path):
    assert "lacks" in _refused(files["bert"])  # another model's file
    state = pretrained("llama").state_dict()
    save_file({**state, "extra.weight": torch.zeros(2)}, tmp_path / "extra.safetensors")
    assert "holds 1 tensor(s) the model has not: extra.weight" in _refused(tmp_path / "extra.safetensors")
    wrong = {k: (torch.zeros(3, 3) if k == "lm_head.weight" else v) for k, v in state.items()}
    save_file(wrong, tmp_path / "shape.safetensors")
    assert "lm_head.weight [3, 3] in the file" in _refused(tmp_path / "shape.safetensors")
    whole = (tmp_path / "extra.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[: len(whole) // 2])
    assert "truncated" in _refused(tmp_path / "cut.safetensors")
    torch.save(state, tmp_path / "whole.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:5000])
    assert "truncated" in _refused(tmp_path / "cut.pt")
    assert "no weights at" in _refused(tmp_path / "absent")
