"""``paratrain verify``: train your setup in parallel and in one process, and say whether they agree.

Examples:
  paratrain verify train_module:build                          # ddp on 2 processes
  paratrain verify train_module:build --strategy ddp,zero3,pipeline -n 2
  paratrain verify train_module:build --strategy hsdp -n 4 --steps 20
  paratrain verify train.py --batch 8 --strategy ddp,zero3 -n 2 --steps 5   # an unchanged script, no spec

A script (train.py) is launched unchanged, as `paratrain run` launches it; the arguments after it are the
script's, except verify's own flags (--strategy, -n, --steps...; a script flag of one of those names cannot be
given). Its Parallel takes the strategy given (default: the script's own); after K optimizer steps (default 10) the
script ends, and it runs again here in one process with Parallel("single"), its model fed what the parallel run fed
it inside par.step (the replicas' batches joined). Its model must get everything it trains on and return the loss
(model(x, y) -> (logits, loss)).

``build()`` returns a paratrain.verify.VerifySpec: the model as your script builds it, an optimizer factory
(over its parameters, or from the model), the loss (None when the model computes it), the training DataLoader
(per-rank batch size; None for your own loop reading its own data: the batches it fed are replayed), the options
your script gives Parallel (clip_grad_norm, seed, tp_plan...) and optionally your own loop. Each strategy trains K
steps on N processes (two epochs by default); the same setup then trains K steps here on the global batch,
from rank 0's initial weights, through the same loop, twice: the second time with its sums in another order,
which measures the noise floor. Losses, gradient norms and parameters are compared at every step, each
against 10x its floor (or a fixed --tolerance): PASS, or
FAIL with the first diverging step and parameter and the causes found (unsharded data, the same data on every
rank, missing reshuffle, loss not divided or divided twice under accumulation, a summed loss, unsynchronised
BatchNorm). Exit code 0 when
every strategy passes, 1 otherwise. See docs/verify.md.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "verify",
        help="check that a parallel run equals one process on the global batch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "factory", nargs="?", help="module:function returning a paratrain.verify.VerifySpec, or a script (train.py)"
    )
    p.add_argument(
        "script_args", nargs=argparse.REMAINDER, action=_ScriptArgs, help="the script's arguments (and verify's flags)"
    )
    add_flags(p)


def add_flags(p: argparse.ArgumentParser) -> None:
    """verify's flags, also read among a script's arguments."""
    p.add_argument(
        "--tf",
        action="store_true",
        help="TensorFlow: N Keras workers (MultiWorkerMirroredStrategy) vs one; the factory (optional, "
        "default the digits CNN) returns (model, x, y[, loss])",
    )
    p.add_argument(
        "--tf-mistake", choices=("none", "seed", "unsharded", "unscaled"), default="none", help=argparse.SUPPRESS
    )  # makes a usual mistake on purpose: the diagnosis is tested with it
    p.add_argument(
        "--strategy",
        "--strategies",
        dest="strategies",
        default=None,
        help="strategy, or several comma-separated (default: ddp; a script's own for a script)",
    )
    p.add_argument("-n", "--nproc", type=int, default=2, help="processes (default: 2)")
    p.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel degree inside ddp, zero2 and zero3 (the spec's tp_plan, else the model's "
        "built-in plan); a spec whose options give another tp is a one-line error",
    )
    p.add_argument(
        "--steps", type=int, help="optimizer steps to compare (default: two epochs, at most 50; 10 for a script)"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        help="judge with this fixed tolerance, relative to values above 1, instead of the noise floor "
        "measured by a second reference run (default: the floor)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the parallel job is stopped")
    p.add_argument(
        "--accelerator",
        default="auto",
        help="auto (a GPU per process when there are enough, else the CPU), cpu or cuda",
    )
    p.add_argument("--json", action="store_true", help="print the reports as JSON")


def execute(args: argparse.Namespace) -> int:
    from ..errors import ConfigError

    if args.factory is None:
        raise ConfigError("verify needs module:function or a script (or --tf) (see `paratrain verify --help`)")
    script_args = args.script_args
    script = args.factory.endswith(".py")
    if script_args and not script:
        raise ConfigError(f"verify: unknown arguments {' '.join(script_args)} (see `paratrain verify --help`)")
    from ..verify.command import verify_command

    return verify_command(
        factory=args.factory,
        strategies=args.strategies,
        nprocs=args.nproc,
        steps=args.steps,
        tolerance=args.tolerance,
        timeout_s=args.timeout,
        accelerator=args.accelerator,
        as_json=args.json,
        tp=args.tp,
        script_args=script_args if script else None,
    )


class _ScriptArgs(argparse.Action):
    """The arguments after the factory or script: verify's flags among them are read into the namespace as they are
    parsed (``--tf``, ``--steps``… count wherever they stand); the rest are the script's."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object, *_: object):
        flags = argparse.ArgumentParser(prog="paratrain verify", add_help=False)
        add_flags(flags)
        setattr(namespace, self.dest, flags.parse_known_args(list(values), namespace=namespace)[1])  # type: ignore[call-overload]
