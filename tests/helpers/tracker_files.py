"""What the trackers left on disk, read back as plain data, each by its own format's reader: TensorBoard's record
reader (its TensorFlow-free one, with the CRC checks), W&B's transaction log parsed with W&B's protocol buffers,
and MLflow's database through an ``MlflowClient``.

Each returns ``{"config": {...}, "scalars": {name: [(step, value), ...]}}`` per run.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any


def tensorboard_runs(root: str | Path) -> dict[str, dict[str, Any]]:
    """Every event file under ``root``, keyed by its path relative to ``root``."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    runs = {}
    for path in sorted(Path(root).rglob("events.out.tfevents.*")):
        reader = PyRecordReader_New(str(path))
        scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
        config: dict[str, Any] = {}
        while True:
            try:
                reader.GetNext()
            except errors.OutOfRangeError:
                break
            event = Event.FromString(reader.record())
            for value in event.summary.value:
                if value.HasField("tensor"):  # the text summary of the configuration
                    text = value.tensor.string_val[0].decode()
                    config = json.loads(text.strip("`\n"))
                else:
                    scalars[value.tag].append((event.step, value.simple_value))
        runs[str(path.relative_to(root))] = {"config": config, "scalars": dict(scalars)}
    return runs


def _leveldb_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log: a 7-byte header, then LevelDB's log format (32 KiB blocks of chunks, each
    with a CRC-32 over its type and data, a length and a type: full, first, middle, last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: damaged chunk at byte {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def wandb_runs(root: str | Path) -> dict[str, dict[str, Any]]:
    """Every offline W&B run under ``root`` (``<root>/wandb/offline-run-*``), keyed by its folder's name."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = {}
    for path in sorted(Path(root).glob("wandb/offline-run-*/run-*.wandb")):
        scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
        config: dict[str, Any] = {}
        project = name = None
        for data in _leveldb_records(path):
            record = pb.Record.FromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                project, name = record.run.project, record.run.display_name
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):  # W&B's own: _step, _runtime, _timestamp
                        scalars[key].append((record.history.step.num, json.loads(item.value_json)))
        config = {
            k: v["value"] if isinstance(v, dict) and "value" in v else v
            for k, v in config.items()
            if not k.startswith("_")
        }
        runs[path.parent.name] = {"project": project, "name": name, "config": config, "scalars": dict(scalars)}
    return runs


def mlflow_runs(uri: str) -> dict[str, dict[str, Any]]:
    """Every run of every experiment in the MLflow store at ``uri``, keyed by ``<experiment>/<run name>``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = {}
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            scalars = {
                key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                for key in run.data.metrics
            }
            runs[f"{experiment.name}/{run.info.run_name}"] = {
                "config": dict(run.data.params),
                "scalars": scalars,
                "status": run.info.status,
            }
    return runs
