"""CacheGenKVCache through the Python API: the reference's tested behaviour, and veloxquant's
group_aligned fix."""
import pathlib

import numpy as np
import pytest
import veloxquant as vq

from vq_reference import entropy_bits, quant_dequant, quantize, random_walk, slice_bytes, token_delta

DTYPES = [np.float32, np.float16]


def cfg(**kw):
    return vq.KVCacheConfig(**kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group", [(4, 32), (2, 32), (8, 7), (3, 1)])
def test_per_call_reconstruction_equals_group_quant_dequant(dtype, bits, group):
    k = random_walk((2, 3, 45, 16), seed=1, dtype=dtype)
    v = random_walk((2, 3, 45, 8), seed=2, dtype=dtype)
    cache = vq.CacheGenKVCache(cfg(cachegen_bits=bits, cachegen_group_size=group, cachegen_flush="per_call"))
    ko, vo = cache.update_and_fetch(k, v)
    assert ko.dtype == dtype and vo.dtype == dtype
    assert ko.shape == k.shape and vo.shape == v.shape
    np.testing.assert_array_equal(ko, quant_dequant(k, bits, group, dtype))
    np.testing.assert_array_equal(vo, quant_dequant(v, bits, group, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_aligned_reconstruction_closed_groups_quantized_residual_exact(dtype):
    k = random_walk((1, 2, 70, 16), seed=3, dtype=dtype)  # 2 closed groups of 32, 6 residual tokens
    v = random_walk((1, 2, 70, 16), seed=4, dtype=dtype)
    cache = vq.CacheGenKVCache(cfg())
    ko, vo = cache.update_and_fetch(k, v)
    np.testing.assert_array_equal(ko[:, :, :64], quant_dequant(k[:, :, :64], 4, 32, dtype))
    np.testing.assert_array_equal(vo[:, :, :64], quant_dequant(v[:, :, :64], 4, 32, dtype))
    np.testing.assert_array_equal(ko[:, :, 64:], k[:, :, 64:])
    np.testing.assert_array_equal(vo[:, :, 64:], v[:, :, 64:])


def test_codes_in_range_and_delta_cumsum_restores_them():
    k = random_walk((1, 2, 64, 16), seed=5)
    cache = vq.CacheGenKVCache(cfg(cachegen_bits=3))
    cache.update_and_fetch(k, k)
    for s in range(2):
        codes = cache.key_codes(s)
        assert codes.shape == (64, 16) and codes.dtype == np.uint8
        assert codes.max() <= 7
        np.testing.assert_array_equal(codes, quantize(k[0, s], 3, 32)[0])
        np.testing.assert_array_equal(np.cumsum(token_delta(codes), axis=0), codes)
    assert cache.value_codes(1).shape == (64, 16)
    with pytest.raises(ValueError):
        cache.key_codes(2)


@pytest.mark.parametrize("use_delta", [True, False])
@pytest.mark.parametrize("per_channel", [True, False])
def test_per_call_bytes_match_numpy_formulas(use_delta, per_channel):
    k = random_walk((2, 2, 50, 16), seed=6)
    v = random_walk((2, 2, 50, 8), seed=7)
    cache = vq.CacheGenKVCache(
        cfg(cachegen_flush="per_call", cachegen_use_delta=use_delta, cachegen_per_channel=per_channel)
    )
    cache.update_and_fetch(k, v)
    for x, comp, fixed, fp16 in [
        (k, cache.compressed_key_bytes, cache.fixed_width_key_bytes, cache.fp16_key_bytes),
        (v, cache.compressed_value_bytes, cache.fixed_width_value_bytes, cache.fp16_value_bytes),
    ]:
        want = [slice_bytes(x[b, h], 4, 32, use_delta, per_channel) for b in range(2) for h in range(2)]
        assert fixed == sum(f for _, f in want)
        # The entropy may differ by a byte per slice after ceil (summation order).
        assert abs(comp - sum(c for c, _ in want)) <= len(want)
        assert fp16 == x.size * 2


def test_constant_input_costs_only_metadata():
    k = np.full((1, 2, 64, 8), 0.5, np.float32)
    cache = vq.CacheGenKVCache(cfg(cachegen_flush="per_call"))
    ko, _ = cache.update_and_fetch(k, k)
    np.testing.assert_array_equal(ko, k)
    assert cache.compressed_key_bytes == 2 * 2 * 8 * 4  # 2 slices x 2 groups x D x (scale + zero)
    assert entropy_bits(np.zeros(10)) == 0.0


@pytest.mark.parametrize("flush", ["per_call", "group_aligned"])
def test_long_correlated_data_compresses(flush):
    k = random_walk((1, 4, 512, 64), seed=8)
    v = random_walk((1, 4, 512, 64), seed=9)
    cache = vq.CacheGenKVCache(cfg(cachegen_flush=flush))
    cache.update_and_fetch(k, v)
    assert 0 < cache.compressed_key_bytes <= cache.fixed_width_key_bytes < cache.fp16_key_bytes
    assert 0 < cache.compressed_value_bytes <= cache.fixed_width_value_bytes < cache.fp16_value_bytes
    assert cache.entropy_savings > 0
    assert cache.assigned_avg_bits < 16
    assert cache.assigned_avg_bits == pytest.approx(16 * cache.compressed_key_bytes / cache.fp16_key_bytes)
    assert cache.entropy_savings == pytest.approx(1 - cache.compressed_key_bytes / cache.fixed_width_key_bytes)


def test_iid_data_savings_nonnegative():
    rng = np.random.default_rng(10)
    k = rng.normal(size=(1, 2, 256, 32)).astype(np.float32)
    cache = vq.CacheGenKVCache(cfg(cachegen_flush="per_call"))
    cache.update_and_fetch(k, k)
    assert cache.entropy_savings >= 0


def test_empty_cache_counters():
    cache = vq.CacheGenKVCache(cfg(cachegen_bits=3))
    assert cache.offset == 0
    assert cache.compressed_key_bytes == 0 and cache.fp16_value_bytes == 0
    assert cache.entropy_savings == 0
    assert cache.assigned_avg_bits == 3
    assert not hasattr(cache, "bits")


@pytest.mark.parametrize("flush", ["per_call", "group_aligned"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_after_prefill_no_nan_and_shapes(flush, dtype):
    k = random_walk((1, 4, 100, 32), seed=11, dtype=dtype)
    v = random_walk((1, 4, 100, 32), seed=12, dtype=dtype)
    cache = vq.CacheGenKVCache(cfg(cachegen_flush=flush))
    cache.update_and_fetch(k[:, :, :60], v[:, :, :60])
    for t in range(60, 100):
        ko, vo = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert ko.shape == (1, 4, t + 1, 32) and ko.dtype == dtype
    assert cache.offset == 100
    assert np.isfinite(ko).all() and np.isfinite(vo).all()


@pytest.mark.parametrize("flush", ["per_call", "group_aligned"])
def test_deterministic(flush):
    k = random_walk((2, 2, 77, 16), seed=13, dtype=np.float16)
    outs = []
    for _ in range(2):
        cache = vq.CacheGenKVCache(cfg(cachegen_flush=flush))
        for s in range(0, 77, 10):
            ko, vo = cache.update_and_fetch(k[:, :, s : s + 10], k[:, :, s : s + 10])
        outs.append((ko.tobytes(), vo.tobytes(), cache.compressed_key_bytes, cache.compressed_value_bytes))
    assert outs[0] == outs[1]


def test_per_call_one_token_decode_flaw_reproduced():
    """The reference's flaw, kept in per_call: a one-token step is stored exactly and billed a whole
    group of scale/zero (D*4 bytes per head), more than its fp16 size (D*2)."""
    D, H = 32, 2
    k = random_walk((1, H, 80, D), seed=14)
    cache = vq.CacheGenKVCache(cfg(cachegen_flush="per_call"))
    cache.update_and_fetch(k[:, :, :64], k[:, :, :64])
    c0, f0 = cache.compressed_key_bytes, cache.fp16_key_bytes
    for t in range(64, 80):
        ko, _ = cache.update_and_fetch(k[:, :, t : t + 1], k[:, :, t : t + 1])
        np.testing.assert_array_equal(ko[:, :, t], k[:, :, t])  # never quantized
    steps = 16
    assert cache.compressed_key_bytes - c0 == steps * H * D * 4
    assert cache.fp16_key_bytes - f0 == steps * H * D * 2
    assert cache.compressed_key_bytes - c0 > cache.fp16_key_bytes - f0


def test_group_aligned_quantizes_decode_steps():
    D, H = 32, 2
    k = random_walk((1, H, 64, D), seed=15)
    cache = vq.CacheGenKVCache(cfg())
    cache.update_and_fetch(k[:, :, :32], k[:, :, :32])
    for t in range(32, 64):
        ko, _ = cache.update_and_fetch(k[:, :, t : t + 1], k[:, :, t : t + 1])
    np.testing.assert_array_equal(ko, quant_dequant(k, 4, 32, np.float32))
    assert cache.compressed_key_bytes < cache.fp16_key_bytes


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_aligned_chunking_independence(dtype):
    k = random_walk((1, 3, 101, 16), seed=16, dtype=dtype)
    v = random_walk((1, 3, 101, 24), seed=17, dtype=dtype)
    results = []
    for chunk in (101, 7, 1):
        cache = vq.CacheGenKVCache(cfg())
        for s in range(0, 101, chunk):
            ko, vo = cache.update_and_fetch(k[:, :, s : s + chunk], v[:, :, s : s + chunk])
        results.append(
            (ko.tobytes(), vo.tobytes(), cache.compressed_key_bytes, cache.compressed_value_bytes,
             cache.fixed_width_key_bytes, cache.fixed_width_value_bytes, cache.key_codes(2).tobytes())
        )
    assert results[0] == results[1] == results[2]


def _fed(flush, k, calls):
    cache = vq.CacheGenKVCache(cfg(cachegen_flush=flush))
    for s, e in calls:
        cache.update_and_fetch(k[:, :, s:e], k[:, :, s:e])
    return cache


COUNTERS = ("compressed_key_bytes", "compressed_value_bytes", "fixed_width_key_bytes", "fixed_width_value_bytes",
            "fp16_key_bytes", "fp16_value_bytes")


@pytest.mark.parametrize("flush,trim_n", [("per_call", 40), ("per_call", 10), ("group_aligned", 30), ("group_aligned", 1)])
def test_trim_rolls_back_to_a_cache_of_the_kept_tokens(flush, trim_n):
    """per_call: trimmed on a call boundary; group_aligned: 100 tokens = 3 closed groups + 4, trim 30
    reopens group 2 (and trim 1 only shortens the residual)."""
    k = random_walk((1, 2, 100, 16), seed=18)
    calls = [(0, 30), (30, 60), (60, 90), (90, 100)] if flush == "per_call" else [(0, 45), (45, 100)]
    cache = _fed(flush, k, calls)
    assert cache.is_trimmable()
    assert cache.trim(trim_n) == trim_n
    kept = 100 - trim_n
    assert cache.offset == kept
    fresh = _fed(flush, k, [(s, min(e, kept)) for s, e in calls if s < kept])
    for name in COUNTERS:
        assert getattr(cache, name) == getattr(fresh, name), name
    sk, sv = cache.state
    assert sk.shape == (1, 2, kept, 16)
    if flush == "per_call":
        np.testing.assert_array_equal(sk, fresh.state[0])
    assert cache.trim(1000) == kept and cache.offset == 0
    assert cache.compressed_key_bytes == 0
    with pytest.raises(ValueError):
        cache.trim(-1)


def test_per_call_trim_inside_a_call_reaccounts_its_kept_tokens():
    k = random_walk((1, 2, 90, 16), seed=18)
    cache = _fed("per_call", k, [(0, 30), (30, 60), (60, 90)])
    cache.trim(25)
    fresh = _fed("per_call", k, [(0, 30), (30, 60), (60, 65)])
    # The kept 5 tokens keep the codes they got in their 30-token call, so only the sizes that do
    # not depend on the codes must equal those of a fresh cache.
    for name in ("fixed_width_key_bytes", "fixed_width_value_bytes", "fp16_key_bytes", "fp16_value_bytes"):
        assert getattr(cache, name) == getattr(fresh, name), name
    assert 0 < cache.compressed_key_bytes <= cache.fixed_width_key_bytes


def _noncontiguous_variants(x):
    f = np.asfortranarray(x)
    t = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # same values, S/H strides swapped
    big = np.zeros(x.shape[:3] + (x.shape[3] * 2,), x.dtype)
    big[..., ::2] = x
    stepped = big[..., ::2]  # D not contiguous
    rev = np.ascontiguousarray(x[:, :, ::-1])[:, :, ::-1]  # negative stride
    return [f, t, stepped, rev]


@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous_input_is_copied_not_misread(dtype):
    k = random_walk((2, 3, 40, 8), seed=19, dtype=dtype)
    v = random_walk((2, 3, 40, 8), seed=20, dtype=dtype)
    ref = vq.CacheGenKVCache(cfg())
    want = [a.tobytes() for a in ref.update_and_fetch(k, v)]
    for kk, vv in zip(_noncontiguous_variants(k), _noncontiguous_variants(v)):
        assert not kk.flags.c_contiguous
        np.testing.assert_array_equal(kk, k)
        cache = vq.CacheGenKVCache(cfg())
        got = [a.tobytes() for a in cache.update_and_fetch(kk, vv)]
        assert got == want
    # A broadcast (zero-stride) input equals its materialised copy.
    row = k[:, :, :1]
    b = np.broadcast_to(row, k.shape)
    c1, c2 = vq.CacheGenKVCache(cfg()), vq.CacheGenKVCache(cfg())
    assert c1.update_and_fetch(b, b)[0].tobytes() == c2.update_and_fetch(np.ascontiguousarray(b), np.ascontiguousarray(b))[0].tobytes()


def test_huge_broadcasts_and_fp16_overflow_are_value_errors():
    # Issue 36: a zero-stride array claiming terabytes raised a pybind11 internal error; an fp16
    # cache stored values beyond float16's range as inf.
    huge = np.broadcast_to(np.float32(1), (1, 1, 1 << 26, 1 << 12))  # 1 TiB as a copy
    with pytest.raises(ValueError, match="could not be copied"):
        vq.CacheGenKVCache(cfg()).update_and_fetch(huge, huge)
    beyond = np.broadcast_to(np.float32(1), (1 << 20, 1 << 20, 1 << 10, 1 << 10))
    with pytest.raises(ValueError, match="more than 2\\^40 elements"):
        vq.CacheGenKVCache(cfg()).update_and_fetch(beyond, beyond)
    model = pathlib.Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K.bin"
    big = np.full((1, 8, 4, 8), 1e5, dtype=np.float32)
    with pytest.raises(ValueError, match="outside float16's range"):
        vq.make_caches("fp16", str(model))[0].update_and_fetch(big, big)


def test_inputs_are_not_modified_and_copies_are_independent():
    k = random_walk((1, 2, 40, 8), seed=21)
    keep = k.copy()
    cache = vq.CacheGenKVCache(cfg())
    ko, _ = cache.update_and_fetch(k, k)
    np.testing.assert_array_equal(k, keep)
    assert ko.flags.c_contiguous and ko.flags.writeable
    before = ko.copy()
    cache.update_and_fetch(k[:, :, :30], k[:, :, :30])  # closes group 2: the buffer's residual rows are rewritten
    np.testing.assert_array_equal(ko, before)  # the copy returned earlier did not change


def test_copy_false_returns_read_only_views():
    k = random_walk((1, 2, 40, 8), seed=22)
    a = vq.CacheGenKVCache(cfg())
    b = vq.CacheGenKVCache(cfg())
    kv, vv = a.update_and_fetch(k, k, copy=False)
    kc, vc = b.update_and_fetch(k, k)
    assert not kv.flags.writeable
    with pytest.raises(ValueError):
        kv[0, 0, 0, 0] = 1
    np.testing.assert_array_equal(kv, kc)
    np.testing.assert_array_equal(vv, vc)
    del a  # the view keeps the buffer alive
    np.testing.assert_array_equal(kv, kc)


def test_mixed_head_dims_and_dtype_mismatch():
    cache = vq.CacheGenKVCache(cfg())
    k = np.zeros((1, 2, 4, 16), np.float16)
    v = np.zeros((1, 2, 4, 8), np.float16)
    ko, vo = cache.update_and_fetch(k, v)
    assert ko.shape[-1] == 16 and vo.shape[-1] == 8
    with pytest.raises(ValueError, match="float32"):
        cache.update_and_fetch(k.astype(np.float32), v.astype(np.float32))
    with pytest.raises(ValueError):
        cache.update_and_fetch(k[:, :1], v[:, :1])
    assert cache.offset == 4  # unchanged by the refused calls


def test_nan_refused_and_cache_unchanged():
    cache = vq.CacheGenKVCache(cfg())
    k = np.ones((1, 1, 4, 8), np.float32)
    cache.update_and_fetch(k, k)
    bad = k.copy()
    bad[0, 0, 1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        cache.update_and_fetch(bad, k)
    assert cache.offset == 4
