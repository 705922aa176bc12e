"""MLflow: one MLflow run per job in the experiment named after the project, through an ``MlflowClient`` of its own
(MLflow's module-level active run is left alone: the script may use it for something else)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .base import RunInfo, Scalar, require

ENV_URI = "MLFLOW_TRACKING_URI"
PARAM_VALUE_LIMIT, PARAMS_PER_BATCH = 6000, 100
"""MLflow refuses longer parameter values, and more parameters in one request."""


@dataclass(frozen=True, kw_only=True)
class MLflowConfig:
    """``log_with=MLflowConfig(...)`` (or ``"mlflow"``): needs ``pip install 'paratrain[mlflow]'``."""

    name = "mlflow"
    fix = "check MLflowConfig.tracking_uri (or MLFLOW_TRACKING_URI)"
    tracking_uri: str | None = None
    """Where runs go: a server (``http://…``) or a database (``sqlite:///…``). None: ``MLFLOW_TRACKING_URI``, else
    ``sqlite:///<TrackerConfig.dir>/mlflow.db`` (``mlflow ui --backend-store-uri`` that URI shows it)."""
    experiment: str | None = None
    """The experiment (None: ``TrackerConfig.project``); made when missing."""
    tags: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require("mlflow", "mlflow", "MLflow")
        uri = self.tracking_uri or os.environ.get(ENV_URI, "sqlite:")
        if not uri.startswith(("http:", "https:", "databricks")):  # a database MLflow opens itself
            require("sqlalchemy", "mlflow", "an MLflow database")
            require("alembic", "mlflow", "an MLflow database")

    def open(self, run: RunInfo) -> MLflowTracker:
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri or os.environ.get(ENV_URI)
        if uri is None:
            run.dir.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(run.dir / 'mlflow.db').resolve()}"
        client = MlflowClient(tracking_uri=uri)
        name = self.experiment or run.project
        found = client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else client.create_experiment(name)
        started = client.create_run(experiment, run_name=run.run_name, tags=dict(self.tags))
        return MLflowTracker(client, started.info.run_id)


class MLflowTracker:
    """An open MLflow run. Metrics are queued to MLflow's own background thread (a local database takes ~25 ms a
    write, a server a round trip: not a step's business); ending the run writes what is queued."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def log_config(self, config: dict[str, Scalar]) -> None:
        from mlflow.entities import Param

        params = [Param(key, str(value)[:PARAM_VALUE_LIMIT]) for key, value in config.items()]
        for start in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + PARAMS_PER_BATCH])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(key, value, now, step) for key, value in metrics.items()], synchronous=False
        )

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")
