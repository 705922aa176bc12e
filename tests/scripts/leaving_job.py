"""A job whose ranks may leave, for tests/launcher/test_leaving.py (no process group, no parameter server).

Usage: paratrain run -n N leaving_job.py OUT_DIR [--leave 1,2] [--die 1@1.0] [--fail 2@2.0#1] [--fail-after 1]
       [--notice 1:1,2:1] [--work 4]

Every process writes OUT_DIR/pid-<attempt>-<rank>-<rejoin>. Ranks in ``--leave`` call ``allow_leaving``; a rank
named in ``--die`` SIGKILLs itself that many seconds into its work, a rank named in ``--fail`` raises then; both in
the original process only, of launch attempt 0 or the one after ``#``; with ``--fail-after R`` not before rank R's
first replacement has started. Every rank counts its work from the moment all of the attempt's ranks have
started. A rank that gets ``--notice`` (``RANK:N`` pairs, read by rank 0) waits on the notice store for the N-th
process of RANK and writes the value to OUT_DIR/notice-<RANK>-<N>. Each process that finishes its ``--work`` seconds
writes OUT_DIR/done-<rank>-<rejoin> (holding its attempt).
"""

import argparse
import os
import signal
import time
from datetime import timedelta

from paratrain.launcher.leaving import (
    allow_leaving,
    notice_key,
    notice_store,
    rejoin_count,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--leave", default="")
    parser.add_argument("--die", default="")
    parser.add_argument("--fail", default="")
    parser.add_argument(
        "--fail-after",
        type=int,
        default=None,
        help="--fail waits (working on) until this rank's first replacement has started",
    )
    parser.add_argument("--notice", default="")
    parser.add_argument("--work", type=float, default=4.0)
    args = parser.parse_args()
    rank, rejoin = int(os.environ["RANK"]), rejoin_count()
    tag = f"{rank}-{rejoin}"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    with open(os.path.join(args.out, f"pid-{attempt}-{tag}"), "w") as f:
        f.write(str(os.getpid()))
    if str(rank) in args.leave.split(","):
        assert allow_leaving(rank)
    die_at, fail_at = _when(args.die, rank, rejoin), _when(args.fail, rank, rejoin)
    notices = [tuple(map(int, item.split(":"))) for item in args.notice.split(",") if item] if rank == 0 else []
    after = None if args.fail_after is None else os.path.join(args.out, f"pid-{attempt}-{args.fail_after}-1")
    world = int(os.environ["WORLD_SIZE"])
    started = [os.path.join(args.out, f"pid-{attempt}-{r}-0") for r in range(world)]
    deadline = time.monotonic() + 60
    while not all(os.path.exists(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.05)  # the work starts once every rank of the attempt runs: imports take seconds under load
    start = time.monotonic()
    while time.monotonic() - start < (args.work if fail_at is None else 60):
        if die_at is not None and time.monotonic() - start >= die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if fail_at is not None and time.monotonic() - start >= fail_at and (after is None or os.path.exists(after)):
            raise RuntimeError(f"planted failure of rank {rank}")
        time.sleep(0.05)
    if notices:
        store = notice_store(timedelta(seconds=20))
        assert store is not None, "no notice store"
        for who, n in notices:
            key = notice_key(who, n)
            store.wait([key], timedelta(seconds=20))
            with open(os.path.join(args.out, f"notice-{who}-{n}"), "wb") as f:
                f.write(store.get(key))
    with open(os.path.join(args.out, f"done-{tag}"), "w") as f:
        f.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", ""))


def _when(spec: str, rank: int, rejoin: int) -> float | None:
    """Seconds into the work at which ``rank`` is named in ``spec`` (``RANK@S[#ATTEMPT],…``, attempt 0 unless
    given); None for a replacement and in other attempts."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for item in filter(None, spec.split(",")):
        who, _, rest = item.partition("@")
        seconds, _, when = rest.partition("#")
        if int(who) == rank and rejoin == 0 and (when or "0") == attempt:
            return float(seconds)
    return None


if __name__ == "__main__":
    main()
