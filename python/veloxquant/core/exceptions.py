"""veloxquant's exceptions, at VeloxQuant-MLX's path (``veloxquant_mlx.core.exceptions``)."""


class QuantizerConfigError(ValueError):
    """A configuration veloxquant cannot build: a method it does not implement, or a bad field.

    A ValueError, so code that catches ValueError (veloxquant's flat API raises ValueError for bad
    configurations) catches it too.
    """


__all__ = ["QuantizerConfigError"]
