"""``paratrain run`` across two hosts (network namespaces joined by a veth pair), and waits that must end.

The two-host tests need root (``ip netns add``) and skip with the reason elsewhere. Each node runs its own
``paratrain run``; neither is told which interface to use. The rendezvous and peer tests run anywhere.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers.cli import PARATRAIN, run_cli
from helpers.netns import HostPair, unavailable
from helpers.paths import SCRIPTS

pytestmark = pytest.mark.launched  # every test here starts processes

TRAIN = str(SCRIPTS / "multinode_train.py")
RUN = [*PARATRAIN, "run"]
multinode = pytest.mark.multinode


@pytest.fixture(scope="module")
def hosts():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    try:
        pair = HostPair.create()
    except OSError as err:
        pytest.skip(f"cannot create network namespaces here: {err}")
    try:
        yield pair
    finally:
        pair.destroy()


@pytest.fixture
def two_hosts(hosts):
    """The namespaces, with every process started in them stopped after the test."""
    yield hosts
    hosts.stop_all()


@pytest.fixture(scope="module")
def single_node_params(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("single")
    res = subprocess.run([*RUN, "-n", "2", TRAIN, str(out)], capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr
    return torch.load(out / "params.pt")


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Wait for every node; (return code, stderr) each. A node still running at the deadline fails the test."""
    deadline = time.monotonic() + timeout
    results = []
    for i, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {i} still running after {timeout:g} s")
        results.append((proc.returncode, err))
    return results


def _ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _same_params(out: Path, expected: dict[str, torch.Tensor]) -> None:
    got = torch.load(out / "params.pt")
    assert got.keys() == expected.keys()
    assert max((got[k] - expected[k]).abs().max().item() for k in got) <= 1e-6


@multinode
def test_two_hosts_static_rendezvous_trains_like_one_host(two_hosts, single_node_params, tmp_path):
    master = two_hosts.addrs[0]
    procs = [
        two_hosts.start(
            node,
            [
                *RUN,
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "-n",
                "1",
                "--master-addr",
                master,
                "--master-port",
                "29501",
                TRAIN,
                str(tmp_path),
            ],
        )
        for node in (0, 1)
    ]
    results = _finish(procs, timeout=120)
    for node, (code, err) in enumerate(results):
        assert code == 0, err
        # The interface was found from the route to the master, not given by the user.
        assert f"from {two_hosts.addrs[node]} on v" in err and "GLOO_SOCKET_IFNAME=v" in err, err
    ranks = _ranks(tmp_path)
    assert [(r["rank"], r["node_rank"], r["world"]) for r in ranks] == [(0, 0, 2), (1, 1, 2)]
    assert ranks[0]["netns"] != ranks[1]["netns"]  # really two network stacks
    _same_params(tmp_path, single_node_params)
    assert two_hosts.pids(0) == [] and two_hosts.pids(1) == []


@multinode
def test_two_hosts_c10d_rendezvous_with_elastic_membership(two_hosts, single_node_params, tmp_path):
    endpoint = f"{two_hosts.addrs[0]}:29502"
    procs = [
        two_hosts.start(
            node,
            [
                *RUN,
                "--nnodes",
                "1:2",
                "-n",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "job7",
                TRAIN,
                str(tmp_path),
            ],
        )
        for node in (0, 1)
    ]
    for code, err in _finish(procs, timeout=120):
        assert code == 0, err
    ranks = _ranks(tmp_path)
    assert [r["world"] for r in ranks] == [2, 2] and ranks[0]["netns"] != ranks[1]["netns"]
    assert ranks[0]["master_addr"] in two_hosts.addrs  # published by node 0 from the route, not the hostname
    _same_params(tmp_path, single_node_params)


@multinode
def test_nodes_started_with_different_nnodes_stop_with_one_clear_line(two_hosts, tmp_path):
    procs = [
        two_hosts.start(
            node,
            [
                *RUN,
                "--nnodes",
                nnodes,
                "--node-rank",
                str(node),
                "-n",
                "1",
                "--master-addr",
                two_hosts.addrs[0],
                "--master-port",
                "29503",
                TRAIN,
                str(tmp_path),
            ],
        )
        for node, nnodes in ((0, "2"), (1, "3"))
    ]
    for code, err in _finish(procs, timeout=90):
        last = err.strip().splitlines()[-1]
        assert code != 0 and last.startswith("paratrain: error: node "), err
        assert "--nnodes 3" in last and "--nnodes 2" in last and "same --nnodes" in last
    assert not (tmp_path / "rank0.json").exists()  # stopped before the script ran


@multinode
def test_unreachable_master_fails_after_the_rendezvous_timeout(two_hosts, tmp_path):
    absent = "10.123.0.77"  # on the link, but no host answers
    start = time.monotonic()
    proc = two_hosts.start(
        1,
        [
            *RUN,
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "-n",
            "1",
            "--master-addr",
            absent,
            "--master-port",
            "29504",
            "--rdzv-timeout",
            "3",
            TRAIN,
            str(tmp_path),
        ],
    )
    [(code, err)] = _finish([proc], timeout=60)
    assert time.monotonic() - start < 45
    assert code == 2 and "Traceback" not in err, err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"paratrain: error: could not reach the rendezvous at {absent}:29504 within 3 s")
    )


@multinode
def test_a_node_that_dies_stops_the_other_within_seconds(two_hosts, tmp_path):
    procs = [
        two_hosts.start(
            node,
            [
                *RUN,
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "-n",
                "1",
                "--master-addr",
                two_hosts.addrs[0],
                "--master-port",
                "29505",
                TRAIN,
                str(tmp_path),
                "--steps",
                "100000",
                "--step-sleep",
                "0.05",
            ],
        )
        for node in (0, 1)
    ]
    deadline = time.monotonic() + 90
    while not (tmp_path / "rank1.json").exists():
        assert time.monotonic() < deadline and procs[0].poll() is None, "the job did not start"
        time.sleep(0.2)
    time.sleep(1)
    two_hosts.kill(1)  # node 1 "loses power": launcher and worker gone at once
    killed = time.monotonic()
    [(code, err)] = _finish(procs[:1], timeout=60)
    assert time.monotonic() - killed < 30
    assert code == 1 and "paratrain: rank 0 failed" in err and "lost a peer" in err, err
    assert two_hosts.pids(0) == []


def test_a_master_that_never_comes_fails_after_the_rendezvous_timeout(paratrain_cmd, tmp_path):
    port = _free_port()
    start = time.monotonic()
    res = run_cli(
        "run",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "-n",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--rdzv-timeout",
        "2",
        TRAIN,
        str(tmp_path),
        timeout=60,
    )
    assert time.monotonic() - start < 40
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"could not reach the rendezvous at 127.0.0.1:{port} within 2 s" in res.stderr


def test_node_zero_alone_says_how_many_nodes_joined(paratrain_cmd, tmp_path):
    res = run_cli(
        "run",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "-n",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "--rdzv-timeout",
        "2",
        TRAIN,
        str(tmp_path),
        timeout=60,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "only 1 of 2 nodes joined the rendezvous" in res.stderr and "within 2 s" in res.stderr


def test_a_silent_peer_fails_the_job_after_the_process_group_timeout(paratrain_cmd):
    start = time.monotonic()
    res = run_cli("run", "-n", "2", "--pg-timeout", "2", str(SCRIPTS / "silent_peer.py"), timeout=90)
    assert time.monotonic() - start < 60  # the script itself sets no timeout: torch would wait 30 min
    assert res.returncode == 1 and "paratrain: rank 0 failed" in res.stderr
    assert "Timed out waiting 2000ms" in res.stderr, res.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
