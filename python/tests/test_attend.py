"""KVCache.attend through the Python API: dense attention with a causal mask and grouped-query
heads, computed by the cache, against numpy."""
import numpy as np
import pytest
import veloxquant as vq

from vq_reference import random_walk


def numpy_attention(q, k, v, scale):
    """softmax(scale q k^T) v in float64; the last Sq cached tokens are the queries' own."""
    B, Hq, Sq, _ = q.shape
    G, T = Hq // k.shape[1], k.shape[2]
    out = np.zeros((B, Hq, Sq, v.shape[3]))
    for b in range(B):
        for h in range(Hq):
            for i in range(Sq):
                vis = T - Sq + i + 1
                s = scale * (k[b, h // G, :vis].astype(np.float64) @ q[b, h, i].astype(np.float64))
                p = np.exp(s - s.max())
                out[b, h, i] = (p / p.sum()) @ v[b, h // G, :vis].astype(np.float64)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("B,Hkv,Hq,D,T,Sq", [(1, 4, 4, 8, 300, 1), (2, 2, 8, 13, 50, 4), (1, 8, 32, 128, 70, 1)])
def test_attend_equals_numpy_attention(dtype, B, Hkv, Hq, D, T, Sq):
    k = random_walk((B, Hkv, T, D), seed=1, dtype=dtype)
    v = random_walk((B, Hkv, T, D), seed=2, dtype=dtype)
    q = np.random.default_rng(3).uniform(-1, 1, (B, Hq, Sq, D)).astype(dtype)
    cache = vq.KVCache()
    cache.update_and_fetch(k, v)
    out = cache.attend(q, 1 / np.sqrt(D))
    assert out.dtype == np.float32 and out.shape == (B, Hq, Sq, D)
    np.testing.assert_allclose(out, numpy_attention(q, k, v, 1 / np.sqrt(D)), rtol=1e-5, atol=1e-5)


def test_attend_over_a_quantizing_cache_uses_its_reconstruction():
    k = random_walk((1, 2, 64, 32), seed=4, dtype=np.float32)
    cache = vq.CacheGenKVCache(vq.KVCacheConfig(cachegen_bits=2))
    ko, vo = cache.update_and_fetch(k, k)
    q = np.random.default_rng(5).uniform(-1, 1, (1, 4, 3, 32)).astype(np.float32)
    out = cache.attend(q, 0.2)
    np.testing.assert_allclose(out, numpy_attention(q, ko, vo, 0.2), rtol=1e-5, atol=1e-5)
    assert np.abs(out - numpy_attention(q, k, k, 0.2)).max() > 1e-3  # not the unquantized input


def test_bad_queries_raise_value_error_and_leave_the_cache_alone():
    cache = vq.KVCache()
    with pytest.raises(ValueError, match="the cache is empty"):
        cache.attend(np.zeros((1, 2, 1, 8), np.float32), 1.0)
    k = random_walk((1, 2, 5, 8), seed=6, dtype=np.float32)
    cache.update_and_fetch(k, k)
    for q, scale, msg in [
        (np.zeros((1, 2, 1, 9), np.float32), 1.0, "head dim 9"),
        (np.zeros((1, 3, 1, 8), np.float32), 1.0, "not a positive multiple"),
        (np.zeros((2, 2, 1, 8), np.float32), 1.0, "batch 2"),
        (np.zeros((1, 2, 6, 8), np.float32), 1.0, "offset = 5"),
        (np.zeros((1, 2, 1, 8), np.float64), 1.0, "float16 or float32"),
        (np.zeros((1, 2, 1, 8), np.float16), 1.0, "queries are float16 but must be float32 or the cache's float32"),
        (np.zeros((2, 1, 8), np.float32), 1.0, "4-D"),
        (np.zeros((1, 2, 1, 8), np.float32), float("nan"), "scale must be finite"),
        (np.zeros((1, 2, 1, 8), np.float32), 1e300, "scale must be finite"),
    ]:
        with pytest.raises(ValueError, match=msg):
            cache.attend(q, scale)
    assert cache.offset == 5
    np.testing.assert_array_equal(cache.state[0], k)
