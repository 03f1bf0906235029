"""The group quant-dequant helpers, at VeloxQuant-MLX's path (``veloxquant_mlx.quantizers._quant_utils``).

Asymmetric min/max group quantization along axis 0 (tokens) of one head's ``[N, D]`` slice, on
numpy arrays, computed by veloxquant's C++ core: the same numbers as
``veloxquant.quantizers.cachegen`` (see there for the definitions and what is refused).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from veloxquant import _core
from veloxquant.quantizers.cachegen import _group_params, _int, _integers, _quantize


def _group_quant_codes(x: Any, b: int, group_size: int = 32) -> tuple:
    """``(codes, scale, zero)``: codes float32 ``[n_groups, group_size, D]`` (padded rows repeat the
    last real row's codes), scale and zero (the minimum) float32 ``[n_groups, 1, D]``."""
    codes, scale, zero, _, _ = _quantize(x, b, group_size)
    return codes, scale, zero


def _group_dequant_codes(codes: Any, scale: Any, zero: Any, n: int, group_size: int = 32) -> np.ndarray:
    """``codes * scale + zero`` truncated to the first ``n`` rows: float32 ``[n, D]``.

    codes: ``[n_groups, group_size, D]`` or ``[n_groups * group_size, D]``; scale and zero:
    ``[n_groups, 1, D]`` or ``[n_groups, D]``. Codes are integers in 0..255.
    """
    n, group_size = _int(n, "n"), _int(group_size, "group_size")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    codes = np.asarray(codes)
    if codes.ndim not in (2, 3):
        raise ValueError(f"codes must be [n_groups, group_size, D] or [n_groups * group_size, D], got shape {codes.shape}")
    d = codes.shape[-1]
    rows = codes.reshape(-1, d)
    g = np.asarray(scale).shape[0] if np.ndim(scale) else 0
    if rows.shape[0] != g * group_size or not 0 <= n <= rows.shape[0]:
        raise ValueError(f"codes of shape {codes.shape} do not hold {g} groups of {group_size} rows with n = {n} real rows")
    scale, zero = _group_params(scale, g, d, "scale"), _group_params(zero, g, d, "zero")
    used = (n + group_size - 1) // group_size  # groups the first n rows reach
    flat = np.ascontiguousarray(_integers(rows[:n], "codes", 0, 255), dtype=np.uint8)
    return _core._dequant_codes(flat, np.ascontiguousarray(scale[:used]), np.ascontiguousarray(zero[:used]), group_size)


def _group_quant_dequant(x: Any, b: int, group_size: int = 32) -> np.ndarray:
    """Quantize, then dequantize: float16 ``[N, D]``."""
    codes, scale, zero, n, _ = _quantize(x, b, group_size)
    return _group_dequant_codes(codes, scale, zero, n, group_size).astype(np.float16)


__all__ = ["_group_quant_codes", "_group_dequant_codes", "_group_quant_dequant"]
