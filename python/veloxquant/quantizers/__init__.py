"""Mirrors VeloxQuant-MLX's ``veloxquant_mlx.quantizers`` for what veloxquant implements: CacheGen's
numerics (``veloxquant.quantizers.cachegen``) and the group quant-dequant helpers
(``veloxquant.quantizers._quant_utils``), on numpy arrays."""
