"""The CUDA paths one lent GPU can show (marker `gpu`): world-1 jobs on ``cuda:0`` that still start a group and take
the device's own paths (tests/helpers/gpu_cases.py ``one_gpu``): the current device, the multi-tensor and fused
optimizers, CPU offload with clipping, asynchronous staging, a meta build with ``load_weights``, bf16 autocast.

NCCL refuses two ranks on one GPU, so everything with several ranks is in test_multi_gpu.py.
"""

import pytest
import torch
from helpers.gpu_cases import one_gpu
from helpers.gpu_job import judge, run_job

from paratrain.testing import alive, child_pids, spawn

JOB_S = 300
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.launched,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def world1(tmp_path_factory) -> list[dict]:
    folder = str(tmp_path_factory.mktemp("gpu1"))
    ranks = spawn(run_job, 1, (one_gpu("cuda", folder), "cuda"), timeout_s=JOB_S)
    assert not alive(child_pids())
    return ranks


@pytest.mark.timeout(JOB_S + 60)
@pytest.mark.parametrize("case", one_gpu("cuda", ""), ids=lambda case: case.name)
def test_on_one_gpu(world1, case):
    problems = judge(world1, case)
    assert not problems, "\n".join(problems)
