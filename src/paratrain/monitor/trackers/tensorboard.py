"""TensorBoard: scalars in event files under a local folder (``tensorboard --logdir runs/tensorboard``).

The events are written with TensorBoard's record writer and protocol buffers alone. ``torch.utils.tensorboard``'s
``SummaryWriter`` is not used: it reaches ``tensorboard.compat.tf``, which imports TensorFlow wherever TensorFlow
is installed (seconds of start-up, and TensorFlow inside a torch process, which paratrain keeps apart).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from .base import RunInfo, Scalar, require


@dataclass(frozen=True, kw_only=True)
class TensorBoardConfig:
    """``log_with=TensorBoardConfig(...)`` (or ``"tensorboard"``): needs ``pip install 'paratrain[tensorboard]'``."""

    name = "tensorboard"
    fix = "check that TrackerConfig.dir (or TensorBoardConfig.dir) is a folder this process may write"
    dir: str | Path | None = None
    """Folder of this run's event files (None: ``<TrackerConfig.dir>/tensorboard/<project>/<run name or the
    start time>``, so runs sit side by side under one ``--logdir``)."""

    def __post_init__(self) -> None:
        require("tensorboard", "tensorboard", "TensorBoard")

    def open(self, run: RunInfo) -> TensorBoardTracker:
        folder = (
            self.dir
            if self.dir is not None
            else (run.dir / "tensorboard" / run.project / (run.run_name or time.strftime("%Y%m%d-%H%M%S")))
        )
        return TensorBoardTracker(folder)


class TensorBoardTracker:
    """One event file in ``folder``, flushed after every call, so a script that ends without ``par.close()`` (or
    is killed) still leaves every point it logged."""

    def __init__(self, folder: str | Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        now = time.time()  # the nanoseconds keep two writers of one process apart, even in one second
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"
        self.path = self.folder / name
        self._writer = RecordWriter(open(self.path, "wb"))
        self._write(Event(wall_time=now, file_version="brain.Event:2"))

    def _write(self, event: object) -> None:
        self._writer.write(event.SerializeToString())  # type: ignore[attr-defined]
        self._writer.flush()

    def log_config(self, config: dict[str, Scalar]) -> None:
        """As the text ``config`` at step 0 (TensorBoard's TEXT tab)."""
        from tensorboard.compat.proto import types_pb2
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        text = f"```\n{json.dumps(config, indent=2)}\n```".encode()
        tensor = TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[text],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        plugin = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        value = Summary.Value(tag="config", metadata=plugin, tensor=tensor)
        self._write(Event(wall_time=time.time(), step=0, summary=Summary(value=[value])))

    def log(self, metrics: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=name, simple_value=value) for name, value in metrics.items()]
        self._write(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def close(self, ok: bool) -> None:
        self._writer.close()
