"""``Trackers``: the trackers of one ``Parallel``, open on rank 0 only, each receiving the same metrics at the same
steps: the script's (``par.log``) and the monitor's figures."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ...errors import ConfigError
from .base import Tracker, TrackerSpec, as_floats, checked_metrics, checked_step, flat_config
from .config import TrackerConfig


class Trackers:
    """Where ``par.log`` goes (``par.trackers``).

    Args:
        config: the trackers and their run (None: nothing is tracked, and ``log`` only checks its input).
        active: True on the one rank that writes (global rank 0): the others open nothing, import no client, and
            write no file.
        describe: paratrain's side of the run's configuration, read at the first write (``auto`` has chosen its
            strategy by then).
    """

    def __init__(
        self, config: TrackerConfig | None, *, active: bool, describe: Callable[[], Mapping[str, Any]] = dict
    ) -> None:
        self.config = config
        self._describe = describe
        self._described = False
        self._open: list[Tracker] = []
        if config is not None and active:
            for spec in config.trackers:
                self._open.append(_started(spec, config))

    @property
    def active(self) -> bool:
        """Whether this rank writes (rank 0, with at least one tracker)."""
        return bool(self._open)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` at ``step`` in every tracker (rank 0); elsewhere only check them."""
        checked_step(step)
        checked_metrics(metrics)
        if not self._open or not metrics:
            return
        self._describe_run()
        values = as_floats(metrics)
        for tracker in self._open:
            tracker.log(values, step)

    def _describe_run(self) -> None:
        if self._described:
            return
        self._described = True
        assert self.config is not None
        config = flat_config({**self.config.config, "paratrain": dict(self._describe())})
        for tracker in self._open:
            tracker.log_config(config)

    def close(self, ok: bool = True) -> None:
        """End every run (the configuration is logged even when no metric was)."""
        if self._open and ok:
            self._describe_run()
        opened, self._open = self._open, []
        for tracker in opened:
            tracker.close(ok)


def _started(spec: TrackerSpec, config: TrackerConfig) -> Tracker:
    """A tracker's run, or one line saying why it could not start (a login, a server, a folder) and what to do."""
    try:
        return spec.open(config.run)
    except ConfigError:
        raise
    except Exception as err:  # the clients raise their own types, many of them; each ends here as one line
        reason = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ConfigError(f"{spec.name} could not start a run: {reason}; {spec.fix}") from err
