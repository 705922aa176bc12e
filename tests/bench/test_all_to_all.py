"""bench on a mixture of experts: the bytes expert parallelism's all-to-all would move in a step, read from the
experts' calls, and the line the report gives its time (timed on 2 ranks in tests/monitor/test_experts.py)."""

import pytest
import torch
from helpers.moe_models import routed_mixtral
from helpers.routing_workers import gpt_experts

from paratrain.bench import BenchConfig, BenchResult, format_report
from paratrain.bench.all_to_all import dispatch_bytes, step_all_to_all
from paratrain.bench.machine import Machine
from paratrain.bench.measure import Block, RankRecord
from paratrain.bench.result import summarise


@pytest.mark.parametrize("build", [routed_mixtral, gpt_experts])
def test_each_moe_layer_dispatches_every_token_once_per_chosen_expert(build):
    """3 samples of 8 tokens, top 2 of width 32 in fp32, per layer (transformers' index and the GPT's counts)."""
    model = build()
    x = torch.randint(0, 64, (3, 8))
    assert dispatch_bytes(model, lambda: model(x)) == [3 * 8 * 2 * 32 * 4] * 2
    assert step_all_to_all(model, lambda: model(x), torch.device("cpu")) is None  # one process: nothing to time


def _record(all_to_all_s):
    return RankRecord(
        label="ddp",
        replicas=2,
        replica_batch=8,
        blocks=[
            Block(step_s=[0.02, 0.02], data_s=[0.0, 0.0], all_to_all_s=s, all_to_all_bytes=2**20) for s in all_to_all_s
        ],
    )


def test_the_report_gives_the_all_to_all_per_step_and_its_share_of_the_step():
    row = summarise("ddp", 2, 1, [_record([0.004, 0.006, 0.005]), _record([0.003, 0.003, 0.003])])
    assert row.all_to_all_ms == pytest.approx(5.0) and row.all_to_all_bytes == 2**20
    text = format_report(
        BenchResult(
            config=BenchConfig(),
            machine=Machine(cores=2, physical_cores=2, gpus=0),
            workload="gpt-moe-tiny",
            rows=[row],
            comparisons=[],
            notes=[],
            versions={"paratrain": "x", "torch": "y"},
            wall_s=1.0,
        )
    )
    assert (
        "ddp x2: expert parallelism's all-to-all (dispatch and combine, forward and backward, as ep over its 2 "
        "ranks would send them; timed with all_to_all_single, not run by the strategy) takes 5.00 ms per step "
        "(25% of the step's time), 1.00MB per rank"
    ) in text
    assert summarise("ddp", 2, 1, [_record([None])]).all_to_all_ms is None
