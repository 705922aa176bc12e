"""Context parallelism: each sequence split over the ``cp`` ranks of a mesh, attention whole through Ulysses'
all-to-all (any attention kernel, CPU gloo and CUDA NCCL alike). :mod:`.part` is what a strategy holds,
:mod:`.sequence` cuts a call to a rank's slice and sums the loss, :mod:`.attention` finds and wraps attention,
:mod:`.ulysses` is the exchange, :mod:`.masks` the whole sequence's mask. docs/context-parallel.md says how to use it.
"""
