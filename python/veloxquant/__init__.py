"""veloxquant: CacheGen-style KV cache compression (the C++ library), over numpy arrays.

The flat API (``veloxquant.CacheGenKVCache``, ``veloxquant.KVCacheConfig``, ``KVCacheBuilder``,
``save_prompt_cache``/``load_prompt_cache``, ``make_caches``, ``methods``, ``layer_group_bits``)
and, for code written against VeloxQuant-MLX, its module paths for what veloxquant implements:
``veloxquant.cache.base``, ``veloxquant.cache.cachegen_cache``, ``veloxquant.quantizers.cachegen``,
``veloxquant.quantizers._quant_utils``, ``veloxquant.core.exceptions`` (replace the import prefix
``veloxquant_mlx`` by ``veloxquant``, and pass numpy arrays). The compiled core is
``veloxquant._core``; the classes here are its classes.
"""
from veloxquant import _core
from veloxquant._core import (  # noqa: F401  (re-exported: the flat API)
    CacheGenKVCache,
    KVCache,
    layer_group_bits,
    load_prompt_cache,
    make_caches,
    methods,
    save_prompt_cache,
    _bench_cpp_update,
)
from veloxquant.cache.base import (
    IMPLEMENTED_METHODS,
    KVCacheBuilder,
    KVCacheConfig,
    KVCacheFactory,
    MethodName,
)
from veloxquant.core.exceptions import QuantizerConfigError
from veloxquant import _protocol  # noqa: F401  (installs mlx_lm's cache protocol on the classes)

__version__ = _core.__version__

__all__ = [
    "CacheGenKVCache",
    "IMPLEMENTED_METHODS",
    "KVCache",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCacheFactory",
    "MethodName",
    "QuantizerConfigError",
    "layer_group_bits",
    "load_prompt_cache",
    "make_caches",
    "methods",
    "save_prompt_cache",
]
