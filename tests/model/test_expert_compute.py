"""Experts' rows through grouped GEMM or a loop of matmuls (:mod:`paratrain.model.expert_compute`): the same values
and gradients both ways (torch 2.13 has a CPU kernel), grouped GEMM chosen exactly where CUDA has it (fake CUDA
tensors on this CPU build, the capability patched), and neither path reading the device more than the loop must."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F

from paratrain.model import expert_compute
from paratrain.model.expert_compute import count_per_expert, expert_groups, expert_linear, grouped_mm_fits
from paratrain.testing.host_syncs import HostSyncs
from paratrain.workloads.experts import Experts

COUNTS = [3, 0, 5, 2]  # an expert without rows, as routing leaves some


def _both_paths(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> list[tuple[torch.Tensor, ...]]:
    results = []
    for groups in (COUNTS, expert_groups(rows, torch.tensor(COUNTS), grouped=True)):
        r, w = rows.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        b = None if bias is None else bias.detach().clone().requires_grad_()
        out = expert_linear(r, w, groups, b)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))  # a gradient of its own (not an expand)
        results.append((out, r.grad, w.grad, *(() if b is None else (b.grad,))))
    return results


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no grouped_mm")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
def test_grouped_gemm_equals_the_loop(bias, transposed):
    torch.manual_seed(0)
    rows = torch.randn(sum(COUNTS), 16)
    weight = torch.randn(4, 16, 8).transpose(-2, -1) if transposed else torch.randn(4, 8, 16)  # GPT-OSS: [E, in, out]
    loop, grouped = _both_paths(rows, weight, torch.randn(4, 8) if bias else None)
    for a, b in zip(loop, grouped, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert loop[2][1].abs().sum() == 0, "an expert without rows gets a zero gradient"


def test_counts_per_expert_leave_out_the_sentinel():
    ids = torch.tensor([[0, 2], [2, 4], [3, 2]])  # 4 == experts: transformers' sentinel, counted nowhere
    assert count_per_expert(ids, 4).tolist() == [1, 0, 3, 1]


def _fake_cuda(capability: tuple[int, int], dtype: torch.dtype, monkeypatch) -> tuple[bool, int]:
    """On fake CUDA tensors of ``capability``: whether grouped GEMM is chosen for ``dtype``, and the host reads of
    one forward of our Experts given the counts the way that path takes them (grouped: on the device, a fake tensor
    that any host read would refuse; the loop: on the host). Without autograd, which a CPU build cannot record on
    fake CUDA tensors."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    experts = Experts(4, 16, 8, gated=True, bias=False).to(dtype).requires_grad_(False)
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        experts = experts.to_empty(device="cuda")
        rows = torch.empty(sum(COUNTS), 16, dtype=dtype, device="cuda")
        fits = grouped_mm_fits(rows, experts.gate_up, experts.down)
        counts = torch.empty(4, dtype=torch.int64, device="cuda") if fits else COUNTS
        with HostSyncs() as syncs:
            out = experts(rows, counts)
        assert out.shape == (sum(COUNTS), 16) and out.device.type == "cuda"
    return fits, syncs.count


@pytest.mark.parametrize(
    "capability,dtype,grouped",
    [
        ((9, 0), torch.bfloat16, True),
        ((10, 0), torch.bfloat16, True),
        ((8, 0), torch.bfloat16, False),
        ((9, 0), torch.float32, False),
        ((9, 0), torch.float16, False),
    ],
    ids=["h100-bf16", "b200-bf16", "a100-bf16", "h100-fp32", "h100-fp16"],
)
def test_grouped_gemm_is_chosen_on_hopper_and_later_in_bf16(capability, dtype, grouped, monkeypatch):
    """Grouped GEMM runs from the device counts without reading them; the loop uses the host's as they are."""
    assert _fake_cuda(capability, dtype, monkeypatch) == (grouped, 0)


def test_the_loop_reads_device_counts_once():
    experts = Experts(4, 16, 8, gated=True, bias=True)
    rows = torch.randn(sum(COUNTS), 16)
    with HostSyncs() as syncs:
        from_device = experts(rows, torch.tensor(COUNTS))
    assert syncs.count == 1
    torch.testing.assert_close(from_device, experts(rows, COUNTS), rtol=0, atol=0)


def test_the_loop_is_the_path_on_cpu():
    rows, weight = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(2, 8, 16, dtype=torch.bfloat16)
    assert not grouped_mm_fits(rows, weight)
    assert expert_groups(rows, torch.tensor([1, 3]), grouped=False) == [1, 3]


def test_misaligned_rows_take_the_loop(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with FakeTensorMode():
        rows = torch.empty(4, 12, dtype=torch.bfloat16, device="cuda")  # 24 bytes a row: not 16-byte aligned
        assert not grouped_mm_fits(rows, torch.empty(2, 8, 12, dtype=torch.bfloat16, device="cuda"))
    assert expert_compute.ALIGN_BYTES == 16


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a CUDA GPU of capability 9.0 or more")
def test_on_a_hopper_gpu_grouped_gemm_runs_without_a_sync_and_equals_the_loop(monkeypatch):
    """bf16 on CUDA: one forward and backward through grouped GEMM with CUDA's sync check raising, then the same
    through the loop (grouped GEMM switched off): equal within bf16's rounding."""
    torch.manual_seed(0)
    experts = Experts(8, 64, 128, gated=True, bias=True).cuda().bfloat16()
    sizes = [37, 0, 5, 64, 1, 0, 90, 3]
    rows = torch.randn(sum(sizes), 64, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor(sizes, device="cuda")
    grad = torch.randn(sum(sizes), 64, device="cuda", dtype=torch.bfloat16)

    def run(given: torch.Tensor | list[int]) -> list[torch.Tensor]:
        x = rows.clone().requires_grad_()
        experts.zero_grad(set_to_none=True)
        experts(x, given).backward(grad)
        return [x.grad, *(p.grad for p in experts.parameters())]

    assert grouped_mm_fits(rows, experts.gate_up, experts.down)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped = run(counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setattr(expert_compute, "GROUPED_MM_CAPABILITY", (99, 0))
    loop = run(sizes)
    for a, b in zip(grouped, loop, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
