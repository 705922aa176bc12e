"""Tensor parallelism: each layer's weights split over a group of ranks (PyTorch's
``torch.distributed.tensor.parallel`` on a ``DeviceMesh``), alone (``Parallel("tp")``) or inside data parallelism
(``Parallel("zero3", tp=2)``). Plans say which module is split how (:mod:`.plans`); the loss runs on logits split
over the vocabulary (:mod:`.outputs`)."""

from typing import TYPE_CHECKING

from ...lazy import lazy_getattr

if TYPE_CHECKING:
    from .apply import apply_tp as apply_tp
    from .compose import TensorParallel as TensorParallel
    from .degrees import tp_degree as tp_degree
    from .names import STYLES as STYLES
    from .plans import TPPlan as TPPlan
    from .plans import plan_for as plan_for

_EXPORTS = {
    "apply_tp": ".apply",
    "TensorParallel": ".compose",
    "tp_degree": ".degrees",
    "TPPlan": ".plans",
    "plan_for": ".plans",
    "STYLES": ".names",
}
__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())  # the strategies import .degrees alone: cheap
__all__ = list(_EXPORTS)
