"""What a model is made of — its repeated blocks, its tied parameters, its pieces before and after the blocks —
found once, so every strategy asks here instead of walking the model itself."""

from .structure import Blocks, find_blocks, outer_modules
from .ties import Ties, find_ties

__all__ = ["Blocks", "find_blocks", "outer_modules", "Ties", "find_ties"]
