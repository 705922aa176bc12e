"""Kubeflow Trainer's ``PET_*`` variables: read as ``paratrain run``'s flags, a bad one named in one line, the master's
name awaited inside a pod, and a two-"node" job on this host started with no flags but the variables (as the
Trainer starts each pod)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch
from helpers.cli import PARATRAIN, run_cli
from helpers.paths import SCRIPTS

from paratrain import LaunchError
from paratrain.launcher import network
from paratrain.launcher.multinode import prepare_network
from paratrain.launcher.ports import free_port
from paratrain.launcher.torchrun import parse_args, resolve

SCRIPT = str(SCRIPTS / "plain_torchrun.py")
TRAIN = str(SCRIPTS / "cluster_train.py")


def _pod(node_rank: int, port: int, **extra: str) -> dict[str, str]:
    """What Kubeflow Trainer sets in the pod of node ``node_rank`` of a 2-node job, one process per node."""
    return {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": "localhost",
        "PET_MASTER_PORT": str(port),
        **extra,
    }


def test_pet_variables_are_paratrain_runs_flags_and_explicit_flags_win(monkeypatch):
    for key, value in _pod(1, 29500, PET_NPROC_PER_NODE="3").items():
        monkeypatch.setenv(key, value)
    args = parse_args([SCRIPT])
    assert (args.nnodes, args.nproc_per_node, args.node_rank, args.master_addr, args.master_port) == (
        "2",
        "3",
        1,
        "localhost",
        29500,
    )
    args = resolve(
        parse_args(["-n", "1", "--node-rank", "0", "--master-port", str(free_port()), SCRIPT]), note=lambda _: None
    )
    assert (args.nnodes, args.nproc_per_node, args.node_rank, args.master_addr) == ("2", 1, 0, "localhost")


@pytest.mark.parametrize(
    "name, value, words",
    [
        ("PET_NNODES", "two", "PET_NNODES='two' is not a node count N or MIN:MAX"),
        ("PET_NPROC_PER_NODE", "0", "PET_NPROC_PER_NODE='0' is not a number of processes >= 1"),
        ("PET_NODE_RANK", "x", "PET_NODE_RANK='x' is not a node rank"),
        ("PET_NODE_RANK", "2", "PET_NODE_RANK='2' is outside a job of PET_NNODES=2 (node ranks are 0 … 1)"),
        ("PET_MASTER_ADDR", " ", "PET_MASTER_ADDR=' ' is empty"),
        ("PET_MASTER_PORT", "70000", "PET_MASTER_PORT='70000' is not a TCP port"),
    ],
)
def test_a_bad_pet_variable_is_one_line_naming_it(monkeypatch, name, value, words):
    for key, val in _pod(0, 29500, **{name: value}).items():
        monkeypatch.setenv(key, val)
    with pytest.raises(LaunchError, match=re.escape(words)) as info:
        parse_args([SCRIPT])
    message = str(info.value)
    assert "\n" not in message and "Kubeflow Trainer sets them" in message and message.endswith("or unset it")


def _late_name(monkeypatch, misses: int) -> list[str]:
    """``address_of`` that finds nothing ``misses`` times, then loopback; returns the hosts asked for."""
    asked: list[str] = []

    def address_of(host: str) -> str | None:
        asked.append(host)
        return "127.0.0.1" if len(asked) > misses else None

    monkeypatch.setattr(network, "address_of", address_of)
    monkeypatch.setattr(network, "_RESOLVE_POLL_S", 0.01)
    return asked


def test_in_a_pod_a_node_waits_for_the_masters_name(monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    asked = _late_name(monkeypatch, misses=3)
    notes: list[str] = []
    prepare_network(parse_args(["--nnodes", "2", "--master-addr", "job-node-0-0.job", SCRIPT]), notes.append)
    assert asked == ["job-node-0-0.job"] * 4
    assert notes[0] == "waiting up to 600 s for job-node-0-0.job to resolve (Kubernetes names a pod once it runs)"


def test_in_a_pod_a_name_that_never_resolves_fails_after_the_rendezvous_wait(monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    _late_name(monkeypatch, misses=10**9)
    args = parse_args(["--nnodes", "2", "--master-addr", "job-node-0-0.job", "--rdzv-timeout", "1", SCRIPT])
    with pytest.raises(LaunchError, match="'job-node-0-0.job' does not resolve on this node within 1 s"):
        resolve(args, note=lambda _: None)


def test_outside_a_pod_a_name_that_does_not_resolve_fails_at_once(monkeypatch):
    asked = _late_name(monkeypatch, misses=1)
    with pytest.raises(LaunchError, match="does not resolve on this node; give its IP"):
        prepare_network(parse_args(["--nnodes", "2", "--master-addr", "node0", SCRIPT]), lambda _: None)
    assert asked == ["node0"]


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_pods_started_by_their_pet_variables_train_like_paratrain_run(tmp_path):
    """Two `paratrain run train.py` with no flags, each with its pod's PET_* variables, on this host."""
    reference, pods = tmp_path / "reference", tmp_path / "pods"
    reference.mkdir(), pods.mkdir()
    res = run_cli("run", "-n", "2", TRAIN, reference, timeout=90)
    assert res.returncode == 0, res.stderr
    port = free_port()
    procs = [
        subprocess.Popen(
            [*PARATRAIN, "run", TRAIN, str(pods)],
            env={**os.environ, **_pod(node, port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        results = [proc.communicate(timeout=90) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for proc, (_, err) in zip(procs, results):
        assert proc.returncode == 0, err
    ranks = [(pods / f"rank{r}.json").read_text() for r in range(2)]
    assert all('"world": 2' in r and '"local_rank": 0' in r for r in ranks)  # one process on each "node"
    got, want = torch.load(pods / "params.pt"), torch.load(reference / "params.pt")
    assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k], atol=1e-6, rtol=0) for k in got)
