"""Every layout users run, on 2 and 4 GPUs over NCCL (marker `gpu`): each case equal to one process on the same
global batch, and every rank's parameters, gradients, optimizer state and current device on ``cuda:LOCAL_RANK``.

One launched job per world size runs every case (tests/helpers/gpu_job.py, the cases in tests/helpers/gpu_cases.py);
a world needing more GPUs than the machine has is skipped, saying how many it found.
"""

import pytest
import torch
from helpers.gpu_cases import layouts
from helpers.gpu_job import judge, run_job

from paratrain.testing import alive, child_pids, spawn

GPUS = torch.cuda.device_count()  # 0 without CUDA
JOB_S = 540
pytestmark = [pytest.mark.gpu, pytest.mark.launched]


def _job(world: int, folder: str) -> list[dict]:
    if GPUS < world:
        pytest.skip(f"needs {world} CUDA GPUs, this machine has {GPUS}")
    ranks = spawn(run_job, world, (layouts(world, "cuda", folder), "cuda"), timeout_s=JOB_S)
    assert not alive(child_pids())
    return ranks


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return _job(2, str(tmp_path_factory.mktemp("gpu2")))


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> list[dict]:
    return _job(4, str(tmp_path_factory.mktemp("gpu4")))


@pytest.mark.timeout(JOB_S + 60)
@pytest.mark.parametrize("case", layouts(2, "cuda", ""), ids=lambda case: case.name)
def test_on_two_gpus(world2, case):
    problems = judge(world2, case)
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(JOB_S + 60)
@pytest.mark.parametrize("case", layouts(4, "cuda", ""), ids=lambda case: case.name)
def test_on_four_gpus(world4, case):
    problems = judge(world4, case)
    assert not problems, "\n".join(problems)
