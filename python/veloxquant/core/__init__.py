"""Mirrors VeloxQuant-MLX's ``veloxquant_mlx.core`` for what veloxquant implements: its exceptions."""
from veloxquant.core.exceptions import QuantizerConfigError

__all__ = ["QuantizerConfigError"]
