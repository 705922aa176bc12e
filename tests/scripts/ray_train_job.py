"""Ray Train runs cluster_train.py, a paratrain script, unchanged, on a local Ray cluster with 2 CPU workers.

Usage: python ray_train_job.py OUT_DIR RAY_TEMP_DIR
Runs the script twice: under ddp with Ray's default ``init_method="env"``, and under zero3 with ``"tcp"`` (the
workers then have no MASTER_ADDR); OUT_DIR/ddp and OUT_DIR/zero3 receive what the script writes. Ray keeps its
sockets, logs and results under RAY_TEMP_DIR, and the local cluster is shut down at the end, also after a failure.
"""

import os
import sys

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

import paratrain

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_train.py")

if __name__ == "__main__":
    out, temp = sys.argv[1:3]
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp)
    try:
        for strategy, init_method in (("ddp", "env"), ("zero3", "tcp")):
            target = os.path.join(out, strategy)
            os.makedirs(target)
            TorchTrainer(
                paratrain.ray_train_loop(SCRIPT, target, "--strategy", strategy),
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                torch_config=TorchConfig(backend="gloo", init_method=init_method),
                run_config=RunConfig(name=f"paratrain-{strategy}", storage_path=os.path.join(temp, "results")),
            ).fit()
    finally:
        ray.shutdown()
