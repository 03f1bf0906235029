"""Mirrors VeloxQuant-MLX's ``veloxquant_mlx.cache`` for what veloxquant implements: the configuration,
factory and builder (``veloxquant.cache.base``) and the CacheGen cache
(``veloxquant.cache.cachegen_cache``)."""
