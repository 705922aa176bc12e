"""``export --format hf`` in one process: what ``save_pretrained`` writes (a tied weight once, the config), loaded by
``from_pretrained`` to the same logits and by ``load_weights`` to the same tensors; bad input is one line. The
layouts (zero3 x tp at world 4, ep at world 2) are cases of tests/checkpoint/test_checkpoint_dist.py's jobs."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.cli import in_process
from helpers.hf_export_workers import same_as_pretrained
from helpers.zoo import SPECS
from torch import nn

import paratrain
from paratrain.checkpoint import export
from paratrain.checkpoint.hf import shard_plan
from paratrain.checkpoint.weights import load_weights
from paratrain.errors import CheckpointError, ConfigError


def tied_llama() -> nn.Module:
    """The zoo's Llama with its head tied to the embedding (GPT-2's and many small models' choice)."""
    from transformers import LlamaForCausalLM

    config = SPECS["llama"].build().config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def trained(build, folder, steps: int = 2) -> dict[str, torch.Tensor]:
    """``steps`` AdamW steps of the model ``build`` makes, in one process, saved to ``folder``: its state dict."""
    par = paratrain.Parallel("single", monitor=False)
    model = build()
    model, opt = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        with par.step(model, opt):
            par.backward(model(x, labels=x).loss)
    par.save(folder)
    state = {k: v.detach().clone() for k, v in par.unwrap(model).state_dict().items()}
    par.close()
    return state


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tied")
    state = trained(tied_llama, folder / "ckpt")
    info = export(folder / "ckpt", folder / "hf", format="hf", shard_bytes=2**14)
    return folder, state, info


def test_a_tied_llama_exports_as_save_pretrained_writes_it(tied):
    folder, state, info = tied
    out = folder / "hf"
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.embed_tokens.weight" in weight_map and "lm_head.weight" not in weight_map  # a tie, written once
    assert set(weight_map) == set(state) - {"lm_head.weight"} and len(set(weight_map.values())) > 1  # shards
    assert info["tensors"] == len(weight_map) and info["step"] == 2
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (out / "generation_config.json").is_file()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary folder left
    same_as_pretrained(out, tied_llama, state)


def test_the_cli_writes_the_folder(tied, tmp_path):
    code, err = in_process(["export", "--format", "hf", str(tied[0] / "ckpt"), str(tmp_path / "hf")])
    assert code == 0, err
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) == 1  # 5 GiB shards by default


def test_load_weights_of_the_export_equals_the_trained_model(tied):
    folder, state, _ = tied
    model = tied_llama()
    load_weights(model, folder / "hf")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_a_mixtral_is_written_per_expert_and_read_back_fused(tmp_path):
    """transformers 5 fuses Mixtral's experts into 3-D tensors on load; the hub's files hold one matrix per expert."""
    build = SPECS["mixtral"].build
    state = trained(build, tmp_path / "ckpt", steps=1)
    export(tmp_path / "ckpt", tmp_path / "hf", format="hf")
    names = set(json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names and not any("gate_up" in n for n in names)
    same_as_pretrained(tmp_path / "hf", build, state)
    model = build()
    load_weights(model, tmp_path / "hf")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_bad_input_is_one_line(tied, tmp_path):
    folder, _, _ = tied
    with pytest.raises(CheckpointError, match="exists; a Hugging Face export goes into a new folder"):
        export(folder / "ckpt", folder / "hf", format="hf")
    with pytest.raises(ConfigError, match="unknown export format 'onnx'; choose one of pt, hf"):
        export(folder / "ckpt", tmp_path / "x", format="onnx")
    par = paratrain.Parallel("single", monitor=False)
    par.prepare(nn.Linear(2, 2))
    par.save(tmp_path / "plain")
    par.close()
    with pytest.raises(ConfigError, match="holds no Hugging Face config .* give --config DIR"):
        export(tmp_path / "plain", tmp_path / "out", format="hf")
    with pytest.raises(CheckpointError, match=r"is not the LlamaForCausalLM its config describes \(it lacks"):
        export(tmp_path / "plain", tmp_path / "out", format="hf", config=folder / "hf")
    assert not (tmp_path / "out").exists()
    code, err = in_process(["export", "--format", "hf", str(tmp_path / "plain"), str(tmp_path / "out")])
    assert code != 0 and "give --config DIR" in err and len(err.strip().splitlines()) == 1


def test_a_config_transformers_refuses_to_write_leaves_the_save_whole(tmp_path):
    """save_pretrained refuses generation settings in a model's config; the job's save goes on without the config."""
    model = SPECS["llama"].build()
    model.config.temperature = 0.5
    par = paratrain.Parallel("single", monitor=False)
    par.prepare(model)
    with pytest.warns(UserWarning, match="holds no Hugging Face config: transformers refuses to write it"):
        folder = par.save(tmp_path / "ckpt")
    par.close()
    assert not (folder / "hf-model").exists()
    with pytest.raises(ConfigError, match="give --config DIR"):
        export(folder, tmp_path / "hf", format="hf")


def test_a_torch_without_the_writer_is_one_line(tied, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    monkeypatch.delattr(dcp, "HuggingFaceStorageWriter")
    with pytest.raises(ConfigError, match=r"needs torch >= 2\.9 .* or export --format pt"):
        export(tied[0] / "ckpt", tmp_path / "hf", format="hf")


def test_shards_are_cut_before_the_limit():
    state = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(16), "d": torch.zeros(1)}
    assert shard_plan(state, 32) == {"a": 1, "b": 1, "c": 2, "d": 3}  # 16+16 fit; c alone is over the limit
