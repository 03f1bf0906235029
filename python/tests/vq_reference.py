"""A numpy statement of the reference's numerics (../shared/spec/upstream-semantics.md), written
independently of the C++ code, for the tests to compare against. float32 math, rint = half-to-even."""
import math

import numpy as np


def quantize(x, bits, group_size):
    """One head's [N, D] slice -> (codes uint8 [N, D], reconstruction float32 [N, D], n_groups)."""
    x = np.asarray(x, dtype=np.float32)
    n, d = x.shape
    n_groups = -(-n // group_size)
    pad = n_groups * group_size - n
    xp = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)]) if pad else x
    g = xp.reshape(n_groups, group_size, d)
    levels = np.float32(2**bits - 1)
    mn = g.min(axis=1, keepdims=True)
    mx = g.max(axis=1, keepdims=True)
    scale = np.maximum((mx - mn) / levels, np.float32(1e-8))
    codes = np.clip(np.rint((g - mn) / scale), 0, levels)
    recon = (codes * scale + mn).astype(np.float32)
    return (codes.reshape(-1, d)[:n].astype(np.uint8), recon.reshape(-1, d)[:n], n_groups)


def quant_dequant(x, bits, group_size, dtype):
    """[B, H, S, D] -> the reference's dequantized tensor in `dtype`, each slice one stream."""
    out = np.empty(x.shape, dtype=np.float32)
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            out[b, h] = quantize(x[b, h], bits, group_size)[1]
    return out.astype(dtype)


def token_delta(codes):
    c = codes.astype(np.int16)
    return np.concatenate([c[:1], c[1:] - c[:-1]])


def entropy_bits(symbols):
    """Empirical Shannon entropy in bits per symbol (0 for an empty array)."""
    s = np.asarray(symbols).ravel()
    if s.size == 0:
        return 0.0
    _, counts = np.unique(s, return_counts=True)
    p = counts / s.size
    return float(-(p * np.log2(p)).sum())


def slice_bytes(x, bits, group_size, use_delta=True, per_channel=True):
    """(entropy-coded bytes, fixed-width bytes) of one [N, D] slice quantized as one stream."""
    codes, _, n_groups = quantize(x, bits, group_size)
    n, d = codes.shape
    sym = token_delta(codes) if use_delta else codes
    if per_channel:
        code_bits = sum(min(entropy_bits(sym[:, c]), bits) * n for c in range(d))
    else:
        code_bits = min(entropy_bits(sym), bits) * n * d
    meta = n_groups * d * 4
    return math.ceil(code_bits / 8) + meta, math.ceil(n * d * bits / 8) + meta


def random_walk(shape, seed, step=0.05, dtype=np.float32):
    """Token-correlated data [B, H, S, D]: a random walk along S per channel."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32) * np.float32(step)
    x[:, :, 0] = rng.normal(size=(shape[0], shape[1], shape[3]))
    return np.cumsum(x, axis=2, dtype=np.float32).astype(dtype)
