"""The shape of the strategy base: what every strategy needs on ``Strategy``, the parameter server's own hooks on its
part (``Strategy.server``), and hooks named for what they return."""

import inspect
from types import SimpleNamespace

import torch
from torch import nn

from paratrain.rank_alone import guard_model, guard_optimizer
from paratrain.strategies import available, create
from paratrain.strategies.base import Strategy
from paratrain.strategies.param_server import ServerRole
from paratrain.strategies.serving import NoServer


def _hooks(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_the_servers_hooks_live_on_their_part_not_on_the_base():
    on_both = _hooks(NoServer) & {name for name in dir(Strategy) if not name.startswith("_")}
    assert not on_both, f"parameter-server hooks on the Strategy base: {sorted(on_both)}"
    assert _hooks(ServerRole) - {"is_server"} <= _hooks(NoServer), "a server hook NoServer does not answer"


def test_a_strategy_without_servers_holds_the_stateless_part_where_every_rank_trains():
    for name in set(available()) - {"auto", "ps"}:
        server = create(name).server
        assert type(server) is NoServer and not server.serves, name
    none = create("ddp").server
    assert (none.close(), none.steps_taken(), none.checkpoint_group(), none.clips_in_step(None, 1.0)) == (
        True,
        0,
        None,
        False,
    )
    ps = create("ps").server
    assert isinstance(ps, ServerRole) and ps.serves


def test_hooks_are_named_for_what_they_return():
    """A hook named like a question answers yes or no; one that gives the words of a line says so in its name."""
    for cls in (Strategy, NoServer):
        for name, hook in vars(cls).items():
            if name.startswith("_") or not callable(hook):
                continue
            returns = inspect.signature(hook).return_annotation
            if name.split("_")[0] in {"needs", "is", "has", "uses", "joins", "on", "clips", "can"}:
                assert returns == "bool", f"{cls.__name__}.{name} is a question but returns {returns}"
            if returns == "str | None":
                assert name.endswith(("_reason", "_refusal")), f"{cls.__name__}.{name} returns words: name them"


def test_the_reasons_name_what_needs_every_rank():
    """The words ``paratrain.rank_alone`` says when one rank does alone what needs them all (None: nothing does)."""
    ddp, zero1, zero3 = create("ddp"), create("zero1"), create("zero3")
    assert ddp.every_rank_reason() is None and ddp.optimizer_every_rank_reason() is None
    assert zero1.every_rank_reason() is None
    assert zero1.optimizer_every_rank_reason() == "under zero1 each rank holds a shard of the optimizer's state"
    assert (
        zero3.every_rank_reason()
        == zero3.optimizer_every_rank_reason()
        == "under zero3 each rank holds a shard of every layer"
    )
    assert create("pipeline").every_rank_reason() == "under pipeline each rank holds a stage of the model"
    model, off = nn.Linear(2, 2), SimpleNamespace(enabled=False)
    guard_model(model, zero3, off)  # asks the strategy, then leaves a job without a call watch alone
    guard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), zero1, off)
