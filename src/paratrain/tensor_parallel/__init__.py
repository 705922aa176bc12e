"""Tensor parallelism: each layer's weights split over a group of ranks (PyTorch's
``torch.distributed.tensor.parallel`` on a ``DeviceMesh``), alone (``Parallel("tp")``) or inside data parallelism
(``Parallel("zero3", tp=2)``). Plans say which module is split how (:mod:`.plans`); the loss runs on logits split
over the vocabulary (:mod:`.outputs`)."""
from .apply import apply_tp
from .compose import TensorParallel
from .layout import TPConfig, mesh_dims
from .plans import Plan, plan_for
from .styles import STYLES

__all__ = ["apply_tp", "TensorParallel", "TPConfig", "mesh_dims", "Plan", "plan_for", "STYLES"]
