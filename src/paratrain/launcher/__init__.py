"""Starting and supervising processes: ``paratrain run`` (torchrun) and in-process ``launch``."""

from .spawn import launch

__all__ = ["launch"]
