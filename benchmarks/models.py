"""Benchmark models, used through ``--model benchmarks/models.py:NAME``.

``mnist1d_cnn``: the MNIST-1D paper's 1-D CNN (Greydanus & Kobak 2024,
arXiv:2011.14439, the ``ConvBase`` model of its repository): three Conv1d layers
of 25 channels (kernel 5, 3, 3; stride 2; padding 1) with ReLU, and a linear head
over the 25 x 5 features. 5,210 parameters; the paper reports about 94 %
test accuracy on MNIST-1D.
"""

from __future__ import annotations

import torch
from torch import nn


class MNIST1DCNN(nn.Module):
    """Input ``(batch, 40)`` float32; output logits ``(batch, num_classes)``."""

    def __init__(self, length: int = 40, num_classes: int = 10, channels: int = 25) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        with torch.no_grad():
            n_out = self._features(torch.zeros(1, length)).shape[1]
        self.linear = nn.Linear(n_out, num_classes)

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(-1, 1, x.shape[-1])                 # (B, 1, L)
        h = torch.relu(self.conv1(h))                  # (B, C, 19) for L = 40
        h = torch.relu(self.conv2(h))                  # (B, C, 10)
        h = torch.relu(self.conv3(h))                  # (B, C, 5)
        return h.flatten(1)                            # (B, C * 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self._features(x))


def mnist1d_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The paper's CNN for inputs of shape ``(L,)``."""
    if len(input_shape) != 1:
        raise ValueError(f"mnist1d_cnn takes 1-D samples, got input_shape {input_shape}")
    return MNIST1DCNN(input_shape[0], num_classes)
