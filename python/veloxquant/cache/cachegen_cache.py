"""The CacheGen cache, at VeloxQuant-MLX's path (``veloxquant_mlx.cache.cachegen_cache``).

``CacheGenKVCache`` is veloxquant's C++ cache (also ``veloxquant.CacheGenKVCache``): it takes a
``KVCacheConfig`` (or any object with the original's ``cachegen_*`` fields), numpy arrays
``[B, H, S, D]`` of float16 or float32, and has the original's counters and ``_bits``, and
mlx_lm's cache protocol (veloxquant/_protocol.py). Where it knowingly differs from the original
(decode steps quantized, counters describing the cache as it stands, codes held packed), see
README.md and docs/python.md; ``cachegen_flush="per_call"`` reproduces the original exactly.
"""
from veloxquant._core import CacheGenKVCache

__all__ = ["CacheGenKVCache"]
