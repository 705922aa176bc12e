"""``pipeline`` and ``hybrid`` on real models: transformers' GPT-2 (tied head) and Llama (GQA, rotary
embeddings), and our GPT (tied head), cut between their blocks. Each equals one plain process on the same global
batches after 3 SGD (momentum) steps, in fp32: measured ≤ 2.4e-7 (our GPT's default init gives it larger
weights than the transformers models, ≤ 1.2e-8), asserted ≤ 1e-5.

One job per world size runs every case in sequence (importing transformers costs seconds per process).
"""
import pytest

from paratrain.testing import max_abs_diff, spawn

transformers = pytest.importorskip("transformers")

from pipeline_model_workers import build, run_cases, serial  # noqa: E402

BOUND = 1e-5
# name, family, strategy, options, accumulate, clip_grad_norm, save -> load -> continue (a name: saved by that
# strategy, loaded by this one)
WORLD2 = [
    ("gpt2 1f1b clip", "gpt2", "pipeline", {"schedule": "1f1b"}, 1, 0.5, False),
    ("gpt2 gpipe split_points resume", "gpt2", "pipeline",
     {"schedule": "gpipe", "split_points": ["transformer.h.1"]}, 1, None, True),
    ("llama gpipe accumulate", "llama", "pipeline", {"schedule": "gpipe"}, 2, None, False),
    ("llama 1f1b checkpointed", "llama", "pipeline", {"schedule": "1f1b", "activation_checkpointing": True}, 1, None,
     False),
    ("gpt interleaved clip", "gpt", "pipeline", {"schedule": "interleaved-1f1b"}, 1, 0.5, False),
    ("gpt 1f1b resume", "gpt", "pipeline", {"schedule": "1f1b"}, 1, None, True),
    ("gpt 1f1b compiled", "gpt", "pipeline", {"schedule": "1f1b", "compile": True}, 1, None, False),
    ("gpt2 1f1b resumes a ddp checkpoint", "gpt2", "pipeline", {"schedule": "1f1b"}, 1, None, "ddp"),
    ("sequential split_points", "seq", "pipeline", {"schedule": "1f1b", "split_points": ["3"]}, 1, None, False),
]
WORLD4 = [
    ("gpt2 hybrid ddp", "gpt2", "hybrid", {}, 1, None, False),
    ("gpt2 hybrid fsdp interleaved clip", "gpt2", "hybrid", {"data": "fsdp", "schedule": "interleaved-1f1b"}, 1,
     0.5, False),
    ("llama hybrid fsdp", "llama", "hybrid", {"data": "fsdp"}, 1, None, False),
    ("llama hybrid ddp gpipe checkpointed", "llama", "hybrid", {"schedule": "gpipe", "activation_checkpointing": True},
     1, None, False),
    ("gpt hybrid fsdp accumulate", "gpt", "hybrid", {"data": "fsdp"}, 2, None, False),
    ("gpt hybrid fsdp resume", "gpt", "hybrid", {"data": "fsdp"}, 1, None, True),
]
TIED = {"gpt2": ("transformer.wte.weight", "lm_head.weight"), "gpt": ("wte.weight", "head.weight")}


def check(world: int, cases: list[tuple]) -> None:
    ranks = spawn(run_cases, world, (cases,), timeout_s=150)
    for name, family, _, _, accumulate, clip, resume in cases:
        ref = serial(family, accumulate, clip)
        for rank, results in enumerate(ranks):
            got = results[name]
            where = f"{name}, rank {rank}"
            # every rank gathers the whole model under the user's names, equal to one process
            assert max_abs_diff(got["state"], ref["state"]) <= BOUND, where
            assert got["optimizer_once"], where  # every parameter a rank holds is in its optimizer, once
            assert not got["broken"], where      # a tie inside a stage is still one tensor
            assert got["evaluating"], where      # model.eval() reached every stage
            if family in TIED:                   # both stages' copies of a tied weight stayed equal
                a, b = TIED[family]
                assert got["state"][a].equal(got["state"][b]), where
            if clip is not None:                 # the tied weight counted once in the global norm
                assert max(abs(x - y) for x, y in zip(got["norms"], ref["norms"])) <= 1e-5, where
                assert min(ref["norms"]) > clip, "the case must clip"
            if resume is True:
                assert max_abs_diff(got["state"], got["uninterrupted"]) == 0.0, where
            else:  # forward only: the plain model's kind of output (a ModelOutput with logits) on every rank
                out = got["output"]
                assert type(out) is type(ref["output"]), where
                logits = out.logits if hasattr(out, "logits") else out
                expected = ref["output"].logits if hasattr(ref["output"], "logits") else ref["output"]
                assert (logits - expected).abs().max() <= BOUND, where
        plain = build(family)  # the gathered state dict loads into the plain model, ties intact
        plain.load_state_dict(ranks[0][name]["state"])
        if family in TIED:
            a, b = TIED[family]
            assert plain.get_parameter(a) is plain.get_parameter(b)


def test_pipeline_on_real_models_equals_one_process():
    check(2, WORLD2)


def test_hybrid_on_real_models_equals_one_process():
    check(4, WORLD4)


def test_models_that_cannot_be_split_say_why():
    from torch import nn
    from transformers import BertConfig, BertForSequenceClassification

    from paratrain import ConfigError
    from paratrain.model.stages import plan_stages

    bert = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                    intermediate_size=64, vocab_size=64))
    cases = [
        (bert, {}, "bert.embeddings \\(BertEmbeddings\\) runs before the blocks"),
        (nn.Linear(4, 4), {}, "no repeated blocks"),
        (build("gpt2"), {"split_points": ["transformer.wpe"]}, "are not blocks of GPT2LMHeadModel"),
        (build("gpt2"), {"split_points": ["transformer.h.3", "transformer.h.1"]}, "does not fit"),
        (build("llama", layers=2), {}, None),
    ]
    for model, options, message in cases:
        if message is None:
            with pytest.raises(ConfigError, match="needs at least 3 blocks for 3 stages"):
                plan_stages(model, 3)
            continue
        with pytest.raises(ConfigError, match=message) as err:
            plan_stages(model, 2 if "split_points" not in options else len(options["split_points"]) + 1, **options)
        assert "\n" not in str(err.value)


def test_peft_models_are_refused_in_one_line():
    peft = pytest.importorskip("peft")
    from paratrain import ConfigError
    from paratrain.model.stages import plan_stages

    lora = peft.get_peft_model(build("gpt2"), peft.LoraConfig(r=4, target_modules=["c_attn"]))
    with pytest.raises(ConfigError, match="cannot split the PEFT model .*merge the adapters"):
        plan_stages(lora, 2)
