"""Parameter-server training on torch.distributed point-to-point (not ``torch.distributed.rpc``, which unpickles
what peers send and is in maintenance mode).

The last ``servers`` ranks hold the parameters: the dense ones split over them by size, each table of embeddings
split over them by rows, each part with its optimizer and that optimizer's state. Workers pull, compute, push.
:mod:`.messages` is the wire format, :mod:`.holdings` who holds what, :mod:`.server` the serving loop,
:mod:`.client` a worker's side of it, :mod:`.tables` a worker's stand-in for a table, :mod:`.worker` its optimizer.
"""

from .config import PSConfig
from .holdings import Holdings, plan_holdings
from .messages import ProtocolError

__all__ = ["Holdings", "PSConfig", "ProtocolError", "plan_holdings"]
