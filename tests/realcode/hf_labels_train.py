"""A transformers fine-tuning script as users write it, ported to ``Parallel``, for the real-code suite.

The model is built on the meta device from its config, laid out by the strategy, and filled by ``par.load_weights``
from a sharded ``save_pretrained`` folder (each rank reads its part); it computes its own loss from ``labels=`` (or
GPT-2's pre-shifted ``shift_labels=``), through ``par.forward_backward`` or ``model(...).loss`` and
``par.backward``; batches are drawn without a DataLoader, the global batch alike on every rank and this replica's
share kept; it evaluates on every rank and the full state is taken at the end.

Run as a script (``paratrain run -n 2 hf_labels_train.py WEIGHTS_DIR OUT_DIR CASES_JSON``) it trains each case in
turn on one process group; :func:`train` runs one case (one process: the reference, there built normally and loaded
with ``from_pretrained``).
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

import paratrain

VOCAB, SEQ, PER_REPLICA, STEPS = 64, 16, 4, 2  # two AdamW steps: the second reads the first's state
GLOBAL_BATCH = 8


def config(family: str):
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def model_class(family: str):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return GPT2LMHeadModel if family == "gpt2" else LlamaForCausalLM


def save_weights(family: str, folder: str) -> None:
    """What a downloaded checkpoint would be: a sharded safetensors folder with its index."""
    torch.manual_seed(0)
    model_class(family)(config(family)).save_pretrained(folder, max_shard_size="40KB")


def batch(step: int, replica: int, replicas: int, micro: int | None = 0) -> torch.Tensor:
    """This replica's token ids of micro-step ``micro`` of ``step``: the global batch drawn alike on every rank, cut
    into micro-steps of ``replicas`` shares (``micro=None``: an evaluation batch of the same size, in one step)."""
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    if micro is None:
        return ids.view(replicas, -1, SEQ)[replica]
    return ids.view(-1, replicas, PER_REPLICA, SEQ)[micro, replica]


def train(
    family: str, strategy: str, options: dict, weights: str, *, labels: str = "labels", in_forward_backward: bool = True
) -> dict:
    """One run; rank 0's result holds the losses and the final full state dict."""
    if strategy == "single":  # the reference: built and loaded the ordinary way
        par = paratrain.Parallel(
            "single", monitor=False, accumulate=paratrain.GlobalBatch(GLOBAL_BATCH, micro=PER_REPLICA)
        )
        model = model_class(family).from_pretrained(weights, torch_dtype=torch.float32)
        model, optimizer = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    else:
        par = paratrain.Parallel(
            strategy,
            monitor=False,
            model=paratrain.ModelConfig(init_fn="empty"),
            accumulate=paratrain.GlobalBatch(GLOBAL_BATCH, micro=PER_REPLICA),
            **options,
        )
        with torch.device("meta"):
            model = model_class(family)(config(family))
        model, optimizer = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        par.load_weights(model, weights)
    losses = []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(par.accumulate):
            ids = batch(step, par.data_parallel_rank, par.data_parallel_size, micro).to(par.device)
            keyword = {"labels": ids}
            if labels == "shift_labels":  # pre-shifted, as a split sequence needs them
                keyword["shift_labels"] = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
            with par.step(model, optimizer):
                if in_forward_backward:
                    loss = par.forward_backward(model, ids, **keyword)
                else:
                    loss = model(input_ids=ids, **keyword).loss
                    par.backward(loss)
            step_loss += float(loss) / par.accumulate
        losses.append(float(par.mean(step_loss)))  # the global batch's mean loss
    model.eval()
    with torch.no_grad():  # evaluation on every rank: the model's own loss, read as a one-process script reads it
        ids = batch(99, par.data_parallel_rank, par.data_parallel_size, None).to(par.device)
        eval_loss = float(par.mean(model(ids, labels=ids).loss))
    result = {"losses": losses, "eval": eval_loss, "accumulate": par.accumulate, "state": par.full_state_dict(model)}
    par.close()
    return result


def main(weights_dir: str, out_dir: str, cases: list[dict]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for case in cases:
        try:
            results[case["name"]] = train(
                case["family"],
                case["strategy"],
                case.get("options", {}),
                os.path.join(weights_dir, case["family"]),
                labels=case.get("labels", "labels"),
                in_forward_backward=case.get("forward_backward", True),
            )
        except paratrain.ParatrainError as err:
            results[case["name"]] = {"error": str(err)}
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
