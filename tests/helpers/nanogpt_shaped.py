"""nanoGPT's model at the sizes the planner tests plan it at: the one nanoGPT-shaped GPT of the test suite
(``tests/realcode/nanogpt_model.py``, karpathy/nanoGPT's ``model.py`` shape, written here) as factories.

``paratrain plan --model nanogpt_shaped:gpt2 --input long:1024`` (with ``tests`` importable) plans nanoGPT's default
124M model; ``tiny`` is a small one to run for real.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "realcode"))
from nanogpt_model import GPT, GPTConfig  # noqa: E402


def gpt2() -> GPT:
    """nanoGPT's default model: GPT-2 124M with its vocabulary padded to 50304."""
    return GPT(GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768))


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=4, n_embd=64))
