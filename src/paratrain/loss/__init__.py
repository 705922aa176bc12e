"""Losses computed where the model's logits are made: the cross-entropy of a vocabulary head in chunks of tokens
(:func:`chunked_cross_entropy`), and ``Parallel(loss_chunk=)``, which computes a training call's loss so once it is
proven equal to it (:class:`HeadLoss`)."""

from .chunked import chunked_cross_entropy
from .head_loss import HeadLoss

__all__ = ["HeadLoss", "chunked_cross_entropy"]
