"""``parallelize`` applies every technique in the one order it states, cp and ep included, materializing a model
built on the meta device after the last step that takes meta tensors."""

from torch import nn

from paratrain.distributed import parallelize as module
from paratrain.distributed.parallelize import parallelize, takes_meta
from paratrain.options import BlockTransforms
from paratrain.precision import create_precision


def test_the_order_is_tp_cp_transforms_ep_data_whether_or_not_the_data_step_takes_meta(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(module, "transform_blocks", lambda model, facts, transforms: calls.append("ac+compile"))

    def step(name: str):
        return lambda model: calls.append(name) or model

    for meta, materialized in ((False, ["materialize", "ep", "data"]), (True, ["ep", "data", "materialize"])):
        calls.clear()
        data = takes_meta(step("data")) if meta else step("data")
        parallelize(
            nn.Linear(2, 2),
            precision=create_precision("fp32"),
            facts=None,
            transforms=BlockTransforms(),
            tp=step("tp"),
            cp=step("cp"),
            ep=step("ep"),
            data=data,
            materialize=step("materialize"),
        )
        assert calls == ["tp", "cp", "ac+compile", *materialized]
