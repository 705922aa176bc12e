"""The pieces of a multi-node launch that need no second host: routes and interfaces, rendezvous timeouts and
their messages, the nodes' --nnodes agreement over a real store, the default process-group timeout."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers.paths import SCRIPTS
from torch.distributed import distributed_c10d
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

from paratrain import LaunchError
from paratrain.errors import RankFailedError
from paratrain.launcher import network
from paratrain.launcher.agreement import NNODES_VAR, check_same_nnodes
from paratrain.launcher.failure import format_failure
from paratrain.launcher.multinode import prepare_network, rendezvous_error
from paratrain.launcher.pg_timeout import PG_TIMEOUT_VAR, apply_default_pg_timeout
from paratrain.launcher.ports import free_port
from paratrain.launcher.torchrun import parse_args, resolve

SCRIPT = str(SCRIPTS / "plain_torchrun.py")


def test_the_route_to_a_host_names_the_local_address_and_interface():
    assert network.route_source("127.0.0.1") == "127.0.0.1"
    assert network.interface_of("127.0.0.1") == "lo"
    assert network.is_own_address("127.0.0.1") and not network.is_own_address("198.51.100.7")
    assert network.address_of("localhost") == "127.0.0.1" and network.address_of("no-such-host.invalid") is None


def _args(argv: list[str]):
    return resolve(parse_args([*argv, SCRIPT]), note=lambda _: None)


def test_rdzv_timeout_sets_the_key_each_rendezvous_reads_and_rdzv_conf_wins():
    assert _args(["--nnodes", "2", "--rdzv-timeout", "5"]).rdzv_conf == "timeout=5"
    c10d = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"]
    assert _args([*c10d, "--rdzv-timeout", "5"]).rdzv_conf == "join_timeout=5,read_timeout=5"
    assert _args([*c10d, "--rdzv-timeout", "900"]).rdzv_conf == "join_timeout=900,read_timeout=60"
    assert (
        _args([*c10d, "--rdzv-conf", "join_timeout=7", "--rdzv-timeout", "900"]).rdzv_conf
        == "join_timeout=7,read_timeout=60"
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--rdzv-timeout", "0"], "--rdzv-timeout must be at least 1"),
        (["--nnodes", "3:2"], "--nnodes must be N or MIN:MAX"),
        (["--nnodes", "two"], "--nnodes must be N or MIN:MAX"),
        (["--pg-timeout", "0"], "--pg-timeout must be > 0"),
        (["--nnodes", "2", "--master-addr", "no-such-host.invalid"], "does not resolve on this node"),
    ],
)
def test_bad_multinode_flags_are_one_line_errors(argv, words):
    with pytest.raises(LaunchError, match=words) as info:
        _args(argv)
    assert "\n" not in str(info.value)


def test_a_master_name_that_is_loopback_on_this_node_is_noted(monkeypatch):
    monkeypatch.setattr(network, "address_of", lambda host: "127.0.1.1")  # Debian's /etc/hosts line for itself
    notes: list[str] = []
    prepare_network(parse_args(["--nnodes", "2", "--master-addr", "node0", SCRIPT]), notes.append)
    assert len(notes) == 1 and "node0 resolves to 127.0.1.1 (loopback)" in notes[0]
    assert "other nodes cannot reach" in notes[0]


@pytest.mark.parametrize(
    "backend, err, words",
    [
        (
            "static",
            dist.DistNetworkError("failed to connect to 10.0.0.9:1 (errno: 113 - No route to host)."),
            "could not reach the rendezvous at 10.0.0.9:29500 within 600 s (No route to host); check that node 0",
        ),
        (
            "static",
            dist.DistStoreError("Timed out after 9 seconds waiting for clients. 2/3 clients joined."),
            "only 2 of 3 nodes joined the rendezvous at 10.0.0.9:29500 within 600 s; start every node with the same "
            "--nnodes and --master-addr/--master-port",
        ),
        (
            "static",
            dist.DistStoreError("wait timeout after 8000ms, keys: /none/torchelastic/assigned_ranks/1"),
            "the rendezvous at 10.0.0.9:29500 did not complete within 600 s (wait timeout after 8000ms",
        ),
        (
            "c10d",
            RendezvousTimeoutError(),
            "did not complete within 600 s: fewer than 2 nodes joined; start every "
            "node with the same --nnodes and --rdzv-endpoint/--rdzv-id",
        ),
        (
            "c10d",
            RendezvousConnectionError("The connection to the C10d store has failed."),
            "could not reach the rendezvous at 10.0.0.9:29400 within 600 s;",
        ),
        (
            "c10d",
            RendezvousConnectionError("recv: Connection reset by peer"),
            "lost the connection to the rendezvous at 10.0.0.9:29400 before it completed",
        ),
    ],
)
def test_rendezvous_failures_become_one_line_with_the_address_and_the_wait(backend, err, words):
    argv = (
        ["--nnodes", "2", "--master-addr", "10.0.0.9"]
        if backend == "static"
        else ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.9"]
    )
    message = str(rendezvous_error(parse_args([*argv, SCRIPT]), err))
    assert words in message and "\n" not in message


@pytest.fixture
def store():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server, port
    del server


def _node_env(port: int, node: int, nnodes: str) -> dict[str, str]:
    return {
        NNODES_VAR: nnodes,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "4",
    }


def test_nodes_that_agree_on_nnodes_pass_and_a_disagreeing_one_is_named(store):
    server, port = store
    server.set("paratrain/nnodes/0/4/1", "2:2")  # node 1 published its --nnodes
    check_same_nnodes(_node_env(port, 0, "2:2"), timeout_s=5)
    server.set("paratrain/nnodes/0/4/1", "3:3")
    with pytest.raises(
        LaunchError,
        match="node 1 was started with --nnodes 3 but node 0 .this one. with "
        "--nnodes 2; start every node with the same --nnodes",
    ):
        check_same_nnodes(_node_env(port, 0, "2:2"), timeout_s=5)
    with pytest.raises(LaunchError, match="node 0 was started with --nnodes 2:4 but node 1"):
        server.set("paratrain/nnodes/0/4/0", "2:4")
        check_same_nnodes(_node_env(port, 1, "3:3"), timeout_s=5)


def test_the_agreement_check_is_skipped_without_the_agent_store():
    check_same_nnodes({NNODES_VAR: "2:2", "TORCHELASTIC_USE_AGENT_STORE": "False"})
    check_same_nnodes({})


def test_the_launchers_pg_timeout_becomes_torchs_default(monkeypatch):
    monkeypatch.setattr(distributed_c10d, "default_pg_timeout", distributed_c10d.default_pg_timeout)
    apply_default_pg_timeout({PG_TIMEOUT_VAR: "7"})
    assert distributed_c10d._get_default_timeout(dist.Backend("gloo")) == timedelta(seconds=7)


def test_a_rank_that_only_lost_a_peer_points_to_the_other_node():
    err = RankFailedError(
        rank=0,
        exitcode=1,
        host="h",
        pid=1,
        traceback="Traceback…\nRuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:1",
    )
    assert "lost a peer that failed first" in format_failure(err)
