"""CacheGen's numerics on numpy arrays, at VeloxQuant-MLX's path (``veloxquant_mlx.quantizers.cachegen``).

Group quantization exposing the integer codes, the token-delta transform, the entropy estimate and
byte counts, and the layer-wise bit schedule, with the original's names, signatures and results
(docs/python.md; the definitions are /shared/spec/upstream-semantics.md's). Every number is
computed by veloxquant's C++ core, the code its caches run; this module only checks and shapes
arrays. Inputs are numpy arrays (or array-likes): values to quantize are float16 or float32
``[N, D]`` (anything else is refused, never cast silently); codes and symbols are integers (or
integral floats, as the original's codes are float32).

Where the original is looser, this module refuses with ValueError rather than guess:
``token_delta`` takes codes (integers in 0..255), ``symbol_entropy_bits`` integers in the
int16 range, and NaN or Inf cannot be quantized. The entropy is computed in double precision
(the original: float32), so an estimate may differ from the original's by a byte after rounding up.
"""
from __future__ import annotations

import operator
from typing import Any, NamedTuple

import numpy as np

from veloxquant import _core

layer_group_bits = _core.layer_group_bits


class CodeStream(NamedTuple):
    """Quantized codes and what dequantizes them (one head's ``[N, D]`` slice).

    codes: float32 ``[n_groups, group_size, D]``, integer codes in ``[0, 2^bits - 1]``; the rows
        past ``n_rows`` repeat the last real row's codes (the original pads its input so).
    scale, zero: float32 ``[n_groups, 1, D]``: per group and channel, the step and the minimum.
    n_rows: the real token count N. bits: the bit width.
    """

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    n_rows: int
    bits: int


def _int(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def _float_matrix(x: Any, what: str = "x") -> np.ndarray:
    """`x` as a C-contiguous float32 [N, D] array (exact for float16/float32 input)."""
    a = np.asarray(x)
    if a.dtype not in (np.float16, np.float32) or not a.dtype.isnative:
        raise ValueError(f"{what} must be a float16 or float32 array (native byte order), got {a.dtype}; "
                         f"convert it with .astype(np.float32)")
    if a.ndim != 2:
        raise ValueError(f"{what} must be a 2-D array [N, D] (one head's tokens x channels), got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _integers(a: Any, what: str, lo: int, hi: int) -> np.ndarray:
    """`a` as an integer array (integral floats accepted), every value in [lo, hi]."""
    a = np.asarray(a)
    if a.dtype.kind == "b":
        a = a.astype(np.int64)
    if a.dtype.kind == "f":
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{what} must be finite integers, got NaN or Inf")
        if not np.array_equal(a, np.trunc(a)):
            raise ValueError(f"{what} must hold integers (codes), got fractional values")
    elif a.dtype.kind not in "iu":
        raise ValueError(f"{what} must be an integer (or integral float) array, got {a.dtype}")
    if a.size and (a.min() < lo or a.max() > hi):
        raise ValueError(f"{what} must lie in {lo}..{hi}, got values in {a.min()}..{a.max()}")
    return a


def _pad_codes(codes: np.ndarray, n_groups: int, group_size: int) -> np.ndarray:
    """uint8 [N, D] -> float32 [n_groups, group_size, D], the last row repeated into the padding."""
    n, d = codes.shape
    pad = n_groups * group_size - n
    if pad:
        codes = np.concatenate([codes, np.repeat(codes[-1:], pad, axis=0)])
    return codes.astype(np.float32).reshape(n_groups, group_size, d)


def _quantize(x: Any, bits: Any, group_size: Any):
    """(codes float32 [G, gs, D], scale [G, 1, D], zero [G, 1, D], N, bits) by the C++ core."""
    bits, group_size = _int(bits, "bits"), _int(group_size, "group_size")
    x32 = _float_matrix(x)
    codes, scale, zero = _core._quantize_to_codes(x32, bits, group_size)
    g, d = scale.shape
    return _pad_codes(codes, g, group_size), scale.reshape(g, 1, d), zero.reshape(g, 1, d), x32.shape[0], bits


def _group_params(a: Any, g: int, d: int, what: str) -> np.ndarray:
    """A per-group parameter, [G, 1, D] or [G, D] float32 (or float16), as C-contiguous float32 [G, D]."""
    a = np.asarray(a)
    if a.dtype not in (np.float16, np.float32) or not a.dtype.isnative:
        raise ValueError(f"{what} must be a float32 array, got {a.dtype}")
    if a.shape not in ((g, 1, d), (g, d)):
        raise ValueError(f"{what} must be [{g}, 1, {d}] (or [{g}, {d}]), got shape {a.shape}")
    return np.ascontiguousarray(a.reshape(g, d), dtype=np.float32)


def _stream_parts(stream: Any):
    """Check a CodeStream; returns (codes uint8 [N, D], scale float32 [G, D], zero [G, D], N, bits, group_size)."""
    try:
        codes, scale, zero, n_rows, bits = stream.codes, stream.scale, stream.zero, stream.n_rows, stream.bits
    except AttributeError:
        raise TypeError(f"expected a CodeStream (from quantize_to_codes), got {type(stream).__name__}") from None
    n_rows, bits = _int(n_rows, "stream.n_rows"), _int(bits, "stream.bits")
    if not 1 <= bits <= 8:
        raise ValueError(f"stream.bits must be in 1..8, got {bits}")
    codes = np.asarray(codes)
    if codes.ndim != 3:
        raise ValueError(f"stream.codes must be [n_groups, group_size, D], got shape {codes.shape}")
    g, gs, d = codes.shape
    scale, zero = _group_params(scale, g, d, "stream.scale"), _group_params(zero, g, d, "stream.zero")
    if not 0 <= n_rows <= g * gs or (n_rows + gs - 1) // gs != g:
        raise ValueError(f"stream.n_rows = {n_rows} does not fit {g} groups of {gs} rows")
    flat = _integers(codes.reshape(g * gs, d)[:n_rows], "stream.codes", 0, (1 << bits) - 1)
    return np.ascontiguousarray(flat, dtype=np.uint8), scale, zero, n_rows, bits, gs


def quantize_to_codes(x: Any, bits: int, group_size: int = 32) -> CodeStream:
    """Asymmetric min/max group quantization of one head's ``[N, D]`` slice, exposing the codes.

    Groups of ``group_size`` consecutive tokens per channel share a scale and a minimum:
    ``scale = max((max - min) / (2^bits - 1), 1e-8)``, ``code = clip(rint((x - min) / scale), 0,
    2^bits - 1)`` in float32 (rint: half to even). bits in 1..8, group_size >= 1.
    """
    return CodeStream(*_quantize(x, bits, group_size))


def dequant_codes(stream: CodeStream) -> np.ndarray:
    """``codes * scale + zero`` for the ``n_rows`` real rows: float16 ``[n_rows, D]``."""
    codes, scale, zero, _, _, gs = _stream_parts(stream)
    return _core._dequant_codes(codes, scale, zero, gs).astype(np.float16)


def token_delta(codes_flat: Any) -> np.ndarray:
    """Token-wise delta of a code matrix ``[N, ...]``: row 0 as is, row i ``codes[i] - codes[i-1]``.

    Reversible: ``np.cumsum(delta, axis=0)`` restores the codes. The result has the input's dtype
    (signed ``int16`` for unsigned or bool input, whose deltas can be negative); an input of at most
    one row is returned as it is, as the original does. Codes must be integers in 0..255.
    """
    a = np.asarray(codes_flat)
    if a.ndim == 0:
        raise ValueError("token_delta takes a code matrix [N, D], got a scalar")
    if a.shape[0] <= 1:
        return a
    codes = np.ascontiguousarray(_integers(a, "codes", 0, 255), dtype=np.uint8).reshape(a.shape[0], -1)
    delta = _core._token_delta(codes).reshape(a.shape)
    out_dtype = np.int16 if a.dtype.kind in "ub" else a.dtype
    return delta.astype(out_dtype, copy=False)


def symbol_entropy_bits(symbols: Any) -> float:
    """Empirical Shannon entropy, in bits per symbol, of an integer array (0.0 when empty).

    As in the original, float symbols are truncated toward zero (its ``astype(int32)``). Symbols
    must lie in the int16 range (codes and their deltas do).
    """
    a = np.asarray(symbols)
    if a.size == 0:
        return 0.0
    if a.dtype.kind == "f":
        if not np.all(np.isfinite(a)):
            raise ValueError("symbols must be finite, got NaN or Inf")
        a = np.trunc(a)
    a = _integers(a, "symbols (int16 values)", -32768, 32767)
    return float(_core._symbol_entropy_bits(np.ascontiguousarray(a, dtype=np.int16).reshape(-1)))


def entropy_coded_bytes(stream: CodeStream, use_delta: bool = True, per_channel: bool = True) -> int:
    """The entropy-coded size estimate of a stream's codes, in bytes.

    Symbols: the token delta of the ``n_rows`` real rows (``use_delta``), else the codes.
    ``per_channel``: code bits ``= sum over channels of min(H(channel), bits) * N``; pooled:
    ``min(H(all), bits) * N * D``. Bytes ``= ceil(code bits / 8) + n_groups * D * 4`` (an fp16
    scale and minimum per group and channel). Never more than ``fixed_width_bytes``.
    """
    codes, _, _, _, bits, _ = _stream_parts(stream)
    g, d = np.asarray(stream.codes).shape[0], codes.shape[1]
    symbols = _core._token_delta(codes) if use_delta else codes.astype(np.int16)
    return int(_core._entropy_coded_bytes(symbols.reshape(-1, d), bits, g, bool(per_channel)))


def fixed_width_bytes(stream: CodeStream) -> int:
    """The fixed-width packed size of the same codes: ``ceil(N * D * bits / 8) + n_groups * D * 4``."""
    codes, _, _, n_rows, bits, _ = _stream_parts(stream)
    g = np.asarray(stream.codes).shape[0]
    return int(_core._fixed_width_bytes(n_rows, codes.shape[1], bits, g))


def cachegen_quant_dequant(x: Any, bits: int, group_size: int = 32) -> np.ndarray:
    """Quantize and dequantize: float16 ``[N, D]``, bit for bit what ``_group_quant_dequant`` gives."""
    return dequant_codes(quantize_to_codes(x, bits, group_size))


__all__ = [
    "CodeStream",
    "quantize_to_codes",
    "dequant_codes",
    "token_delta",
    "symbol_entropy_bits",
    "entropy_coded_bytes",
    "fixed_width_bytes",
    "layer_group_bits",
    "cachegen_quant_dequant",
]
