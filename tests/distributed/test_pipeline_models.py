"""``pipeline`` and ``hybrid`` on real models: transformers' GPT-2 (tied head), Llama (GQA, rotary embeddings) and
BERT (an embedding block that adds positions and token types and normalises; a pooled classifier), GPT-2 with PEFT
LoRA adapters in every block (frozen base; cut between the base model's blocks, adapters with them), our GPT (tied
head) and nanoGPT's GPT (tied head; its forward reads its input's shape, ``b, t = idx.size()``, computes its own loss
and keeps only the last position without targets), cut between their blocks, also with each stage tensor-parallel
(``tp=2``:
``pipeline`` at world 4 on a (pp, tp) mesh, ``hybrid`` at world 8 on (dp, pp, tp)); ``hybrid`` replicates its stages
with DDP, shards their optimizer states with ZeRO-1 (``data="zero1"``: each rank steps a share) or shards them with
FSDP; the zero-bubble schedules (``zbv``, ``dualpipev``: two stages per rank in a V; ``interleaved-zb``) with each
engine and with tp. Each equals one plain process
on the same global batches after 3 SGD (momentum) steps, in fp32: measured ≤ 2.4e-7 for our GPT (its default init
gives it larger weights than the transformers models, ≤ 1.2e-8), with or without tp; asserted ≤ 1e-5.

One job per world size runs every case in sequence (importing transformers costs seconds per process).
"""

import pytest

from paratrain.testing import max_abs_diff, spawn

transformers = pytest.importorskip("transformers")

from helpers.pipeline_model_workers import HIDDEN, OWN_LOSS, batches, build, run_cases, serial  # noqa: E402

BOUND = 1e-5
BF16_BOUND = 2e-3  # bf16 autocast rounds each matmul's output; a split matmul rounds its partial sums first
# name, family, strategy, options, accumulate, clip_grad_norm, save -> load -> continue (a name: saved by that
# strategy, loaded by this one). Each family, schedule and engine once where another case does not already prove it:
# BERT's, LoRA's and our GPT's resumes run under hybrid (fsdp, fsdp, zero1) at world 4, hybrid ddp on GPT-2's tied
# head under LoRA, hybrid fsdp with accumulation on nanoGPT's GPT, tp x pp resumes on Llama, clipping on GPT-2's and
# nanoGPT's tied heads.
WORLD2 = [
    ("gpt2 1f1b clip", "gpt2", "pipeline", {"schedule": "1f1b"}, 1, 0.5, False),
    (
        "gpt2 gpipe split_points resume",
        "gpt2",
        "pipeline",
        {"schedule": "gpipe", "split_points": ["transformer.h.1"]},
        1,
        None,
        True,
    ),
    ("llama gpipe accumulate", "llama", "pipeline", {"schedule": "gpipe"}, 2, None, False),
    (
        "llama 1f1b checkpointed",
        "llama",
        "pipeline",
        {"schedule": "1f1b", "activation_checkpointing": True},
        1,
        None,
        False,
    ),
    ("gpt interleaved clip", "gpt", "pipeline", {"schedule": "interleaved-1f1b"}, 1, 0.5, False),
    ("gpt 1f1b compiled", "gpt", "pipeline", {"schedule": "1f1b", "compile": True}, 1, None, False),
    ("gpt2 1f1b resumes a ddp checkpoint", "gpt2", "pipeline", {"schedule": "1f1b"}, 1, None, "ddp"),
    ("sequential split_points", "seq", "pipeline", {"schedule": "1f1b", "split_points": ["3"]}, 1, None, False),
    ("bert 1f1b clip", "bert", "pipeline", {"schedule": "1f1b"}, 1, 0.1, False),
    ("lora 1f1b clip", "lora", "pipeline", {"schedule": "1f1b"}, 1, 0.1, False),
    ("nanogpt 1f1b clip", "nanogpt", "pipeline", {"schedule": "1f1b"}, 1, 0.5, False),
    ("nanogpt gpipe resume", "nanogpt", "pipeline", {"schedule": "gpipe"}, 1, None, True),
    # zero-bubble: a V holds the first and last stage on rank 0, GPT-2's tied weight one tensor there
    ("gpt2 zbv clip", "gpt2", "pipeline", {"schedule": "zbv"}, 1, 0.5, False),
    ("llama dualpipev resume", "llama", "pipeline", {"schedule": "dualpipev"}, 1, None, True),
    ("nanogpt interleaved-zb accumulate", "nanogpt", "pipeline", {"schedule": "interleaved-zb"}, 2, None, False),
]
WORLD4 = [
    (
        "gpt2 hybrid fsdp interleaved clip",
        "gpt2",
        "hybrid",
        {"data": "fsdp", "schedule": "interleaved-1f1b"},
        1,
        0.5,
        False,
    ),
    (
        "llama hybrid ddp gpipe checkpointed",
        "llama",
        "hybrid",
        {"schedule": "gpipe", "activation_checkpointing": True},
        1,
        None,
        False,
    ),
    ("bert hybrid fsdp resume", "bert", "hybrid", {"data": "fsdp"}, 1, None, True),
    ("lora hybrid ddp", "lora", "hybrid", {}, 1, None, False),
    ("lora hybrid fsdp resume", "lora", "hybrid", {"data": "fsdp"}, 1, None, True),
    ("gpt hybrid zero1 resume", "gpt", "hybrid", {"data": "zero1"}, 1, None, True),
    ("gpt2 hybrid zero1 clip", "gpt2", "hybrid", {"data": "zero1"}, 1, 0.5, False),
    ("llama hybrid zero1 accumulate", "llama", "hybrid", {"data": "zero1"}, 2, None, False),
    ("nanogpt hybrid fsdp accumulate", "nanogpt", "hybrid", {"data": "fsdp"}, 2, None, False),
    # zero-bubble: weight gradients by autograd.grad, reduced by FSDP2 (replicate for ddp) at the step's end
    ("llama hybrid ddp zbv", "llama", "hybrid", {"schedule": "zbv"}, 1, None, False),
    ("llama hybrid fsdp dualpipev resume", "llama", "hybrid", {"data": "fsdp", "schedule": "dualpipev"}, 1, None, True),
]
# tp x pp at world 4: every schedule (interleaved: two stages per rank), clipping over tp shards and stages, bitwise
# resumes, accumulation with activation checkpointing
TP4 = [
    ("llama tp interleaved resume", "llama", "pipeline", {"tp": 2, "schedule": "interleaved-1f1b"}, 1, None, True),
    ("gpt2 tp 1f1b clip", "gpt2", "pipeline", {"tp": 2, "schedule": "1f1b"}, 1, 0.5, False),
    ("llama tp gpipe", "llama", "pipeline", {"tp": 2, "schedule": "gpipe"}, 1, None, False),
    ("nanogpt tp interleaved clip", "nanogpt", "pipeline", {"tp": 2, "schedule": "interleaved-1f1b"}, 1, 0.5, False),
    ("llama tp zbv", "llama", "pipeline", {"tp": 2, "schedule": "zbv"}, 1, None, False),
    (
        "llama tp 1f1b accumulate checkpointed",
        "llama",
        "pipeline",
        {"tp": 2, "schedule": "1f1b", "activation_checkpointing": True},
        2,
        None,
        False,
    ),
]
# tp x pp at world 4 under bf16-mixed (compared with one process under autocast) and compiled (inductor's kernels
# round unlike eager's), and a PEFT model whose stages are split by an inferred plan (adapters with their base layers)
LOOSE4 = {
    "gpt tp 1f1b bf16": (("gpt", "pipeline", {"tp": 2, "precision": "bf16-mixed"}, 1, None, False), BF16_BOUND),
    "gpt tp 1f1b compiled": (("gpt", "pipeline", {"tp": 2, "compile": True}, 1, None, False), 5 * BOUND),
    "lora tp auto 1f1b": (("lora", "pipeline", {"tp": 2, "tp_plan": "auto"}, 1, None, False), BOUND),
}
# dp x pp x tp at world 8: the launch of 8 processes on 2 cores is most of its time
WORLD8 = [
    ("gpt hybrid fsdp tp clip", "gpt", "hybrid", {"dp": 2, "data": "fsdp", "tp": 2, "microbatches": 2}, 1, 0.5, False),
    ("gpt hybrid ddp tp", "gpt", "hybrid", {"dp": 2, "data": "ddp", "tp": 2, "microbatches": 2}, 1, None, False),
    (
        "gpt hybrid zero1 tp resume",
        "gpt",
        "hybrid",
        {"dp": 2, "data": "zero1", "tp": 2, "microbatches": 2},
        1,
        None,
        True,
    ),
]
SPLIT_LOGITS = "DTensor(Shard(dim=2),)"
TIED = {
    "gpt2": ("transformer.wte.weight", "lm_head.weight"),
    "gpt": ("wte.weight", "head.weight"),
    "lora": ("base_model.model.transformer.wte.weight", "base_model.model.lm_head.weight"),
    "nanogpt": ("transformer.wte.weight", "lm_head.weight"),
}


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    """hybrid and tp x pp cases in one job."""
    return spawn(run_cases, 4, (WORLD4 + TP4 + [(k, *v[0]) for k, v in LOOSE4.items()],), timeout_s=420)


def check(ranks: list[dict], cases: list[tuple]) -> None:
    for name, family, _, options, accumulate, clip, resume in cases:
        ref = serial(family, accumulate, clip)
        for rank, results in enumerate(ranks):
            got = results[name]
            where = f"{name}, rank {rank}"
            # every rank gathers the whole model under the user's names, equal to one process
            assert max_abs_diff(got["state"], ref["state"]) <= BOUND, where
            assert got["optimizer_once"], where  # every parameter a rank holds is in its optimizer, once
            assert not got["broken"], where  # a tie inside a stage is still one tensor
            assert got["evaluating"], where  # model.eval() reached every stage
            if options.get("data") == "zero1":  # each rank steps (and keeps the states of) its share of its stages
                assert 0 < got["stepped"] < got["trainable"], where
            if family in TIED:  # both stages' copies of a tied weight stayed equal
                a, b = TIED[family]
                assert got["state"][a].equal(got["state"][b]), where
            if clip is not None:  # the tied weight counted once in the global norm
                assert max(abs(x - y) for x, y in zip(got["norms"], ref["norms"])) <= 1e-5, where
                assert min(ref["norms"]) > clip, "the case must clip"
            if resume is True:
                assert max_abs_diff(got["state"], got["uninterrupted"]) == 0.0, where
            else:  # forward only: the plain model's kind of output (a ModelOutput with logits) on every rank
                out, expected = got["output"], ref["output"]
                assert type(out) is type(expected), where
                if isinstance(out, tuple):  # nanoGPT's (logits, None)
                    assert len(out) == len(expected) and out[1:] == expected[1:], where
                    out, expected = out[0], expected[0]
                logits = out.logits if hasattr(out, "logits") else out
                expected = expected.logits if hasattr(expected, "logits") else expected
                assert logits.shape == expected.shape and (logits - expected).abs().max() <= BOUND, where
            if not resume:  # the two-line form: one line naming the verb that runs the schedule's backward
                assert "par.forward_backward(model" in got["two_line"] and "\n" not in got["two_line"], where
        if "tp" in options and not resume and family not in OWN_LOSS:  # the loss got vocabulary-split logits
            assert {s for results in ranks for s in results[name]["seen"]} == {SPLIT_LOGITS}, name
        plain = build(family)  # the gathered state dict loads into the plain model, ties intact
        plain.load_state_dict(ranks[0][name]["state"])
        if family in TIED:
            a, b = TIED[family]
            assert plain.get_parameter(a) is plain.get_parameter(b)


@pytest.mark.launched
def test_pipeline_on_real_models_equals_one_process():
    check(spawn(run_cases, 2, (WORLD2,), timeout_s=150), WORLD2)


@pytest.mark.launched
def test_hybrid_on_real_models_equals_one_process(world4):
    check(world4, WORLD4)


@pytest.mark.launched
def test_tensor_parallel_stages_equal_one_process(world4):
    check(world4, TP4)


@pytest.mark.launched
@pytest.mark.parametrize("name", list(LOOSE4))
def test_tensor_parallel_stages_under_bf16_compile_and_lora(world4, name):
    (family, _, options, accumulate, clip, _), bound = LOOSE4[name]
    ref = serial(family, accumulate, clip, bf16=options.get("precision") == "bf16-mixed")
    for rank, results in enumerate(world4):
        got = results[name]
        assert max_abs_diff(got["state"], ref["state"]) <= bound, f"{name}, rank {rank}"
        assert got["optimizer_once"] and not got["broken"], f"{name}, rank {rank}"
    assert {s for results in world4 for s in results[name]["seen"]} == {SPLIT_LOGITS}, name


@pytest.mark.launched
def test_dp_x_pp_x_tp_equals_one_process():
    check(spawn(run_cases, 8, (WORLD8,), timeout_s=240), WORLD8)


def test_models_that_cannot_be_split_say_why():
    from torch import nn

    from paratrain import ConfigError
    from paratrain.model.stages import plan_stages

    cases = [
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


def test_an_embedding_block_without_the_input_embedding_is_refused_in_one_line():
    """BERT's embedding block holds the input embedding and runs on the first stage; a module before the blocks
    that holds parameters but no input embedding cannot be skipped by later stages, nor run by them."""
    from torch import nn

    from paratrain import ConfigError
    from paratrain.model.stages import plan_stages

    model = build("gpt2")
    model.transformer.add_module("proj", nn.Linear(HIDDEN, HIDDEN))  # registered after the blocks: move it before
    model.transformer._modules = {k: model.transformer._modules[k] for k in ("wte", "proj", "wpe", "drop", "h", "ln_f")}
    with pytest.raises(ConfigError, match=r"transformer.proj \(Linear\) runs before the blocks, holds no input") as e:
        plan_stages(model, 2)
    assert "\n" not in str(e.value)


def test_the_stages_of_a_model_reading_its_inputs_shape_compose_to_the_model():
    """nanoGPT's forward reads its input's shape (``b, t = idx.size()``) and keeps only the last position without
    targets: stage 1 runs it on the token ids, its embedding handing back the received hidden states; stage 0 hands
    on its blocks' output, every position. Together they are the plain model, with targets and without."""
    import torch

    from paratrain.model.stages import LOSS_INPUT, TOKEN_IDS, StageModule, build_stage, plan_stages

    model = build("nanogpt")
    plan = plan_stages(model, 2)
    first, last = (StageModule(build_stage(model, plan, [s]), s, last=s == 1) for s in (0, 1))
    x, y = (t[:4] for t in batches(1))
    hidden = first(x, **{TOKEN_IDS: x})
    assert hidden.shape == (4, x.shape[1], HIDDEN)
    torch.testing.assert_close(last(hidden, **{TOKEN_IDS: x}), model(x)[0], rtol=0, atol=1e-6)
    last(hidden, **{TOKEN_IDS: x, LOSS_INPUT: y})
    torch.testing.assert_close(last.loss, model(x, y)[1], rtol=0, atol=1e-6)
    assert len(last.kind.wrap(hidden)) == 2  # (logits, None), as the plain model returns
