"""``paratrain k8s``: the Kubeflow Trainer TrainJob it writes is valid against the published CRD (v2.3.0, stored in
``tests/fixtures``), its YAML reads back as the object, each node's command gives the layout the Trainer meant once
its ``PET_*`` variables are set, and bad input is one line."""

from __future__ import annotations

import json
import re

import pytest
from helpers.cli import in_process
from helpers.k8s_schema import load_crd, problems

from paratrain import ConfigError
from paratrain.cli.main import main
from paratrain.launcher.torchrun import parse_args
from paratrain.launcher.trainjob import TrainJobSpec, render_trainjob, trainjob

CRD = load_crd("trainjob-crd-v2.3.0.json")


def _spec(**kw) -> TrainJobSpec:
    base = dict(
        image="registry.example/team/train:1",
        target="train.py",
        target_args=("--lr", "3e-4"),
        nodes=4,
        gpus_per_node=8,
        cpus_per_node="32",
        memory_per_node="256Gi",
        namespace="research",
        env=("HF_HOME=/cache", 'NOTE=a: "b" # c \\ d\nnext line é'),
        run_args="--max-restarts 3",
    )
    return TrainJobSpec(**{**base, **kw})


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {
            "gpus_per_node": None,
            "cpus_per_node": None,
            "memory_per_node": None,
            "env": (),
            "namespace": None,
            "run_args": None,
            "target_args": (),
        },
        {"module": True, "target": "pkg.train", "nproc_per_node": 4, "name": "x" * 63},
    ],
)
def test_the_manifest_is_valid_against_the_trainjob_crd(kw):
    job = trainjob(_spec(**kw))
    assert problems(job, CRD) == []


def test_the_schema_check_bites():
    """The checker is what the tests above rely on: it must refuse what the API server refuses."""
    job = trainjob(_spec())
    job["spec"]["trainer"]["numNode"] = 2
    job["spec"]["trainer"]["numProcPerNode"] = "8"
    job["spec"]["trainer"]["env"].append({"name": "HF_HOME", "value": "/other"})
    job["spec"]["trainer"]["resourcesPerNode"]["limits"]["cpu"] = "lots"
    job["metadata"]["name"] = "Train_1"
    del job["spec"]["runtimeRef"]["name"]
    found = problems(job, CRD)
    for words in (
        ".spec.trainer.numNode: unknown field",
        ".spec.trainer.numProcPerNode: '8' is not an integer",
        ".spec.trainer.env: two items share the key",
        "limits.cpu: 'lots' does not match",
        "metadata.name: metadata.name must match RFC 1035",
        ".spec.runtimeRef.name: required",
    ):
        assert any(words in line for line in found), (words, found)


def test_the_yaml_reads_back_as_the_manifest_and_json_is_offered_too():
    yaml = pytest.importorskip("yaml")
    spec = _spec()
    text = render_trainjob(spec)
    assert text.startswith("# Written by `paratrain k8s`") and "kubectl apply -f" in text
    assert yaml.safe_load(text) == trainjob(spec)
    assert json.loads(render_trainjob(spec, as_json=True)) == trainjob(spec)


def test_each_node_gets_the_layout_from_the_variables_the_trainer_sets(monkeypatch):
    """What the Trainer's torch plugin does with the fields (PET_* from numNodes, numProcPerNode, the job index
    and the first pod's name on port 29500), then `paratrain run` parsing the node's command."""
    job = trainjob(_spec())
    trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
    assert trainer["command"][:2] == ["paratrain", "run"] and trainer["image"] == "registry.example/team/train:1"
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 8, "cpu": "32", "memory": "256Gi"}}
    pod = {
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_NODE_RANK": "3",
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
        "PET_MASTER_PORT": "29500",
    }
    for key, value in pod.items():
        monkeypatch.setenv(key, value)
    args = parse_args(trainer["command"][2:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank, args.master_addr, args.master_port) == (
        "4",
        "8",
        3,
        "train-node-0-0.train",
        29500,
    )
    assert (args.max_restarts, args.training_script, args.training_script_args) == (3, "train.py", ["--lr", "3e-4"])


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"target": "models/Train_v2.py"}, "train-v2"),
        ({"target": "2stage.py"}, "stage"),
        ({"target": "pkg.fine_tune", "module": True}, "fine-tune"),
        ({"target": "__main__.py"}, "main"),
        ({"target": "___.py"}, "paratrain"),
        ({"target": "t.py", "name": "mine"}, "mine"),
    ],
)
def test_the_job_is_named_after_the_script_as_a_dns_label(kw, name):
    assert _spec(**kw).job_name == name


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"nodes": 0}, "--nodes must be >= 1, got 0"),
        ({"nproc_per_node": 16}, "--nproc-per-node 16 is more than --gpus-per-node 8"),
        ({"name": "My_Job"}, "--name 'My_Job' is not a TrainJob name"),
        ({"name": "x" * 64}, "is not a TrainJob name"),
        ({"namespace": "Team A"}, "--namespace 'Team A' is not a Kubernetes namespace name"),
        ({"cpus_per_node": "4 cores"}, "--cpus-per-node '4 cores' is not a Kubernetes quantity"),
        ({"image": "my image"}, "--image 'my image' must be one word"),
        ({"env": ("NOEQUALS",)}, "--env 'NOEQUALS' must be KEY=VALUE"),
        ({"env": ("PET_NNODES=2",)}, "--env PET_NNODES: Kubeflow Trainer sets the PET_* variables itself"),
        (
            {"run_args": "--nnodes 2"},
            "--run-args '--nnodes': the Trainer gives every pod that through PET_*; use `paratrain k8s --nodes`",
        ),
        ({"run_args": "-n4"}, "use `paratrain k8s --nproc-per-node`"),
        (
            {"run_args": "--master-port=29400"},
            "--run-args '--master-port=29400': the Trainer gives every pod that through PET_*; leave it out",
        ),
        ({"run_args": "--rdzv-conf 'a"}, "cannot be split into words"),
        ({"target": ""}, "give the training script"),
    ],
)
def test_bad_trainjob_options_are_one_line_errors(kw, words):
    with pytest.raises(ConfigError, match=re.escape(words)) as info:
        _spec(**kw)
    assert "\n" not in str(info.value)


def test_the_pods_get_the_grace_period_the_ranks_save_in_and_the_launcher_waits_less():
    """terminationGracePeriodSeconds through the one patch a TrainJob may make to its pods, valid against the CRD;
    ``paratrain run`` waits 10 s less for its ranks, so it reports and exits before the kill; 0 leaves both alone."""
    job = trainjob(_spec(grace=300))
    assert problems(job, CRD) == []
    [patch] = job["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert patch["manager"] == "paratrain" and node["name"] == "node"
    assert node["template"]["spec"]["template"]["spec"] == {"terminationGracePeriodSeconds": 300}
    assert job["spec"]["trainer"]["command"][2:4] == ["--shutdown-timeout", "290"]
    node["template"]["spec"]["template"]["spec"]["restartPolicy"] = "Always"  # not a field a TrainJob may patch
    assert any("restartPolicy: unknown field" in line for line in problems(job, CRD))
    plain = trainjob(_spec(grace=0))
    assert "runtimePatches" not in plain["spec"] and "--shutdown-timeout" not in plain["spec"]["trainer"]["command"]
    given = trainjob(_spec(run_args="--shutdown-timeout 60"))["spec"]["trainer"]["command"]
    assert given.count("--shutdown-timeout") == 1 and "60" in given
    with pytest.raises(ConfigError, match="--grace 5 leaves no time to save"):
        _spec(grace=5)


def test_paratrain_k8s_prints_or_writes_the_manifest(tmp_path, capsys):
    out = tmp_path / "job.json"
    assert (
        main(
            [
                "k8s",
                "--image",
                "img:1",
                "-N",
                "2",
                "-n",
                "4",
                "--cpus-per-node",
                "16",
                "--env",
                "A=1",
                "--output",
                str(out),
                "train.py",
                "--epochs",
                "3",
            ]
        )
        == 0
    )
    assert f"kubectl apply -f {out}" in capsys.readouterr().err
    job = json.loads(out.read_text())
    assert problems(job, CRD) == []
    command = ["paratrain", "run", "--shutdown-timeout", "110", "train.py", "--epochs", "3"]
    assert job["spec"]["trainer"]["command"] == command
    assert (job["spec"]["trainer"]["numNodes"], job["spec"]["trainer"]["numProcPerNode"]) == (2, 4)
    assert main(["k8s", "--image", "img:1", "train.py"]) == 0
    assert 'kind: "TrainJob"' in capsys.readouterr().out
    for argv, words in (
        (["train.py"], "the following arguments are required: --image"),
        (["--image", "i", "--nodes", "0", "train.py"], "--nodes must be >= 1"),
        (["--image", "i", "--run-args=--rdzv-timout 9", "train.py"], "unrecognized arguments: --rdzv-timout"),
    ):
        code, err = in_process(["k8s", *argv])
        assert code == 2 and err.count("\n") == 1 and words in err, err
