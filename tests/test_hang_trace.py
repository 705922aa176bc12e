"""The workers' side of the flight-recorder traces, in one process: the environment the launcher gives them, which
trace a rank keeps, and the request every rank answers over a real store."""

import pickle
import time
from datetime import timedelta

import pytest

from paratrain import hang_trace
from paratrain.hang_trace import (
    BUFFER_VAR,
    FILE_PREFIX,
    TRACE_DIR_VAR,
    TraceDumps,
    ask_for_traces,
    dump_trace,
    recorder_environ,
)
from paratrain.launcher.hang_report import read_traces


def _trace(record: int, retired: bool) -> bytes:
    entry = {"record_id": record, "collective_seq_id": record + 1, "retired": retired}
    return pickle.dumps({"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": [entry]})


@pytest.fixture
def recorder(monkeypatch):
    """torch's ``_dump_fr_trace`` answering with the traces a test queues (the last one again once they run out)."""
    from torch._C import _distributed_c10d

    queue: list[bytes] = []

    def dump(**_: bool) -> bytes:
        return queue.pop(0) if len(queue) > 1 else queue[0]

    monkeypatch.setattr(_distributed_c10d, "_dump_fr_trace", dump)
    return queue


def test_the_recorder_is_on_unless_the_user_set_its_size_and_nccl_dumps_where_the_report_reads(tmp_path, recorder):
    env = recorder_environ(str(tmp_path), {})
    assert env[BUFFER_VAR] == "2000" and env[TRACE_DIR_VAR] == str(tmp_path)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "rank_")
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in recorder_environ(str(tmp_path), {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})
    assert BUFFER_VAR not in recorder_environ(str(tmp_path), {BUFFER_VAR: "0"})
    assert BUFFER_VAR not in recorder_environ(str(tmp_path), {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"})
    # NCCL's watchdog writes <TORCH_FR_DUMP_TEMP_FILE><rank> on a timeout: the report must read those files too.
    recorder.append(_trace(0, retired=False))
    nccl_file = env["TORCH_FR_DUMP_TEMP_FILE"] + "3"
    with open(nccl_file, "wb") as f:
        f.write(recorder[0])
    assert list(read_traces(str(tmp_path))) == [3]
    worker = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **env}
    assert TraceDumps.from_environ(worker) is not None
    assert TraceDumps.from_environ({**worker, BUFFER_VAR: "0"}) is None


def test_a_rank_keeps_the_trace_taken_while_it_waited_over_one_taken_after_its_timeout(tmp_path, recorder):
    """gloo marks a timed-out collective completed: the later trace of the same collectives says less."""
    path = tmp_path / f"{FILE_PREFIX}0"
    recorder.append(_trace(5, retired=False))
    assert dump_trace(str(tmp_path), 0)
    recorder[:] = [_trace(5, retired=True)]
    assert not dump_trace(str(tmp_path), 0)
    assert pickle.loads(path.read_bytes())["entries"][-1]["retired"] is False
    recorder[:] = [_trace(6, retired=True)]  # the job went on: a newer trace replaces it
    assert dump_trace(str(tmp_path), 0)
    assert pickle.loads(path.read_bytes())["entries"][-1]["record_id"] == 6
    restarted = {**pickle.loads(path.read_bytes()), "pid": -1}  # an earlier attempt's process wrote it
    path.write_bytes(pickle.dumps(restarted))
    recorder[:] = [_trace(0, retired=True)]
    assert dump_trace(str(tmp_path), 0)


def test_a_collective_gloo_has_not_yet_marked_completed_is_waited_for_a_moment(tmp_path, recorder):
    recorder[:] = [_trace(2, retired=False), _trace(2, retired=True)]  # the second look sees it completed
    assert dump_trace(str(tmp_path), 1)
    assert pickle.loads((tmp_path / f"{FILE_PREFIX}1").read_bytes())["entries"][-1]["retired"] is True


def test_a_request_has_every_rank_write_its_trace_and_waits_for_them(tmp_path, recorder, monkeypatch):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), TRACE_DIR_VAR: str(tmp_path)}
    recorder.append(_trace(4, retired=True))
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)  # the thread waits for a process group
    peer = TraceDumps.from_environ({**env, "RANK": "1"})
    serving = peer.start()  # rank 1's thread, waiting on the store
    TraceDumps.from_environ({**env, "RANK": "0"}).request()  # rank 0's collective timed out: it asks, then fails
    start = time.monotonic()
    ask_for_traces({**env, "RANK": "0"}, [1], wait_s=10)  # the launcher, before it stops rank 1
    assert time.monotonic() - start < 5  # it waited for rank 1's answer, not for the whole bound
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0", "rank_1"]
    assert int(store.get("paratrain/trace/0/done/1")) >= 1
    del store  # the job's end: rank 1's thread stops waiting
    serving.join(timeout=10)
    assert not serving.is_alive()
    monkeypatch.setattr(hang_trace, "recorder_available", lambda: False)  # a torch without _dump_fr_trace
    assert TraceDumps.from_environ({**env, "RANK": "0"}) is None
