"""The digits demo with faults planted in its parameter server (the last rank), one fault per attempt of the job.

Usage: paratrain run -n 3 [--max-restarts K] ps_server_faults.py FAULTS DEMO_ARGS...
FAULTS is a comma-separated list, the i-th for attempt i (``TORCHELASTIC_RESTART_COUNT``; attempts past its end
run clean):

* ``none``: no fault on this attempt;
* ``request:N``: the server is SIGKILLed as its N-th request of the attempt arrives, before it acts on it (in the
  middle of a synchronous step when it is a push: the pushes of that step summed so far are lost with it);
* ``save``: the server is SIGKILLed inside its first shard write of the attempt, after DCP wrote the tensor data
  and before its ``.metadata``: a half-written shard in the checkpoint being saved.

The demo's own ``--fail-at-step``/``--fail-rank`` (a worker killed on the first attempt) still work beside them.
Each planted kill says so on stderr in one line starting ``ps_server_faults:``. With ``PS_SERVER_FAULTS_PIDS=DIR``
every rank of every attempt writes its pid to ``DIR/<attempt>-<rank>.pid``, so a test can check that none is left.
"""

import os
import signal
import sys

from paratrain.demo import main


def _die(what: str) -> None:
    print(f"ps_server_faults: SIGKILL server rank {os.environ['RANK']} {what}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def plant(fault: str) -> None:
    if fault.startswith("request:"):
        from paratrain.distributed.param_server.messages import KIND_NAMES
        from paratrain.distributed.param_server.server import Server

        handle, target, seen = Server._handle, int(fault.split(":")[1]), [0]

        def handle_or_die(self, src, header, payload):
            seen[0] += 1
            if seen[0] == target:
                _die(
                    f"as its request {target} arrives ({KIND_NAMES.get(header.kind, header.kind)} from rank {src}, "
                    f"server version {self.version})"
                )
            return handle(self, src, header, payload)

        Server._handle = handle_or_die
    elif fault == "save":
        from torch.distributed.checkpoint import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()
            _die(f"inside its shard write into {self.path}, after the tensor data, before .metadata")

        FileSystemWriter.write_data = write_then_die
    elif fault != "none":
        raise SystemExit(f"ps_server_faults: unknown fault {fault!r}")


if __name__ == "__main__":
    faults = sys.argv[1].split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("PS_SERVER_FAULTS_PIDS"):
        with open(os.path.join(os.environ["PS_SERVER_FAULTS_PIDS"], f"{attempt}-{os.environ['RANK']}.pid"), "w") as f:
            f.write(str(os.getpid()))
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1 and attempt < len(faults):
        plant(faults[attempt])
    main(sys.argv[2:])
