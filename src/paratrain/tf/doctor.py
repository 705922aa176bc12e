"""The doctor's TensorFlow section: version, which Keras the workers get, the devices TensorFlow sees, the
``TF_CONFIG`` of this shell, and scripts that would put torch and TensorFlow in one process.

The doctor itself imports torch, so TensorFlow is imported only in a child process (a few seconds); versions
and the Keras choice are read without importing anything (:mod:`paratrain.tf.install`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata

from ..doctor.checks import Check
from ..doctor.scripts import imported
from ..errors import LaunchError
from ..launcher.ports import port_in_use
from .config import TF_CONFIG_VAR, parse_tf_config, split_address
from .install import INSTALL_HINT, LEGACY_KERAS_VAR, KerasChoice, installed, keras_choice

_PROBE = (
    "import json, tensorflow as tf; "
    "print(json.dumps([d.name.replace('/physical_device:', '') for d in tf.config.list_physical_devices()]))"
)


@dataclass(frozen=True)
class TFFacts:
    """What the TensorFlow section is judged from (tests build these by hand)."""

    version: str
    keras: KerasChoice
    keras_version: str | None
    tf_keras_version: str | None
    devices: tuple[str, ...] | None
    """Devices a TensorFlow worker sees, or None when the probe failed (``probe_error`` says why)."""
    probe_error: str | None = None
    tf_config: str | None = None


def gather_tf(environ: Mapping[str, str] | None = None, timeout_s: float = 90.0) -> TFFacts | None:
    """The facts, or None when TensorFlow is not installed (the doctor then has no TensorFlow section)."""
    env = dict(os.environ if environ is None else environ)
    if not installed("tensorflow"):
        return None
    choice = keras_choice(env)
    probe_env = {**env, "TF_CPP_MIN_LOG_LEVEL": "3"}
    if choice.set_by_us:
        probe_env[LEGACY_KERAS_VAR] = "1"
    devices, error = None, None
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, env=probe_env
        )
        if out.returncode == 0:
            devices = tuple(json.loads(out.stdout.strip().splitlines()[-1]))
        else:
            error = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        error = f"{type(e).__name__}: {e}"
    return TFFacts(
        version=_version("tensorflow") or "?",
        keras=choice,
        keras_version=_version("keras"),
        tf_keras_version=_version("tf-keras"),
        devices=devices,
        probe_error=error,
        tf_config=env.get(TF_CONFIG_VAR) or None,
    )


def tf_checks(facts: TFFacts | None, scripts: tuple[str, ...] = ()) -> list[Check]:
    """The section's lines: none without TensorFlow (unless a script asks for it)."""
    checks: list[Check] = []
    if facts is None:
        if any(_imports_or_none(s) & {"tensorflow", "keras", "tf_keras"} for s in scripts):
            checks.append(Check.fail("tensorflow", "not installed, and the script imports it", INSTALL_HINT))
    else:
        checks += [_check_tensorflow(facts), _check_keras(facts)]
        if facts.tf_config is not None:
            checks.append(check_tf_config(facts.tf_config))
    checks += [check_script(script) for script in scripts]
    return checks


def _imports_or_none(path: str) -> set[str]:
    """The script's imports, or none when it cannot be read (``check_script`` then says so)."""
    try:
        return _imports(path)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return set()


def _check_tensorflow(facts: TFFacts) -> Check:
    if facts.devices is None:
        return Check.fail(
            "tensorflow",
            f"TensorFlow {facts.version} installed but does not start: {facts.probe_error}",
            "reinstall it: pip install --force-reinstall 'paratrain[tf]'",
        )
    gpus = [d for d in facts.devices if d.startswith("GPU")]
    return Check.ok(
        "tensorflow",
        f"TensorFlow {facts.version}, sees {', '.join(facts.devices)}" + ("" if gpus else " (no GPU: CPU workers)"),
    )


def _check_keras(facts: TFFacts) -> Check:
    if facts.keras.legacy:
        how = "paratrain run --tf sets TF_USE_LEGACY_KERAS=1" if facts.keras.set_by_us else "your TF_USE_LEGACY_KERAS"
        return Check.ok(
            "keras",
            f"tf.keras = tf-keras {facts.tf_keras_version or '?'} ({how}): model.fit works "
            "under MultiWorkerMirroredStrategy",
        )
    return Check.warn(
        "keras",
        f"tf.keras = Keras {facts.keras_version or '?'}: its model.fit fails under "
        "MultiWorkerMirroredStrategy (keras#20585)",
        "pip install 'paratrain[tf]' (tf-keras), or unset TF_USE_LEGACY_KERAS=0",
    )


def check_tf_config(text: str) -> Check:
    """``TF_CONFIG`` parses, its index is in range, and this task's own address is here with a free port."""
    try:
        config = parse_tf_config(text)
    except LaunchError as e:
        return Check.fail("TF_CONFIG", str(e), "fix TF_CONFIG, or unset it and let `paratrain run --tf` write it")
    from ..launcher.network import address_of, is_own_address

    host, port = split_address(config.address)
    where = f"{config.task_type} {config.task_index} of {config.num_workers}, {config.address}"
    address = address_of(host)
    if address is None or not is_own_address(address):
        return Check.warn(
            "TF_CONFIG",
            f"{where}: {host} is not an address of this machine",
            "run this task on the machine its address names, or fix the task index",
        )
    if port_in_use("0.0.0.0", port):
        return Check.fail(
            "TF_CONFIG",
            f"{where}: port {port} is already in use here",
            "stop what listens there or give this task another port",
        )
    return Check.ok("TF_CONFIG", f"{where}: valid, the address is here and the port free")


def check_script(path: str) -> Check:
    """A script that imports both torch and TensorFlow runs both in one process: warned, never launched so."""
    try:
        found = _imports(path)
    except (OSError, SyntaxError) as e:
        return Check.warn("script imports", f"cannot read {path}: {e}", "check the path")
    frameworks = sorted(found & {"torch", "tensorflow", "keras", "tf_keras"})
    if "torch" in found and found & {"tensorflow", "keras", "tf_keras"}:
        return Check.warn(
            "script imports",
            f"{path} imports {' and '.join(frameworks)}: both frameworks in one "
            "process (they fight over threads and GPU memory; `paratrain run --tf` refuses torch)",
            "split it: the TensorFlow part under `paratrain run --tf`, the torch part under `paratrain run`",
        )
    return Check.ok("script imports", f"{path} imports {', '.join(frameworks) or 'neither torch nor TensorFlow'}")


def _imports(path: str) -> set[str]:
    """The top-level packages the script at ``path`` imports."""
    with open(path) as f:
        return {name.split(".")[0] for name, _ in imported(f.read(), path)}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
