"""``paratrain doctor``: parsers and every check from recorded nvidia-smi outputs and hand-built facts, the live
all-reduce on 2 gloo processes, the report's JSON and table, and the CLI end to end on this machine."""

import json
import socket
import time
from dataclasses import replace

import pytest
from helpers.cli import run_cli
from helpers.paths import ROOT

from paratrain.doctor import DoctorOptions, Status, run_doctor
from paratrain.doctor import bandwidth as bw
from paratrain.doctor.checks import (
    GB,
    MIB,
    check_backends,
    check_env,
    check_host_memory,
    check_loopback,
    check_master,
    check_open_files,
    check_shared_memory,
    check_torch,
)
from paratrain.doctor.gpu_checks import (
    check_gpu_models,
    check_interconnect,
    check_pcie,
    check_visible_gpus,
    resolve_visible,
)
from paratrain.doctor.nvidia import (
    LIST_GPUS,
    QUERY,
    TOPOLOGY,
    CommandResult,
    NvidiaFacts,
    parse_gpu_list,
    parse_query,
    parse_topology,
    probe,
    run_command,
)
from paratrain.doctor.report import render_json, render_text
from paratrain.doctor.system import (
    HostFacts,
    LoopbackFacts,
    MasterFacts,
    TorchFacts,
    gather_host,
    gather_torch,
    parse_master_addr,
    probe_master,
)
from paratrain.errors import ConfigError, RankFailedError

FIXTURES = ROOT / "tests" / "fixtures" / "nvidia_smi"
FILES = {LIST_GPUS: "L.txt", TOPOLOGY: "topo-m.txt", QUERY: "query.csv"}
OK, WARN, FAIL = Status.OK, Status.WARN, Status.FAIL


@pytest.fixture(autouse=True)
def no_tensorflow_section(monkeypatch):
    """The machines here are recorded ones: the live TensorFlow probe (tests/test_tf*.py) stays out of them."""
    monkeypatch.setattr("paratrain.tf.doctor.gather_tf", lambda *args, **kwargs: None)


class Replay:
    """A CommandRunner that answers each nvidia-smi command with a recorded output and remembers the calls."""

    def __init__(self, scenario: str | None = None, **results: CommandResult) -> None:
        self.scenario, self.results, self.calls = scenario, results, []

    def __call__(self, argv):
        self.calls.append(tuple(argv))
        name = FILES[tuple(argv)]
        if name in self.results:
            return self.results[name]
        return CommandResult(returncode=0, stdout=(FIXTURES / self.scenario / name).read_text())


def nvidia(scenario: str) -> NvidiaFacts:
    return probe(Replay(scenario))


def cuda_torch(count: int = 0, **kw) -> TorchFacts:
    return replace(
        TorchFacts(
            python="3.12.3",
            torch="2.11.0+cu130",
            cuda="13.0",
            cuda_available=bool(count),
            device_count=count,
            nccl="2.27.7",
            nccl_available=True,
        ),
        **kw,
    )


CPU_TORCH = TorchFacts(python="3.11.7", torch="2.13.0+cpu")


def host(**kw) -> HostFacts:
    base = HostFacts(
        cores=64,
        ram_bytes=int(2048 * GB),
        shm_bytes=int(500 * GB),
        shm_free_bytes=int(500 * GB),
        nofile_soft=65536,
        nofile_hard=65536,
        loopback=LoopbackFacts(bound_port=40000),
        interfaces=("lo", "eth0", "ib0"),
    )
    return replace(base, **kw)


def gpus_of(scenario: str, cvd: str | None = None):
    facts = nvidia(scenario)
    visible = resolve_visible(cvd, facts.gpus)
    return [g for i in visible.indices for g in facts.gpus if g.index == i]


# --- nvidia-smi parsing ----------------------------------------------------------------------------------------


def test_gpu_list_parses_names_and_uuids_and_skips_mig_instances():
    listed = parse_gpu_list((FIXTURES / "mixed_models" / "L.txt").read_text())
    assert [name for name, _ in listed.values()] == [
        "NVIDIA A100 80GB PCIe",
        "NVIDIA A100 80GB PCIe",
        "NVIDIA A100-PCIE-40GB",
        "Tesla V100-PCIE-32GB",
    ]
    assert all(uuid.startswith("GPU-") for _, uuid in listed.values())
    mig = (
        "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1111aaaa-0000-0000-0000-000000000000)\n"
        "  MIG 3g.40gb     Device  0: (UUID: MIG-2222bbbb-0000-0000-0000-000000000000)\n"
        "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-3333cccc-0000-0000-0000-000000000000)\n"
    )
    assert sorted(parse_gpu_list(mig)) == [0, 1]


def test_query_parses_memory_and_pcie_links_and_unsupported_fields():
    rows = parse_query((FIXTURES / "pcie_only" / "query.csv").read_text())
    assert [(g.pcie_gen, g.pcie_gen_max, g.pcie_width, g.pcie_width_max) for g in rows.values()] == [
        (4, 4, 16, 16),
        (1, 4, 16, 16),
        (3, 3, 8, 8),
        (3, 4, 8, 16),
    ]
    assert rows[0].name == "NVIDIA RTX A6000" and rows[0].memory_mib == 49140
    odd = parse_query("0, NVIDIA T4, 15360, [N/A], [Not Supported], 16, 16\nnot a row\n")
    assert odd[0].pcie_gen is None and odd[0].pcie_gen_max is None and odd[0].pcie_width == 16


def test_topology_reads_every_gpu_pair_and_ignores_nics_and_legend():
    links = parse_topology((FIXTURES / "h100x8_nvlink" / "topo-m.txt").read_text())
    assert len(links) == 28 and set(links.values()) == {"NV18"}
    mixed = parse_topology((FIXTURES / "mixed_models" / "topo-m.txt").read_text())
    assert mixed == {(0, 1): "NV12", (0, 2): "NODE", (1, 2): "NODE", (0, 3): "SYS", (1, 3): "SYS", (2, 3): "SYS"}
    assert parse_topology((FIXTURES / "single_gpu" / "topo-m.txt").read_text()) == {}
    old = (
        "        GPU0    GPU1    mlx5_0  CPU Affinity\n"
        "GPU0     X      PIX     PHB     0-9,20-29\n"
        "GPU1    PIX      X      PHB     0-9,20-29\n"
        "mlx5_0  PHB     PHB      X\n\nLegend:\n\n  X   = Self\n"
    )
    assert parse_topology(old) == {(0, 1): "PIX"}


def test_probe_merges_the_three_commands_and_skips_topology_for_one_gpu():
    runner = Replay("single_gpu")
    facts = probe(runner)
    assert facts.found and facts.error is None and len(facts.gpus) == 1
    assert facts.gpus[0].uuid.startswith("GPU-") and facts.gpus[0].memory_mib == 81559
    assert runner.calls == [LIST_GPUS, QUERY]
    eight = nvidia("h100x8_nvlink")
    assert [g.index for g in eight.gpus] == list(range(8)) and len(eight.links) == 28


def test_probe_reports_a_missing_or_failing_nvidia_smi():
    missing = probe(Replay(**{"L.txt": CommandResult(returncode=127, stderr="nvidia-smi: command not found")}))
    assert not missing.found and not missing.gpus
    driver = (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
        "latest NVIDIA driver is installed and running.\n"
    )
    broken = probe(Replay(**{"L.txt": CommandResult(returncode=9, stdout=driver)}))
    assert broken.found and broken.error.startswith("NVIDIA-SMI has failed")


@pytest.mark.launched
def test_run_command_turns_a_missing_program_and_a_hang_into_results():
    assert run_command(["no-such-program-xyz"]).returncode == 127
    assert run_command(["sleep", "5"], timeout_s=0.2).returncode == 124
    done = run_command(["echo", "hi"])
    assert done.returncode == 0 and done.first_line == "hi"


# --- which GPUs a job sees -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cvd, indices, ignored",
    [
        (None, (0, 1, 2, 3), None),
        ("0,1", (0, 1), None),
        ("3, 1", (3, 1), None),
        ("0,1,7", (0, 1), "7"),
        ("", (), None),
        ("-1", (), "-1"),
        ("1,1", (1,), "1"),
    ],
)
def test_cuda_visible_devices_is_read_the_way_cuda_reads_it(cvd, indices, ignored):
    visible = resolve_visible(cvd, nvidia("cvd_subset").gpus)
    assert (visible.indices, visible.ignored) == (indices, ignored)


def test_cuda_visible_devices_accepts_uuid_prefixes():
    gpus = nvidia("cvd_subset").gpus
    assert resolve_visible(f"{gpus[2].uuid[:12]},{gpus[0].uuid}", gpus).indices == (2, 0)


def visible_check(torch: TorchFacts, scenario: str | None, cvd: str | None = None, facts: NvidiaFacts | None = None):
    facts = facts or (nvidia(scenario) if scenario else NvidiaFacts(found=False))
    return check_visible_gpus(torch, facts, cvd, resolve_visible(cvd, facts.gpus))


def test_visible_gpus_ok_when_torch_sees_what_nvidia_smi_lists():
    assert visible_check(cuda_torch(8), "h100x8_nvlink").status is OK
    none = visible_check(CPU_TORCH, None)
    assert none.status is OK and "no GPU" in none.evidence


def test_visible_gpus_explains_a_cuda_visible_devices_subset():
    check = visible_check(cuda_torch(2), "cvd_subset", "0,1")
    assert check.status is OK
    assert "lists 4" in check.evidence and "keeps 2 (GPU0, GPU1)" in check.evidence and "torch sees 2" in check.evidence
    assert "nvidia-smi ignores CUDA_VISIBLE_DEVICES" in check.evidence


def test_visible_gpus_warns_on_entries_cuda_drops_or_hiding_every_gpu():
    dropped = visible_check(cuda_torch(2), "cvd_subset", "0,1,7")
    assert dropped.status is WARN and "'7' names no GPU" in dropped.evidence
    hidden = visible_check(cuda_torch(0, cuda_available=False), "cvd_subset", "")
    assert hidden.status is WARN and "hides every GPU" in hidden.fix
    cpu_build = visible_check(CPU_TORCH, "cvd_subset")
    assert cpu_build.status is WARN and "torch check" in cpu_build.fix
    no_smi = visible_check(cuda_torch(2), None)
    assert no_smi.status is WARN and "nvidia-smi" in no_smi.fix


def test_visible_gpus_fails_when_cuda_misses_a_gpu_or_the_driver_is_broken():
    missing = visible_check(cuda_torch(3), "cvd_subset")
    assert missing.status is FAIL and "torch sees 3" in missing.evidence and "dmesg" in missing.fix
    broken = visible_check(CPU_TORCH, None, facts=NvidiaFacts(found=True, error="NVIDIA-SMI has failed because …"))
    assert broken.status is FAIL and "driver" in broken.fix
    empty = visible_check(CPU_TORCH, None, facts=NvidiaFacts(found=True, error="No devices were found"))
    assert empty.status is WARN


def test_torch_check_fails_when_the_build_cannot_use_the_gpus():
    assert check_torch(CPU_TORCH, listed=0, visible=0).status is OK
    assert "CPU-only build" in check_torch(CPU_TORCH, 0, 0).evidence
    cuda = check_torch(cuda_torch(8), 8, 8)
    assert cuda.status is OK and "CUDA 13.0, NCCL 2.27.7" in cuda.evidence
    cpu_on_gpus = check_torch(CPU_TORCH, 4, 4)
    assert cpu_on_gpus.status is FAIL and "download.pytorch.org" in cpu_on_gpus.fix
    no_init = check_torch(cuda_torch(0, cuda_available=False), 4, 4)
    assert no_init.status is FAIL and "driver" in no_init.fix
    assert check_torch(cuda_torch(0, cuda_available=False), 4, 0).status is OK  # CUDA_VISIBLE_DEVICES=""


# --- GPU models, interconnect, PCIe ----------------------------------------------------------------------------


def test_gpu_models_ok_when_identical_warn_when_mixed():
    same = check_gpu_models(gpus_of("h100x8_nvlink"))
    assert same.status is OK and same.evidence == "8× NVIDIA H100 80GB HBM3 81559 MiB"
    mixed = check_gpu_models(gpus_of("mixed_models"))
    assert mixed.status is WARN and "Tesla V100-PCIE-32GB 32768 MiB" in mixed.evidence
    assert "CUDA_VISIBLE_DEVICES=0,1" in mixed.fix and "PCI_BUS_ID" in mixed.fix
    assert check_gpu_models(gpus_of("mixed_models", "0,1")).status is OK


def test_interconnect_judges_every_pair_of_the_visible_gpus():
    assert check_interconnect(gpus_of("single_gpu"), {}).status is OK
    facts = nvidia("h100x8_nvlink")
    nvlink = check_interconnect(facts.gpus, facts.links)
    assert nvlink.status is OK and nvlink.evidence == "28 pair(s): NV18×28"
    mixed = nvidia("mixed_models")
    partly = check_interconnect(mixed.gpus, mixed.links)
    assert partly.status is WARN and "slowest GPU0-GPU3 SYS" in partly.evidence
    assert "NVLink joins CUDA_VISIBLE_DEVICES=0,1" in partly.fix
    pcie = nvidia("pcie_only")
    assert check_interconnect(pcie.gpus, pcie.links).evidence.startswith("6 pair(s): SYS×4, NODE×1, PHB×1")
    assert check_interconnect(pcie.gpus[2:], pcie.links).status is WARN  # PHB alone: through the CPU
    subset = nvidia("cvd_subset")
    assert check_interconnect(gpus_of("cvd_subset", "0,1"), subset.links).status is OK
    assert check_interconnect(subset.gpus, {}).status is WARN  # no matrix


def test_pcie_flags_narrow_and_slow_links_but_not_idle_downshift():
    assert check_pcie(gpus_of("h100x8_nvlink")).evidence == "8× gen5 x16 (63 GB/s)"
    pcie = check_pcie(gpus_of("pcie_only"))
    assert pcie.status is WARN and pcie.evidence == "GPU2 gen3 x8 ≈7.9 GB/s; GPU3 x8 of x16"
    idle_only = check_pcie(gpus_of("pcie_only")[:2])
    assert idle_only.status is OK and "1 at a lower gen now (idle power saving)" in idle_only.evidence
    unknown = [replace(g, pcie_gen_max=None) for g in gpus_of("single_gpu")]
    assert check_pcie(unknown).status is WARN


# --- host ------------------------------------------------------------------------------------------------------


def test_host_memory_per_gpu_and_per_cpu_process():
    assert check_host_memory(host(ram_bytes=int(1100 * GB)), gpus=8, processes=8).status is OK
    low = check_host_memory(host(ram_bytes=int(64 * GB), ram_limited_by_cgroup=True), gpus=8, processes=8)
    assert low.status is WARN and low.evidence == "64.0 GB (container limit), 8.0 GB per GPU (8 GPUs)"
    assert check_host_memory(host(ram_bytes=int(16 * GB)), gpus=8, processes=8).status is FAIL
    assert check_host_memory(host(ram_bytes=int(25 * GB)), gpus=0, processes=2).status is OK
    assert check_host_memory(host(ram_bytes=int(6 * GB)), gpus=0, processes=2).status is WARN
    assert check_host_memory(host(ram_bytes=int(1 * GB)), gpus=0, processes=2).status is FAIL


def test_shared_memory_fails_at_dockers_default():
    assert check_shared_memory(host(), processes=8).status is OK
    assert check_shared_memory(host(shm_bytes=int(4 * GB), shm_free_bytes=int(4 * GB)), 8).status is WARN
    docker = check_shared_memory(host(shm_bytes=64 * MIB, shm_free_bytes=64 * MIB), 2)
    assert docker.status is FAIL and "Docker's default" in docker.evidence and "--shm-size" in docker.fix
    assert check_shared_memory(host(shm_bytes=None, shm_free_bytes=None), 2).status is WARN


def test_open_file_limit():
    assert check_open_files(host(nofile_soft=65536, nofile_hard=65536)).status is OK
    soft = check_open_files(host(nofile_soft=1024, nofile_hard=1048576))
    assert soft.status is WARN and "ulimit -n 65536" in soft.fix
    hard = check_open_files(host(nofile_soft=256, nofile_hard=256))
    assert hard.status is FAIL and "limits.conf" in hard.fix


def test_backends():
    assert check_backends(CPU_TORCH, gpus=0).status is OK
    assert check_backends(cuda_torch(8), gpus=8).status is OK
    assert check_backends(cuda_torch(8, nccl_available=False), gpus=8).status is FAIL
    assert check_backends(replace(CPU_TORCH, distributed=False), gpus=0).status is FAIL
    assert check_backends(replace(CPU_TORCH, gloo=False), gpus=0).status is FAIL
    assert check_backends(cuda_torch(8, gloo=False), gpus=8).status is WARN


@pytest.mark.parametrize(
    "env, status, words",
    [
        ({}, OK, "none set"),
        ({"NCCL_DEBUG": "INFO", "NCCL_P2P_DISABLE": "0"}, OK, "NCCL_DEBUG=INFO"),
        ({"NCCL_SOCKET_IFNAME": "eth"}, OK, "NCCL_SOCKET_IFNAME=eth"),
        ({"NCCL_SOCKET_IFNAME": "^docker,lo", "GLOO_SOCKET_IFNAME": "eth0"}, OK, ""),
        ({"NCCL_P2P_DISABLE": "1"}, WARN, "host memory"),
        ({"NCCL_IB_DISABLE": "1", "NCCL_ALGO": "Tree"}, WARN, "TCP sockets"),
        ({"NCCL_DEBUG": "trace"}, WARN, "huge logs"),
        ({"CUDA_LAUNCH_BLOCKING": "1"}, WARN, "synchronously"),
        ({"NCCL_SOCKET_IFNAME": "enp"}, FAIL, "matches no interface"),
        ({"NCCL_SOCKET_IFNAME": "=eth"}, FAIL, "matches no interface"),
        ({"NCCL_SOCKET_IFNAME": "^eth,ib,lo"}, FAIL, "matches no interface"),
        ({"GLOO_SOCKET_IFNAME": "eth0,eth1"}, FAIL, "no interface eth1"),
    ],
)
def test_env_variables(env, status, words):
    check = check_env(env, ("lo", "eth0", "ib0"))
    assert check.status is status and words in check.evidence


def test_loopback():
    assert check_loopback(LoopbackFacts(bound_port=40000)).status is OK
    taken = check_loopback(LoopbackFacts(bound_port=40000, default_port_in_use=True))
    assert taken.status is WARN and "29500" in taken.evidence
    assert check_loopback(LoopbackFacts(bound_port=None, error="[Errno 99] Cannot assign")).status is FAIL


# --- multi-node master -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("10.0.0.1", ("10.0.0.1", 29500)),
        ("node0:1234", ("node0", 1234)),
        ("[fe80::1]:29400", ("fe80::1", 29400)),
        ("fe80::1", ("fe80::1", 29500)),
    ],
)
def test_master_address_parsing(text, expected):
    assert parse_master_addr(text) == expected


@pytest.mark.parametrize("text", [":80", "node0:http", "node0:70000", "[::1"])
def test_bad_master_address_is_a_config_error(text):
    with pytest.raises(ConfigError, match="--master-addr"):
        parse_master_addr(text)


def test_master_check_statuses():
    def master(**kw):
        return check_master(MasterFacts(host="node0", port=29500, addresses=("10.0.0.1",), **kw))

    assert master(connect="open").status is OK
    refused = master(connect="refused")
    assert refused.status is OK and "reachable" in refused.evidence
    assert master(connect="timeout").status is FAIL
    assert master(connect="No route to host").status is FAIL
    unresolved = check_master(MasterFacts(host="nope.invalid", port=29500, resolve_error="Name or service not known"))
    assert unresolved.status is FAIL and "/etc/hosts" in unresolved.fix
    loop = check_master(MasterFacts(host="localhost", port=29500, addresses=("127.0.0.1",), connect="open"))
    assert loop.status is WARN and "loopback" in loop.fix


def test_probe_master_dials_only_the_given_address():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert probe_master("127.0.0.1", port, 1.0).connect == "open"
    closed = probe_master("127.0.0.1", port, 1.0)
    assert closed.connect == "refused" and closed.addresses == ("127.0.0.1",)


# --- bandwidth ---------------------------------------------------------------------------------------------------


def test_bandwidth_definitions_follow_nccl_tests():
    assert bw.sweep_sizes(64 * MIB) == [1024 * 4**k for k in range(9)]
    assert bw.sweep_sizes(3000) == [1024, 3000]
    assert bw.algbw(1_000_000_000, 0.5) == 2.0
    assert bw.allreduce_busbw(2.0, 2) == 2.0 and bw.allreduce_busbw(2.0, 8) == 3.5


@pytest.mark.launched
def test_live_allreduce_on_two_gloo_processes():
    result = bw.measure_allreduce(nprocs=2, accelerator="cpu", max_bytes=64 * 1024, timeout_s=60, start_method="fork")
    assert (result.backend, result.device, result.world_size, result.correct) == ("gloo", "cpu", 2, True)
    assert [r.size_bytes for r in result.rows] == [1024, 4096, 16384, 65536]
    for row in result.rows:
        assert row.seconds > 0 and row.algbw_gbps == pytest.approx(row.size_bytes / row.seconds / 1e9)
        assert row.busbw_gbps == row.algbw_gbps  # 2(n-1)/n = 1 at n = 2


@pytest.mark.launched
def test_sweep_worker_runs_under_spawn_like_the_gpu_path():
    from paratrain.testing import spawn

    results = spawn(bw.sweep, 2, ([1024, 4096], "cpu", 5.0), timeout_s=90)
    assert [r[:2] for r in results] == [("gloo", "cpu")] * 2 and all(r[3] for r in results)
    assert [size for size, _ in results[0][2]] == [1024, 4096]


def test_sweep_flags_a_wrong_sum(monkeypatch):
    import torch.distributed as dist

    from paratrain.launcher.ports import free_port

    real = dist.all_reduce

    def corrupting(tensor, *args, **kwargs):
        real(tensor, *args, **kwargs)
        tensor += 1

    monkeypatch.setattr(dist, "all_reduce", corrupting)
    one_rank = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key, value in one_rank.items():
        monkeypatch.setenv(key, value)
    backend, device, timings, correct = bw.sweep([1024], "cpu", 1.0)
    assert (backend, device, len(timings), correct) == ("gloo", "cpu", 1, False)


def fake_result(busbw: float, device: str = "cuda", correct: bool = True, n: int = 8) -> bw.BandwidthResult:
    row = bw.BandwidthRow(size_bytes=64 * MIB, seconds=0.001, algbw_gbps=busbw, busbw_gbps=busbw)
    return bw.BandwidthResult(
        backend="nccl" if device == "cuda" else "gloo", device=device, world_size=n, rows=(row,), correct=correct
    )


def test_expected_bandwidth_from_the_topology():
    h100 = nvidia("h100x8_nvlink")
    assert bw.expected_busbw("cuda", h100.gpus, h100.links) == (360.0, "NV18")
    pcie = nvidia("pcie_only")
    speed, basis = bw.expected_busbw("cuda", pcie.gpus, pcie.links)
    assert basis == "PCIe gen3 x8" and speed == pytest.approx(0.985 * 8 * 0.8)
    assert bw.expected_busbw("cpu", [], {}) == (1.0, "gloo on loopback")


def test_bandwidth_verdicts():
    nv18 = (360.0, "NV18")
    assert bw.check_bandwidth(fake_result(250), nv18).status is OK
    assert bw.check_bandwidth(fake_result(50), nv18).status is WARN
    assert bw.check_bandwidth(fake_result(10), nv18).status is FAIL
    assert bw.check_bandwidth(fake_result(10), None).status is OK
    wrong = bw.check_bandwidth(fake_result(250, correct=False), nv18)
    assert wrong.status is FAIL and "WRONG SUM" in wrong.evidence
    cpu = (1.0, "gloo on loopback")
    assert bw.check_bandwidth(fake_result(1.1, "cpu", n=2), cpu).status is OK
    assert bw.check_bandwidth(fake_result(0.05, "cpu", n=2), cpu).status is WARN
    assert bw.check_bandwidth(fake_result(0.0001, "cpu", n=2), cpu).status is WARN  # never fail on CPU
    err = RankFailedError(rank=1, exitcode=1, host="h", pid=1, traceback="Traceback …\nRuntimeError: Connection reset")
    failed = bw.check_bandwidth_error(err)
    assert failed.status is FAIL and failed.evidence.endswith("RuntimeError: Connection reset")


# --- the whole report ----------------------------------------------------------------------------------------------

GPU_CHECKS = [
    "torch",
    "gpus",
    "gpu models",
    "interconnect",
    "pcie",
    "host memory",
    "shared memory",
    "open files",
    "backends",
    "env",
    "loopback port",
]


def test_report_from_a_recorded_8_gpu_machine_is_all_ok():
    report = run_doctor(
        DoctorOptions(skip_bandwidth=True), runner=Replay("h100x8_nvlink"), torch_facts=cuda_torch(8), host=host()
    )
    assert [c.name for c in report.checks] == GPU_CHECKS
    assert all(c.status is OK for c in report.checks), report.checks
    assert report.exit_code == 0 and "8 GPU(s) (NVIDIA H100 80GB HBM3)" in report.title


def test_report_uses_only_the_visible_gpus_and_exits_1_on_a_failure():
    report = run_doctor(
        DoctorOptions(skip_bandwidth=True),
        runner=Replay("mixed_models"),
        torch_facts=cuda_torch(2),
        host=host(env={"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_SOCKET_IFNAME": "enp"}),
    )
    status = {c.name: c.status for c in report.checks}
    assert status["gpu models"] is OK and status["interconnect"] is OK  # the two A100 80GB on NVLink
    assert status["env"] is FAIL and report.exit_code == 1


def test_report_dials_the_master_when_asked():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        options = DoctorOptions(skip_bandwidth=True, master_addr=f"127.0.0.1:{server.getsockname()[1]}")
        report = run_doctor(options, runner=Replay("single_gpu"), torch_facts=cuda_torch(1), host=host())
    assert report.checks[-1].name == "master" and "open" in report.checks[-1].evidence


def test_gpu_bandwidth_runs_nccl_on_every_visible_gpu(monkeypatch):
    import paratrain.doctor as doctor

    calls = []

    def fake_measure(**kw):
        calls.append(kw)
        return fake_result(20.0)

    monkeypatch.setattr(doctor, "measure_allreduce", fake_measure)
    report = run_doctor(runner=Replay("h100x8_nvlink"), torch_facts=cuda_torch(8), host=host())
    assert calls[0]["nprocs"] == 8 and calls[0]["accelerator"] == "cuda" and calls[0]["start_method"] == "spawn"
    assert report.checks[-1].status is WARN and "expect ≈360 for NV18" in report.checks[-1].evidence
    assert report.expected_busbw_gbps == 360.0

    def broken(**kw):
        raise RankFailedError(rank=3, exitcode=1, host="h", pid=1, traceback=None)

    monkeypatch.setattr(doctor, "measure_allreduce", broken)
    report = run_doctor(runner=Replay("h100x8_nvlink"), torch_facts=cuda_torch(8), host=host())
    assert report.checks[-1].status is FAIL and report.bandwidth is None and report.exit_code == 1


def test_json_shape_and_table():
    report = replace(
        run_doctor(
            DoctorOptions(skip_bandwidth=True), runner=Replay("pcie_only"), torch_facts=cuda_torch(4), host=host()
        ),
        bandwidth=fake_result(9.0, n=4),
    )
    data = json.loads(render_json(report))
    assert set(data) == {"title", "exit_code", "counts", "checks", "bandwidth"}
    assert data["counts"] == {"ok": 9, "warn": 2, "fail": 0} and data["exit_code"] == 0
    assert all(set(c) == {"name", "status", "evidence", "fix"} for c in data["checks"])
    assert all(bool(c["fix"]) == (c["status"] != "ok") for c in data["checks"])
    assert set(data["bandwidth"]["rows"][0]) == {"size_bytes", "time_us", "algbw_gbps", "busbw_gbps"}
    text = render_text(report, 100)
    lines = text.splitlines()
    assert lines[0].startswith("paratrain doctor — ") and lines[2].split() == ["CHECK", "STATUS", "EVIDENCE", "FIX"]
    assert all(len(line) <= 100 for line in lines)
    assert any(line.startswith("pcie           warn    GPU2 gen3 x8") for line in lines)
    assert "all-reduce over nccl, 4 GPUs" in text and "64 MiB" in text
    assert lines[-1] == "11 checks: 9 ok, 2 warn, 0 fail → exit 0"


# --- this machine --------------------------------------------------------------------------------------------------


def test_gatherers_read_this_machine():
    facts = gather_host({"NCCL_DEBUG": "INFO", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0"})
    assert facts.env == {"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0"}
    assert facts.ram_bytes > 0 and facts.cores >= 1 and "lo" in facts.interfaces and facts.loopback.bound_port
    torch_facts = gather_torch()
    assert torch_facts.distributed and torch_facts.gloo and torch_facts.torch


def _doctor(paratrain_cmd, *args, env=None, timeout=60):
    return run_cli("doctor", *args, timeout=timeout, env=env)


@pytest.mark.launched
def test_cli_json_on_this_machine(paratrain_cmd):
    start = time.monotonic()
    res = _doctor(paratrain_cmd, "--json")
    elapsed = time.monotonic() - start
    assert res.returncode == 0, res.stdout + res.stderr
    assert elapsed < 60, f"doctor took {elapsed:.1f} s"  # a bound that catches a hang; its speed is not a claim
    data = json.loads(res.stdout)
    names = [c["name"] for c in data["checks"]]
    assert names[:2] == ["torch", "gpus"] and names[-1] == "all-reduce"
    assert all(c["status"] != "fail" for c in data["checks"])
    table = data["bandwidth"]
    assert table["correct"] and table["world_size"] == 2 and table["rows"][0]["size_bytes"] == 1024
    assert table["peak_busbw_gbps"] > 0


@pytest.mark.launched
def test_cli_table_and_exit_code_1_on_a_failed_check(paratrain_cmd):
    import os

    env = {**os.environ, "NCCL_SOCKET_IFNAME": "nosuchif0", "COLUMNS": "160"}
    res = _doctor(paratrain_cmd, "--skip-bandwidth", env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "env            fail    NCCL_SOCKET_IFNAME=nosuchif0 matches no interface" in res.stdout
    assert "all-reduce" not in res.stdout and res.stdout.rstrip().endswith("→ exit 1")


@pytest.mark.launched
@pytest.mark.parametrize(
    "args, words",
    [(["--master-addr", "node0:http"], "port must be a number"), (["--nproc", "1"], "at least 2 processes")],
)
def test_cli_bad_options_are_one_line_errors(paratrain_cmd, args, words):
    res = _doctor(paratrain_cmd, *args)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [f"paratrain: error: {res.stderr.split('error: ', 1)[1].strip()}"]
    assert words in res.stderr


NANOGPT_SETUP = """import os
import torch
from torch.distributed import init_process_group
backend = 'nccl'  # 'nccl', 'gloo', etc.
device = 'cuda'
ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    init_process_group(backend=backend)
    device = f'cuda:{int(os.environ["LOCAL_RANK"])}'
    torch.cuda.set_device(device)
device_type = 'cuda' if 'cuda' in device else 'cpu'
model = torch.nn.Linear(2, 2).cuda()
x = torch.zeros(2, device='cuda')
if torch.cuda.is_available():
    model.to('cuda:0')
picked = 'cuda' if torch.cuda.is_available() else 'cpu'
model.to(picked)
"""


def test_hard_coded_cuda_is_found_by_line_outside_code_that_picks_the_device():
    from paratrain.doctor.scripts import cuda_uses

    found = cuda_uses(NANOGPT_SETUP)  # line 8 passes the backend of line 4; 11 and 14-17 pick the device
    assert [line for line, _ in found] == [4, 5, 9, 10, 12, 13]
    assert [what for _, what in found if "LOCAL_RANK" not in what] == [
        "backend = 'nccl'",
        "device = 'cuda'",
        "torch.cuda.set_device()",
        ".cuda()",
        "device 'cuda'",
    ]
    assert cuda_uses("import torch.distributed as dist\ndist.init_process_group('nccl')\n") == [
        (2, "init_process_group(backend='nccl')")
    ]
    assert cuda_uses("import torch\nw = torch.load('w.pt', map_location=torch.device('cuda:1'))\n") == [
        (2, "device 'cuda:1'")
    ]


@pytest.mark.parametrize(
    "torch_facts, status", [(CPU_TORCH, WARN), (cuda_torch(0, cuda_available=False), WARN), (cuda_torch(1), OK)]
)
def test_doctor_warns_about_a_script_hard_coding_cuda_only_on_a_host_without_it(tmp_path, torch_facts, status):
    script = tmp_path / "train.py"
    script.write_text(NANOGPT_SETUP)
    report = run_doctor(
        DoctorOptions(skip_bandwidth=True, tensorflow=False, scripts=(str(script),)),
        runner=Replay("single_gpu"),
        torch_facts=torch_facts,
        host=host(),
    )
    check = next(c for c in report.checks if c.name == "cuda in train.py")
    assert check.status is status and "line 5 device = 'cuda'" in check.evidence, check
    assert "line 10 torch.cuda.set_device()" in check.evidence
    if status is WARN:
        assert "this host lacks" in check.evidence and "torch.cuda.is_available()" in check.fix
    script.write_text("import torch\ndevice = 'cuda' if torch.cuda.is_available() else 'cpu'\n")
    report = run_doctor(
        DoctorOptions(skip_bandwidth=True, tensorflow=False, scripts=(str(script),)),
        runner=Replay("single_gpu"),
        torch_facts=torch_facts,
        host=host(),
    )
    assert next(c for c in report.checks if c.name == "cuda in train.py").status is OK
