"""Configuration, factory and per-model builder, at VeloxQuant-MLX's path (``veloxquant_mlx.cache.base``).

veloxquant implements one of VeloxQuant-MLX's methods, ``"cachegen"``. This module takes that
library's configuration as its users write it (``KVCacheConfig(method="cachegen", head_dim=64,
cachegen_bits=4)``, every field of the original accepted), builds caches from it
(:class:`KVCacheFactory`, :meth:`KVCacheBuilder.for_model` on an mlx_lm-style model), and refuses
every other method of the original with :class:`QuantizerConfigError` naming it and the methods
veloxquant has: never a silent substitute.

:class:`KVCacheConfig` is also ``veloxquant.KVCacheConfig``: the original's fields are added to
veloxquant's own (the ``cachegen_*`` fields and ``cachegen_flush``), which keep their behaviour
(validated on construction, ``ValueError`` - here its subclass QuantizerConfigError).
"""
from __future__ import annotations

from typing import Any, Literal

from veloxquant import _core
from veloxquant.core.exceptions import QuantizerConfigError

# Every method name VeloxQuant-MLX's KVCacheConfig.method takes (its MethodName), so that code
# written against the original type-checks. veloxquant implements IMPLEMENTED_METHODS of them.
MethodName = Literal[
    "turboquant_prod", "turboquant_mse", "turboquant_rvq", "polar", "qjl", "vecinfer", "spectral",
    "kivi", "kivi_sink", "svdq", "kitty", "adakv", "xquant", "kvquant", "palu", "cachegen",
    "minicache", "gear", "zipcache", "snapkv", "streaming_llm", "h2o", "tova", "pyramidkv",
    "squeeze", "chunkkv", "cam", "xkv", "nsnquant", "knorm", "skvq", "qfilters", "keyformer",
    "morphkv", "kvzip", "kvtc", "curdkv", "nestedkv", "amc", "a2ats", "anchorkv", "rocketkv",
    "age_tiered",
]

# The methods veloxquant builds, and the module and class of each (the original's registry shape).
_CACHE_CLASS_BY_METHOD = {"cachegen": ("veloxquant.cache.cachegen_cache", "CacheGenKVCache")}
IMPLEMENTED_METHODS = frozenset(_CACHE_CLASS_BY_METHOD)

# The original's methods whose caches do not implement mlx_lm's cache protocol. veloxquant
# implements none of them; like every method but cachegen they are refused.
STANDALONE_METHODS = frozenset({"turboquant_prod", "turboquant_mse", "polar", "qjl", "spectral"})

_ORIGINAL_METHODS = frozenset(MethodName.__args__)


def _method_error(method: Any) -> QuantizerConfigError:
    have = ", ".join(repr(m) for m in sorted(IMPLEMENTED_METHODS))
    if method in _ORIGINAL_METHODS:
        what = f"method {method!r} is a VeloxQuant-MLX method that veloxquant does not implement"
    else:
        what = f"unknown method {method!r}"
    return QuantizerConfigError(f"{what}; veloxquant implements {have}. Choices: {', '.join(sorted(IMPLEMENTED_METHODS))}.")


def _check_method(config: Any) -> str:
    """The config's method (a compact veloxquant config has none: cachegen); refused unless implemented."""
    method = getattr(config, "method", "cachegen")
    if not isinstance(method, str):
        raise QuantizerConfigError(f"method must be a string such as 'cachegen', got {method!r}")
    if method not in IMPLEMENTED_METHODS:
        raise _method_error(method)
    return method


# veloxquant's own fields, held by the C++ configuration this class extends.
_CACHEGEN_FIELDS = ("cachegen_bits", "cachegen_group_size", "cachegen_use_delta", "cachegen_per_channel",
                    "cachegen_layer_groups", "cachegen_resolved_bits", "cachegen_flush")

# The original's fields that apply to every method, with its defaults. veloxquant's caches take the
# head dim from the data and read none of the others; they are kept so a config reads back as written.
_GENERAL_DEFAULTS = {
    "head_dim": 128, "bit_width_inlier": 2, "bit_width_outlier": None, "jl_dim": None, "n_outlier_channels": None,
    "n_calib_tokens": None, "enable_vectorized_attend": True, "enable_outlier_two_stream": False,
    "enable_fused_query_dot": False, "seed": 42, "dtype": None, "capacity": None, "sliding_window": None,
    "store": None, "observers": None,  # None: a new empty list
}

# The original's fields of the methods veloxquant does not implement: accepted (a config written for
# the original constructs) and kept as given; they have no effect, as their methods are refused.
_OTHER_METHOD_FIELDS = frozenset("""
key_sub_dim value_sub_dim key_codebook_bits value_codebook_bits residual_length kivi_group_size
svdq_rank svdq_energy_threshold svdq_bit_schedule svdq_group_size
kitty_hi_fraction kitty_hi_bit kitty_lo_bit kitty_group_size
adakv_target_avg_bits adakv_lo_bit adakv_mid_bit adakv_hi_bit adakv_group_size adakv_update_interval
adakv_importance adakv_obs_window
xquant_group_size xquant_base_bits xquant_residual_bits xquant_group_quant_size xquant_max_ctx
kvquant_bits kvquant_outlier_fraction kvquant_group_size kvquant_lloyd_iters kvquant_refit_interval kvquant_n_sink
palu_rank palu_energy_threshold palu_n_head_groups palu_hi_bit palu_lo_bit palu_hi_fraction palu_group_size
palu_quantize_values
minicache_start_frac minicache_group_size minicache_retention_threshold minicache_slerp_t minicache_max_ctx
gear_bits gear_rank gear_energy_threshold gear_sparse_fraction gear_group_size gear_quantize_values
zipcache_hi_bits zipcache_lo_bits zipcache_hi_fraction zipcache_group_size zipcache_quantize_values
snap_dtype snap_batched_scoring snap_backend snap_budget snap_obs_window snap_n_sink
stream_n_sink stream_window_size
h2o_budget h2o_n_sink h2o_rope_base h2o_grace h2o_decay
tova_budget tova_n_sink tova_backend
pyramid_budget pyramid_backend pyramid_n_sink pyramid_beta pyramid_resolved_budget
squeeze_budget squeeze_n_sink squeeze_strength squeeze_resolved_budget
chunkkv_budget chunkkv_chunk_size chunkkv_n_sink chunkkv_score chunkkv_reuse_layers
cam_budget cam_n_sink cam_merge cam_merge_keys cam_merge_gate
xkv_group_size xkv_rank xkv_energy_threshold xkv_latent_bits xkv_group_quant_size xkv_max_ctx
nsn_bits nsn_residual_length nsn_codebook_size nsn_subvector_dim nsn_seed nsn_max_ctx
knorm_budget knorm_n_sink knorm_recent knorm_keep
skvq_bits_key skvq_bits_value skvq_group_size skvq_window skvq_n_sink skvq_reorder skvq_clip_search
skvq_clip_alpha skvq_max_ctx
qfilters_budget qfilters_n_sink qfilters_recent qfilters_calib_tokens qfilters_sign qfilters_min_retention
qfilters_on_low_retention
keyformer_budget keyformer_n_sink keyformer_recent keyformer_tau keyformer_tau_init keyformer_tau_end
keyformer_anneal_steps keyformer_rope_base keyformer_seed
morphkv_budget morphkv_n_sink morphkv_window
kvzip_budget kvzip_n_sink kvzip_probe
kvtc_bit_budget kvtc_bit_choices kvtc_beta
curdkv_budget curdkv_n_sink curdkv_rank_cap curdkv_rope_base
nestedkv_budget nestedkv_n_sink nestedkv_window nestedkv_beta nestedkv_tau nestedkv_kappa nestedkv_safeguard_alpha
amc_k_high amc_k_mid amc_use_query_saliency amc_query_alpha amc_adaptive_thresholds amc_threshold_window
amc_gamma amc_calib_variance amc_group_size
a2ats_codebook_bits a2ats_sub_dim a2ats_window a2ats_b a2ats_use_query_aware a2ats_beta
a2ats_retrieval_fraction a2ats_rope_base a2ats_query_h a2ats_codebook
anchorkv_theta anchorkv_window anchorkv_rho anchorkv_anchor_frac anchorkv_residual_bits anchorkv_seed
rocketkv_compression_ratio rocketkv_page_size rocketkv_head_topk1 rocketkv_obs_window rocketkv_n_sink
age_recent_boundary age_mid_boundary age_bits_recent age_bits_mid age_bits_old age_group_size
n_sink_tokens smooth_factors key_codebook value_codebook
spectral_key_d_eff spectral_val_d_eff spectral_apply_qjl spectral_model_name
use_metal_kernels fused_sdpa fused_sdpa_max_ctx fused_sdpa_memory_bound
""".split())


class KVCacheConfig(_core.KVCacheConfig):
    """A cache configuration: VeloxQuant-MLX's fields (``method``, ``head_dim``, ``seed``, ... and the
    ``cachegen_*`` fields) plus veloxquant's ``cachegen_flush``.

    ``method`` is first and may be given by position; every other field is a keyword. The
    ``cachegen_*`` fields and ``cachegen_flush`` are validated here and on assignment of
    ``cachegen_flush`` (QuantizerConfigError, a ValueError); a cache validates them again when it is
    built. ``method`` is checked where a cache is built (KVCacheFactory.create,
    KVCacheBuilder.for_model): any of the original's names constructs, only "cachegen" builds.
    Fields of the original's other methods are accepted and kept as given, with no effect.
    """

    method: MethodName
    head_dim: int
    bit_width_inlier: int | list
    seed: int
    sliding_window: int | None

    def __init__(self, method: str = "cachegen", *, cachegen_bits: int = 4, cachegen_group_size: int = 32,
                 cachegen_use_delta: bool = True, cachegen_per_channel: bool = True, cachegen_layer_groups: int = 3,
                 cachegen_resolved_bits: int | None = None, cachegen_flush: str = "group_aligned", **fields: Any):
        if not isinstance(method, str):
            raise TypeError(f"KVCacheConfig: method must be a string such as 'cachegen', got {method!r}")
        for name in fields:
            if name not in _GENERAL_DEFAULTS and name not in _OTHER_METHOD_FIELDS:
                raise TypeError(f"KVCacheConfig.__init__() got an unexpected keyword argument {name!r}")
        try:
            super().__init__(cachegen_bits=cachegen_bits, cachegen_group_size=cachegen_group_size,
                             cachegen_use_delta=cachegen_use_delta, cachegen_per_channel=cachegen_per_channel,
                             cachegen_layer_groups=cachegen_layer_groups, cachegen_resolved_bits=cachegen_resolved_bits,
                             cachegen_flush=cachegen_flush)
        except ValueError as e:
            raise QuantizerConfigError(f"KVCacheConfig: {e}") from None
        self.method = method
        for name, default in _GENERAL_DEFAULTS.items():
            value = fields.pop(name, default)
            setattr(self, name, [] if name == "observers" and value is None else value)
        self.__dict__.update(fields)  # the other methods' fields, as given

    def __getattr__(self, name: str) -> Any:  # only for attributes not found otherwise
        if name in _OTHER_METHOD_FIELDS:
            raise AttributeError(f"KVCacheConfig.{name} was not set: it configures one of VeloxQuant-MLX's methods "
                                 f"that veloxquant does not implement, so it has no default here")
        raise AttributeError(f"'KVCacheConfig' object has no attribute {name!r}")

    def validate(self) -> None:
        """Raise QuantizerConfigError (a ValueError) naming the first bad cachegen field."""
        try:
            super().validate()
        except ValueError as e:
            raise QuantizerConfigError(f"KVCacheConfig: {e}") from None

    def _fields(self) -> dict:
        """Every field as a keyword argument of the constructor."""
        out = {name: getattr(self, name) for name in _CACHEGEN_FIELDS}
        out.update({k: v for k, v in self.__dict__.items() if not k.startswith("_")})
        return out

    @classmethod
    def _from_core(cls, core: _core.KVCacheConfig) -> "KVCacheConfig":
        return cls(**{name: getattr(core, name) for name in _CACHEGEN_FIELDS})

    def __eq__(self, other: object) -> Any:
        if not isinstance(other, _core.KVCacheConfig):
            return NotImplemented
        if not _core.KVCacheConfig.__eq__(self, other):
            return False
        if isinstance(other, KVCacheConfig):
            mine = {k: v for k, v in self._fields().items() if k not in _CACHEGEN_FIELDS}
            theirs = {k: v for k, v in other._fields().items() if k not in _CACHEGEN_FIELDS}
            return mine == theirs
        return True  # a compact config has only the cachegen fields

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        shown = ["method", "head_dim", *_CACHEGEN_FIELDS]
        fields = self._fields()
        parts = [f"{k}={fields[k]!r}" for k in shown]
        parts += [f"{k}={v!r}" for k, v in fields.items() if k not in shown and _GENERAL_DEFAULTS.get(k, object()) != v
                  and not (k == "observers" and v == [])]
        return f"KVCacheConfig({', '.join(parts)})"

    def __reduce__(self):
        return (_config_from_fields, (self._fields(),))


def _config_from_fields(fields: dict) -> KVCacheConfig:
    """Rebuild a pickled KVCacheConfig."""
    return KVCacheConfig(**fields)


def _core_config(config: Any) -> _core.KVCacheConfig:
    """The validated C++ configuration of `config` (None: the defaults)."""
    if config is None:
        return _core.KVCacheConfig()
    try:
        return _core._config_from_object(config)
    except ValueError as e:
        raise QuantizerConfigError(str(e)) from None


class KVCacheFactory:
    """Builds one cache from a configuration (the original's ``KVCacheFactory``)."""

    @staticmethod
    def create(config: Any) -> _core.CacheGenKVCache:
        """A ``CacheGenKVCache`` for ``config.method == "cachegen"`` with ``cachegen_resolved_bits``
        if set, else ``cachegen_bits``. Any other method: QuantizerConfigError naming it.
        As in the original, ``bit_width_inlier`` must not be a list here (for_model takes lists) and
        ``sliding_window`` is refused (the original allows it only for its standalone methods)."""
        _check_method(config)
        if isinstance(getattr(config, "bit_width_inlier", None), list):
            raise QuantizerConfigError("KVCacheFactory.create() requires bit_width_inlier to be a single int; "
                                       "a per-layer list is for KVCacheBuilder.for_model()")
        if getattr(config, "sliding_window", None) is not None:
            raise QuantizerConfigError(f"KVCacheFactory: sliding_window is not supported by method 'cachegen' "
                                       f"(got sliding_window={config.sliding_window!r}); leave it None")
        return _core.CacheGenKVCache(_core_config(config))


def _layer_head_dims(model: Any) -> Any:
    """What the C++ builder takes: per-layer head dims (None: no attention), from a list, an object
    with ``layer_head_dims``, or an mlx_lm-style model, read as the original reads it."""
    if hasattr(model, "layer_head_dims") or isinstance(model, (list, tuple)):
        return model
    layers = getattr(model, "layers", None)
    if not layers and hasattr(model, "model"):
        layers = getattr(model.model, "layers", None)
    if layers is None:
        if isinstance(model, (str, bytes)) or not hasattr(model, "__iter__"):
            raise ValueError(
                "KVCacheBuilder.for_model: model must be an mlx_lm-style model (model.layers or model.model.layers, "
                "each layer's self_attn.head_dim or the model's args), a list of per-layer head dims (int, or None "
                f"for a layer without attention) or an object with attribute layer_head_dims; got {model!r}")
        return model  # another iterable of head dims: the C++ builder checks its elements
    # VLM wrappers keep the text model's args on language_model.
    args = getattr(model, "args", None)
    if args is not None and not hasattr(args, "hidden_size"):
        args = getattr(getattr(model, "language_model", None), "args", args)
    dims = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
        if attn is None:
            dims.append(None)
            continue
        hd = getattr(attn, "head_dim", None)
        if hd is None and args is not None:
            hd = getattr(args, "head_dim", None)
            if hd is None and hasattr(args, "hidden_size") and hasattr(args, "num_attention_heads"):
                hd = args.hidden_size // args.num_attention_heads
        dims.append(hd)
    return dims


class KVCacheBuilder:
    """One cache per layer of a model (the original's ``KVCacheBuilder.for_model``)."""

    @staticmethod
    def for_model(model: Any, config: Any = None) -> list:
        """A ``CacheGenKVCache`` for every attention layer, its bits from CacheGen's layer schedule
        (``layer_group_bits`` over the attention layers: ``cachegen_bits`` for the shallowest,
        fewer deeper, never below 2), and a plain ``KVCache`` for every layer without attention.

        model: an mlx_lm-style model (``model.layers`` or ``model.model.layers``; a layer's head dim
        is ``layer.self_attn.head_dim``, else the model's ``args.head_dim`` or ``hidden_size //
        num_attention_heads``; a layer with neither ``self_attn`` nor ``attn`` has no attention), a
        list of per-layer head dims (int, or None), or an object with ``layer_head_dims``.
        config: a KVCacheConfig (default: ``KVCacheConfig()``), or any object with the original's
        fields. A method other than "cachegen" is refused (QuantizerConfigError) before the model is
        read; so is a preset ``cachegen_resolved_bits`` (the schedule sets it), with ValueError.
        """
        if config is not None:
            _check_method(config)
        dims = _layer_head_dims(model)
        spec = getattr(config, "bit_width_inlier", None)
        if isinstance(spec, list):
            listed = dims.layer_head_dims if hasattr(dims, "layer_head_dims") else dims
            n_attn = sum(1 for d in listed if d is not None)
            if len(spec) != n_attn:
                raise QuantizerConfigError(f"KVCacheBuilder.for_model: bit_width_inlier is a list of length {len(spec)}, "
                                           f"but the model has {n_attn} attention layers")
        return _core.KVCacheBuilder.for_model(dims, _core_config(config))


__all__ = [
    "IMPLEMENTED_METHODS",
    "STANDALONE_METHODS",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCacheFactory",
    "MethodName",
    "QuantizerConfigError",
]
