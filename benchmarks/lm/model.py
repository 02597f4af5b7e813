"""A small GPT-style causal transformer (nanoGPT-like), as ``--model`` factories for ``flodl-mpi train`` and ``fit``.

Pre-LayerNorm blocks of causal self-attention (``torch.nn.functional.scaled_dot_product_attention``,
``is_causal=True``) and a 4x GELU MLP, learned token and position embeddings, a final
LayerNorm and a linear head (Radford et al. 2019, "Language Models are Unsupervised
Multitask Learners"; the layout of Karpathy's nanoGPT). No dropout (the replicas stay
deterministic), no weight tying (every parameter is its own tensor on the wire). Weights
start at N(0, 0.02), biases at 0, so the logits start near 0 and the loss near ln(vocab).

Input: float32 ``(batch, T)`` token ids (the CLI's features are float32; ids are exact);
output: logits ``(batch, vocab, T)``, the layout ``torch.nn.functional.cross_entropy`` takes
with per-position labels ``(batch, T)``. ``T`` is the data's context (``input_shape[0]``),
``vocab`` its ``num_classes``.

Sizes (parameters at vocab 256, context 128; ``python benchmarks/lm/model.py`` prints them):

=========  ======  =====  =====  ==========
size       layers  heads  width  parameters
=========  ======  =====  =====  ==========
``tiny``   2       2      32     ~0.04 M
``small``  4       4      128    ~0.88 M
``medium`` 6       6      384    ~10.9 M
``large``  14      12     768    ~99.6 M
=========  ======  =====  =====  ==========

As a model spec: ``--model benchmarks/lm/model.py:small`` (or ``:tiny``, ``:medium``, ``:large``: the
issue's ~100 M, for a few steps of ``benchmarks/lm/rounds_at_size.py``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

#: ``size -> (layers, heads, width)``.
SIZES = {"tiny": (2, 2, 32), "small": (4, 4, 128), "medium": (6, 6, 384), "large": (14, 12, 768)}


class Block(nn.Module):
    """One pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``; shapes ``(B, T, width)``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A causal language model over ``vocab`` tokens with a context of ``context`` positions.

    Args:
        vocab: tokens (the head's outputs), >= 2. context: positions, >= 1.
        layers, heads, width: the blocks; ``width % heads == 0``.

    Raises:
        ValueError: a size out of range.
    """

    def __init__(self, vocab: int, context: int, layers: int, heads: int, width: int) -> None:
        super().__init__()
        if vocab < 2 or context < 1 or layers < 1 or heads < 1 or width % heads:
            raise ValueError(f"GPT: vocab >= 2, context >= 1, layers >= 1 and width % heads == 0; got "
                             f"vocab={vocab}, context={context}, layers={layers}, heads={heads}, width={width}")
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, T)`` token ids (any dtype, whole numbers), ``T <= context``; returns ``(B, vocab, T)``."""
        idx = x.long()
        T = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        return self.head(self.ln(self.blocks(h))).transpose(1, 2)


def gpt(input_shape, num_classes, size: str = "small") -> GPT:
    """A :class:`GPT` of ``size`` (a key of :data:`SIZES`) for the data's context and vocabulary.

    Args:
        input_shape: one sample's shape, ``(T,)``: the context.
        num_classes: the vocabulary (the data's ``num_classes``: 256 for byte tokens).
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if len(input_shape) != 1:
        raise ValueError(f"GPT takes token sequences, input_shape (T,); got {tuple(input_shape)}")
    layers, heads, width = SIZES[size]
    return GPT(int(num_classes), int(input_shape[0]), layers, heads, width)


def tiny(input_shape, num_classes) -> GPT:
    """``gpt(size="tiny")``: the tests' model."""
    return gpt(input_shape, num_classes, "tiny")


def small(input_shape, num_classes) -> GPT:
    """``gpt(size="small")``: the benchmark's default."""
    return gpt(input_shape, num_classes, "small")


def medium(input_shape, num_classes) -> GPT:
    """``gpt(size="medium")``: ~10 M parameters, the issue's lower size (slow on 2 cores)."""
    return gpt(input_shape, num_classes, "medium")


def large(input_shape, num_classes) -> GPT:
    """``gpt(size="large")``: ~100 M parameters (GPT-2 small's width, 14 layers), for a few steps of a round's cost."""
    return gpt(input_shape, num_classes, "large")


def count_parameters(model: nn.Module) -> int:
    """Elements in ``model.parameters()``."""
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    for name in SIZES:
        print(f"{name:7s} {count_parameters(gpt((128,), 256, name)) / 1e6:.3f} M parameters "
              f"(context 128, vocab 256); ln(256) = {math.log(256):.4f}")
