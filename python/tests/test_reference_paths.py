"""VeloxQuant-MLX's module paths on veloxquant (`veloxquant_mlx.X` -> `veloxquant.X`): the config,
factory and builder of veloxquant.cache.base, the CacheGen cache of veloxquant.cache.cachegen_cache
and the numerics of veloxquant.quantizers.cachegen / _quant_utils, checked for the behaviours the
original's own CacheGen tests check, against vq_reference.py (an independent numpy statement of
the original's numerics) wherever a number can be compared exactly."""
import copy
import math
import pickle
import typing
from types import SimpleNamespace

import numpy as np
import pytest

import veloxquant
from veloxquant.cache import base
from veloxquant.cache.base import STANDALONE_METHODS, KVCacheBuilder, KVCacheConfig, KVCacheFactory, MethodName
from veloxquant.cache.cachegen_cache import CacheGenKVCache
from veloxquant.core.exceptions import QuantizerConfigError
from veloxquant.quantizers import cachegen as cg
from veloxquant.quantizers._quant_utils import _group_dequant_codes, _group_quant_codes, _group_quant_dequant

from vq_reference import entropy_bits, quantize, random_walk, slice_bytes, token_delta as ref_delta


def make(**kw):
    fields = dict(method="cachegen", head_dim=64, cachegen_bits=4, cachegen_group_size=32)
    fields.update(kw)
    return KVCacheFactory.create(KVCacheConfig(**fields))


def iid(shape, seed, dtype=np.float16):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def mlx_model(n_layers, head_dim=64, **layer_attrs):
    """An mlx_lm-shaped model: model.layers[i].self_attn.head_dim."""
    return SimpleNamespace(layers=[SimpleNamespace(self_attn=SimpleNamespace(head_dim=head_dim)) for _ in range(n_layers)])


def bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))


# ---- one package, one set of classes ----------------------------------------------------------

def test_reference_paths_are_the_flat_classes():
    assert CacheGenKVCache is veloxquant.CacheGenKVCache
    assert KVCacheConfig is veloxquant.KVCacheConfig and KVCacheBuilder is veloxquant.KVCacheBuilder
    assert veloxquant.QuantizerConfigError is QuantizerConfigError and issubclass(QuantizerConfigError, ValueError)
    assert cg.layer_group_bits is veloxquant.layer_group_bits


# ---- configuration and method refusal ---------------------------------------------------------

def test_config_takes_the_originals_fields_and_reads_them_back():
    c = KVCacheConfig(method="cachegen", head_dim=64, bit_width_inlier=3, seed=7, kivi_group_size=16,
                      cachegen_bits=5, cachegen_layer_groups=2)
    assert (c.method, c.head_dim, c.bit_width_inlier, c.seed, c.kivi_group_size) == ("cachegen", 64, 3, 7, 16)
    assert (c.cachegen_bits, c.cachegen_layer_groups, c.effective_bits()) == (5, 2, 5)
    assert KVCacheConfig().method == "cachegen" and KVCacheConfig().head_dim == 128 and KVCacheConfig().observers == []
    assert "method='cachegen'" in repr(c) and "cachegen_bits=5" in repr(c) and "kivi_group_size=16" in repr(c)
    assert c != KVCacheConfig(method="cachegen", head_dim=64, cachegen_bits=5, cachegen_layer_groups=2)  # seed differs
    for copied in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c)):
        assert copied == c and copied is not c and copied.kivi_group_size == 16
    with pytest.raises(AttributeError, match="svdq_rank"):
        KVCacheConfig().svdq_rank  # another method's field, never set
    assert typing.get_type_hints(KVCacheConfig)["method"] is MethodName


def test_config_refusals():
    with pytest.raises(TypeError, match="no_such_field"):
        KVCacheConfig(no_such_field=1)
    with pytest.raises(TypeError, match="method must be a string"):
        KVCacheConfig(4)
    for bad in ({"cachegen_bits": 0}, {"cachegen_group_size": 0}, {"cachegen_flush": "never"}):
        with pytest.raises(QuantizerConfigError):
            KVCacheConfig(method="cachegen", **bad)


def test_method_names_and_the_standalone_set():
    names = typing.get_args(MethodName)
    assert len(names) == 43 and len(set(names)) == 43 and "cachegen" in names
    assert STANDALONE_METHODS == {"turboquant_prod", "turboquant_mse", "polar", "qjl", "spectral"}
    assert base.IMPLEMENTED_METHODS == {"cachegen"}


@pytest.mark.parametrize("method", [m for m in typing.get_args(MethodName) if m != "cachegen"] + ["not_a_method"])
def test_every_other_method_is_refused_naming_it_and_ours(method):
    cfg = KVCacheConfig(method=method, bit_width_inlier=1, seed=42)  # constructs, as in the original
    for build in (lambda: KVCacheFactory.create(cfg), lambda: KVCacheBuilder.for_model(mlx_model(2), cfg),
                  lambda: KVCacheBuilder.for_model(object(), cfg)):  # refused before the model is read
        with pytest.raises(QuantizerConfigError) as e:
            build()
        assert repr(method) in str(e.value) and "'cachegen'" in str(e.value)
        assert "standalone" not in str(e.value)


def test_factory_refuses_what_the_original_refuses():
    with pytest.raises(QuantizerConfigError, match="bit_width_inlier"):
        make(bit_width_inlier=[2, 2])
    with pytest.raises(QuantizerConfigError, match="sliding_window"):
        make(sliding_window=128)
    # A bad cachegen field set after construction is refused when the cache is built.
    c = KVCacheConfig(method="cachegen")
    c.cachegen_group_size = 0
    with pytest.raises(QuantizerConfigError, match="cachegen_group_size"):
        KVCacheFactory.create(c)


# ---- the cache --------------------------------------------------------------------------------

def test_factory_builds_cachegen_with_uniform_bits_and_no_bits_attribute():
    c = make(cachegen_bits=5)
    assert type(c) is CacheGenKVCache and c._bits == 5 and c.config.cachegen_bits == 5
    assert not hasattr(c, "bits") and c.assigned_avg_bits == 5.0  # empty: the configured bits
    assert make(cachegen_bits=5, cachegen_resolved_bits=3)._bits == 3
    # Any object with the original's cachegen_* fields configures the class directly, as in the original.
    assert CacheGenKVCache(SimpleNamespace(cachegen_bits=6, cachegen_group_size=16))._bits == 6


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("flush", ["per_call", "group_aligned"])
def test_shape_dtype_and_reconstruction_equal_group_quant(dtype, flush):
    k, v = iid((1, 2, 64, 64), 3, dtype), iid((1, 2, 64, 64), 4, dtype)  # two whole groups of 32
    ko, vo = make(cachegen_flush=flush).update_and_fetch(k, v)
    assert ko.shape == vo.shape == (1, 2, 64, 64) and ko.dtype == vo.dtype == dtype
    for h in range(2):
        ref = _group_quant_dequant(k[0, h].astype(np.float32), b=4, group_size=32)
        assert ref.dtype == np.float16
        assert bits_equal(ko[0, h].astype(np.float16), ref)
        assert bits_equal(vo[0, h], quantize(v[0, h], 4, 32)[1].astype(dtype))


def test_per_call_counters_are_the_numerics_summed_over_slices():
    k, v = random_walk((2, 3, 45, 16), seed=1), random_walk((2, 3, 45, 8), seed=2)
    for use_delta in (True, False):
        for per_channel in (True, False):
            c = make(cachegen_bits=3, cachegen_group_size=16, cachegen_use_delta=use_delta,
                     cachegen_per_channel=per_channel, cachegen_flush="per_call")
            c.update_and_fetch(k, v)
            for x, comp, fixed in ((k, c.compressed_key_bytes, c.fixed_width_key_bytes),
                                   (v, c.compressed_value_bytes, c.fixed_width_value_bytes)):
                streams = [cg.quantize_to_codes(x[b, h], 3, 16) for b in range(2) for h in range(3)]
                assert comp == sum(cg.entropy_coded_bytes(s, use_delta, per_channel) for s in streams)
                assert fixed == sum(cg.fixed_width_bytes(s) for s in streams)
            assert c.fp16_key_bytes == k.size * 2 and c.fp16_value_bytes == v.size * 2


def correlated(S, H=2, D=64, dtype=np.float16):
    return random_walk((1, H, S, D), seed=S, step=0.15, dtype=dtype)


@pytest.mark.parametrize("flush", ["per_call", "group_aligned"])
def test_byte_accounting_on_correlated_and_iid_data(flush):
    c = make(cachegen_flush=flush)
    k = correlated(256)
    c.update_and_fetch(k, k)
    assert c.entropy_savings > 0.0 and c.compressed_key_bytes < c.fixed_width_key_bytes
    assert 0 < c.compressed_key_bytes <= c.fixed_width_key_bytes < c.fp16_key_bytes
    assert 0 < c.compressed_value_bytes <= c.fixed_width_value_bytes < c.fp16_value_bytes
    assert c.assigned_avg_bits < 16.0
    assert c.entropy_savings == pytest.approx(1 - c.compressed_key_bytes / c.fixed_width_key_bytes)
    r = make(cachegen_flush=flush)
    r.update_and_fetch(iid((1, 2, 64, 64), 0), iid((1, 2, 64, 64), 1))
    assert r.entropy_savings >= 0.0 and r.compressed_key_bytes <= r.fixed_width_key_bytes
    d = make(cachegen_flush=flush, cachegen_use_delta=False)
    d.update_and_fetch(correlated(128), correlated(128))
    assert 0 < d.compressed_key_bytes <= d.fixed_width_key_bytes


def test_decode_after_prefill_and_determinism():
    c = make()
    c.update_and_fetch(iid((1, 2, 32, 64), 0), iid((1, 2, 32, 64), 1))
    for step in range(4):
        ko, vo = c.update_and_fetch(iid((1, 2, 1, 64), 10 + step), iid((1, 2, 1, 64), 20 + step))
        assert ko.shape == (1, 2, 33 + step, 64) and np.isfinite(ko).all() and np.isfinite(vo).all()
    k, v = iid((1, 2, 64, 64), 7), iid((1, 2, 64, 64), 8)
    a, b = make(), make()
    assert bits_equal(a.update_and_fetch(k, v)[0], b.update_and_fetch(k, v)[0])
    assert a.compressed_key_bytes == b.compressed_key_bytes


# ---- for_model on mlx_lm-style models ---------------------------------------------------------

@pytest.mark.parametrize("n_layers", [8, 9, 12])
@pytest.mark.parametrize("base_bits", [4, 6])
def test_for_model_schedule_on_model_objects(n_layers, base_bits):
    caches = KVCacheBuilder.for_model(mlx_model(n_layers), KVCacheConfig(method="cachegen", head_dim=64, cachegen_bits=base_bits))
    assert len(caches) == n_layers and all(type(c) is CacheGenKVCache for c in caches)
    bits = [c._bits for c in caches]
    assert bits == veloxquant.layer_group_bits(n_layers, base_bits)
    assert bits == sorted(bits, reverse=True) and bits[0] == base_bits and bits[-1] < base_bits


def test_for_model_head_dims_as_the_original_finds_them():
    args = SimpleNamespace(hidden_size=256, num_attention_heads=4)
    attn_only = SimpleNamespace(self_attn=SimpleNamespace())  # no head_dim: the model's args give it
    mlp_only = SimpleNamespace()  # no attention: a plain cache
    cfg = KVCacheConfig(cachegen_bits=3)
    attn64 = SimpleNamespace(attn=SimpleNamespace(head_dim=64))  # `attn` instead of `self_attn`
    for model in (SimpleNamespace(layers=[attn_only, mlp_only, attn_only], args=args),
                  SimpleNamespace(model=SimpleNamespace(layers=[attn_only, mlp_only, attn_only]), args=args),
                  SimpleNamespace(layers=[attn64, mlp_only, attn64]),
                  SimpleNamespace(layers=[attn_only, mlp_only, attn_only], args=SimpleNamespace(head_dim=64))):
        caches = KVCacheBuilder.for_model(model, cfg)
        assert [type(c).__name__ for c in caches] == ["CacheGenKVCache", "KVCache", "CacheGenKVCache"]
        assert [c._bits for c in caches if isinstance(c, CacheGenKVCache)] == [3, 2]
        k = iid((1, 1, 3, 64), 0)
        assert caches[0].update_and_fetch(k, k)[0].shape == (1, 1, 3, 64)
    # Without args, a layer whose attention has no head_dim gets a plain cache.
    assert type(KVCacheBuilder.for_model(SimpleNamespace(layers=[attn_only]), cfg)[0]) is veloxquant.KVCache
    # Lists and layer_head_dims objects as before; a list of bits must match the attention layers.
    assert len(KVCacheBuilder.for_model([64, None, 64], cfg)) == 3
    KVCacheBuilder.for_model(mlx_model(2), KVCacheConfig(bit_width_inlier=[2, 2]))
    with pytest.raises(QuantizerConfigError, match="bit_width_inlier"):
        KVCacheBuilder.for_model(mlx_model(2), KVCacheConfig(bit_width_inlier=[2, 2, 2]))
    with pytest.raises(ValueError, match="mlx_lm-style model"):
        KVCacheBuilder.for_model(SimpleNamespace(), cfg)


# ---- the numerics -----------------------------------------------------------------------------

@pytest.mark.parametrize("n,bits,gs", [(40, 4, 16), (32, 3, 16), (33, 2, 32), (5, 8, 7), (1, 4, 32)])
def test_quantize_to_codes_is_the_reference_quantizer(n, bits, gs):
    x = iid((n, 24), n, np.float32)
    st = cg.quantize_to_codes(x, bits=bits, group_size=gs)
    g = -(-n // gs)
    assert st.codes.shape == (g, gs, 24) and st.scale.shape == st.zero.shape == (g, 1, 24)
    assert st.codes.dtype == np.float32 and (st.n_rows, st.bits) == (n, bits)
    assert st.codes.min() >= 0 and st.codes.max() <= (1 << bits) - 1
    flat = st.codes.reshape(-1, 24)
    ref_codes, ref_recon, _ = quantize(x, bits, gs)
    assert np.array_equal(flat[:n], ref_codes)
    assert (flat[n:] == flat[n - 1]).all()  # padding repeats the last real row, as the original pads its input
    recon = cg.dequant_codes(st)
    assert recon.shape == (n, 24) and recon.dtype == np.float16 and bits_equal(recon, ref_recon.astype(np.float16))
    assert bits_equal(cg.cachegen_quant_dequant(x, bits, gs), _group_quant_dequant(x, bits, gs))
    codes, scale, zero = _group_quant_codes(x, bits, gs)
    assert bits_equal(codes, st.codes) and bits_equal(scale, st.scale) and bits_equal(zero, st.zero)
    back = _group_dequant_codes(codes, scale, zero, n, gs)
    assert back.dtype == np.float32 and bits_equal(back, ref_recon)
    assert bits_equal(_group_dequant_codes(codes.reshape(-1, 24), scale.reshape(g, 24), zero.reshape(g, 24), n, gs), back)


def test_token_delta():
    codes = np.random.default_rng(2).integers(0, 16, (20, 8))
    for dtype in (np.float32, np.int32, np.int64):
        d = cg.token_delta(codes.astype(dtype))
        assert d.dtype == dtype and np.array_equal(np.cumsum(d, axis=0), codes)
        assert np.array_equal(d, ref_delta(codes.astype(np.uint8)))
    d = cg.token_delta(codes.astype(np.uint8))
    assert d.dtype == np.int16 and d.min() < 0  # deltas are signed
    one = np.array([[3, 4]], np.float32)
    assert cg.token_delta(one) is one  # one row: as it is
    assert np.array_equal(cg.token_delta(np.array([1, 5, 2])), [1, 4, -3])
    with pytest.raises(ValueError, match="0..255"):
        cg.token_delta(np.array([[0], [300]]))
    with pytest.raises(ValueError, match="integers"):
        cg.token_delta(np.array([[0.5], [1.0]]))


def test_symbol_entropy_bits():
    assert cg.symbol_entropy_bits(np.zeros(100, np.int32)) == 0.0
    assert cg.symbol_entropy_bits(np.array([0, 1] * 50, np.int32)) == pytest.approx(1.0, abs=1e-12)
    s = np.random.default_rng(3).integers(0, 16, 1000)
    assert cg.symbol_entropy_bits(s) <= math.log2(16)
    assert cg.symbol_entropy_bits(s) == pytest.approx(entropy_bits(s), abs=1e-12)
    assert cg.symbol_entropy_bits(np.array([], np.int32)) == 0.0
    assert cg.symbol_entropy_bits(np.array([0.9, -0.9, 1.5])) == pytest.approx(entropy_bits([0, 0, 1]))  # truncated
    with pytest.raises(ValueError, match="int16"):
        cg.symbol_entropy_bits(np.array([0, 40000]))
    # Delta lowers the entropy of token-correlated codes.
    st = cg.quantize_to_codes(random_walk((1, 1, 128, 64), seed=4, step=0.15)[0, 0], bits=4, group_size=32)
    flat = st.codes.reshape(-1, 64)[:128]
    assert cg.symbol_entropy_bits(cg.token_delta(flat)) < cg.symbol_entropy_bits(flat)


@pytest.mark.parametrize("use_delta", [True, False])
@pytest.mark.parametrize("per_channel", [True, False])
def test_entropy_and_fixed_width_bytes_are_the_reference_formulas(use_delta, per_channel):
    for x in (iid((64, 32), 4, np.float32), random_walk((1, 1, 70, 16), seed=5)[0, 0]):
        st = cg.quantize_to_codes(x, bits=4, group_size=32)
        est, fixed = slice_bytes(x, 4, 32, use_delta, per_channel)
        assert cg.entropy_coded_bytes(st, use_delta=use_delta, per_channel=per_channel) == est
        assert cg.fixed_width_bytes(st) == fixed
        assert est <= fixed


def test_entropy_bytes_per_channel_and_correlation():
    walk = np.cumsum(np.random.default_rng(5).standard_normal((128, 32)).astype(np.float32) * 0.1, axis=0)
    st = cg.quantize_to_codes(walk, bits=4, group_size=32)
    assert cg.entropy_coded_bytes(st, use_delta=True) < cg.fixed_width_bytes(st)
    mixed = np.cumsum(np.random.default_rng(7).standard_normal((128, 32)).astype(np.float32), axis=0)
    mixed *= np.r_[np.full(16, 0.05), np.full(16, 5.0)].astype(np.float32)
    st = cg.quantize_to_codes(mixed, bits=4, group_size=32)
    assert cg.entropy_coded_bytes(st, True, per_channel=True) <= cg.entropy_coded_bytes(st, True, per_channel=False)


def test_layer_group_bits_through_the_reference_path():
    s = cg.layer_group_bits(n_layers=24, base_bits=4, n_groups=3)
    assert s == [4] * 8 + [3] * 8 + [2] * 8
    assert min(cg.layer_group_bits(n_layers=9, base_bits=3, n_groups=3)) == 2
    assert cg.layer_group_bits(n_layers=0, base_bits=4) == [] and cg.layer_group_bits(n_layers=1, base_bits=4) == [4]


def test_numerics_refuse_bad_input_clearly():
    x = iid((8, 4), 0, np.float32)
    with pytest.raises(ValueError, match="float16 or float32"):
        cg.quantize_to_codes(x.astype(np.float64), 4)
    with pytest.raises(ValueError, match="2-D"):
        cg.quantize_to_codes(x[None], 4)
    with pytest.raises(ValueError, match="bits"):
        cg.quantize_to_codes(x, 9)
    with pytest.raises(ValueError, match="group_size"):
        cg.quantize_to_codes(x, 4, group_size=0)
    with pytest.raises(TypeError, match="bits"):
        cg.quantize_to_codes(x, 4.0)
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        cg.quantize_to_codes(bad, 4)
    st = cg.quantize_to_codes(x, 2, group_size=4)
    with pytest.raises(ValueError, match="0..3"):
        cg.dequant_codes(st._replace(codes=st.codes + 4))
    with pytest.raises(ValueError, match="n_rows"):
        cg.fixed_width_bytes(st._replace(n_rows=20))
    with pytest.raises(ValueError, match="scale"):
        cg.entropy_coded_bytes(st._replace(scale=st.scale[:1]))
    with pytest.raises(TypeError, match="CodeStream"):
        cg.dequant_codes(x)
    with pytest.raises(ValueError, match="groups"):
        _group_dequant_codes(st.codes, st.scale, st.zero, 9, group_size=4)
