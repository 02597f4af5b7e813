"""A tiny model for the CLI runs kept as test data (``--model tiny_model.py:model``): small checkpoints."""

from torch import nn


def model(input_shape, num_classes):
    """64 digits pixels -> 12 -> BatchNorm (an integer buffer per rank) -> ReLU -> num_classes."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, num_classes))
