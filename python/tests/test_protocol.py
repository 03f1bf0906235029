"""mlx_lm's cache protocol on veloxquant's caches: state / meta_state get and set, from_state,
size, empty, trim, copy.deepcopy and pickle (through the .vqkv bytes), every copy exact."""
import copy
import pathlib
import pickle

import numpy as np
import pytest

import veloxquant as vq
from veloxquant.cache.base import KVCacheConfig

from vq_reference import random_walk


def bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))


COUNTERS = ("compressed_key_bytes", "compressed_value_bytes", "fixed_width_key_bytes", "fixed_width_value_bytes",
            "fp16_key_bytes", "fp16_value_bytes", "encoded_key_bytes", "encoded_value_bytes")


def assert_same_cache(a, b):
    """b is an exact, independent copy of a: same class, config, contents, counters; and both
    continue identically."""
    assert type(a) is type(b) and a is not b and a.offset == b.offset
    if a.offset:
        for x, y in zip(a.state, b.state):
            assert bits_equal(x, y)
    if isinstance(a, vq.CacheGenKVCache):
        assert a.config == b.config and a._bits == b._bits and a.meta_state == b.meta_state
        assert [getattr(a, n) for n in COUNTERS] == [getattr(b, n) for n in COUNTERS]
        if a.offset:
            for s in range(a.state[0].shape[0] * a.state[0].shape[1]):
                assert np.array_equal(a.key_codes(s), b.key_codes(s)) and np.array_equal(a.value_codes(s), b.value_codes(s))
    dtype = a.state[0].dtype if a.offset else np.float16
    shape = a.state[0].shape if a.offset else (1, 2, 0, 16)
    k = random_walk((shape[0], shape[1], 5, shape[3]), seed=99).astype(dtype)
    ka, va = a.update_and_fetch(k, k)
    kb, vb = b.update_and_fetch(k, k)
    assert bits_equal(ka, kb) and bits_equal(va, vb)


def filled(kind, flush="group_aligned", dtype=np.float16, tokens=45):
    if kind == "plain":
        c = vq.KVCache()
    else:
        c = vq.CacheGenKVCache(vq.KVCacheConfig(cachegen_bits=3, cachegen_group_size=16, cachegen_flush=flush))
    k = random_walk((1, 2, tokens, 16), seed=1, dtype=dtype)
    v = random_walk((1, 2, tokens, 16), seed=2, dtype=dtype)
    c.update_and_fetch(k[:, :, :20], v[:, :, :20])  # two calls: per_call groups form per call
    c.update_and_fetch(k[:, :, 20:], v[:, :, 20:])
    return c


CASES = [("plain", "group_aligned", np.float16), ("cachegen", "group_aligned", np.float16),
         ("cachegen", "group_aligned", np.float32), ("cachegen", "per_call", np.float16)]


COPIERS = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": lambda x: pickle.loads(pickle.dumps(x))}


@pytest.mark.parametrize("kind,flush,dtype", CASES)
@pytest.mark.parametrize("how", sorted(COPIERS))
def test_copies_are_exact_and_independent(kind, flush, dtype, how):
    c = filled(kind, flush, dtype)
    before = [x.copy() for x in c.state]
    d = COPIERS[how](c)
    assert all(bits_equal(x, y) for x, y in zip(c.state, before))  # the original is untouched
    assert_same_cache(c, d)


@pytest.mark.parametrize("how", sorted(COPIERS))
def test_empty_caches_copy(how):
    for c in (vq.KVCache(), vq.CacheGenKVCache(vq.KVCacheConfig(cachegen_bits=5, cachegen_flush="per_call"))):
        d = COPIERS[how](c)
        assert type(d) is type(c) and d is not c and d.empty()
        if isinstance(c, vq.CacheGenKVCache):
            assert d.config == c.config


def test_pickle_is_the_vqkv_bytes_and_keeps_a_scheduled_layer():
    caches = vq.KVCacheBuilder.for_model([16, 16, None], vq.KVCacheConfig(cachegen_bits=4))
    k = random_walk((1, 2, 40, 16), seed=3, dtype=np.float16)
    for c in caches:
        c.update_and_fetch(k, k)
    data = pickle.dumps(caches)
    loaded = pickle.loads(data)
    assert [c._bits for c in loaded[:2]] == [4, 3] and type(loaded[2]) is vq.KVCache
    for a, b in zip(caches, loaded):
        assert_same_cache(a, b)
    # The payload is the cache's .vqkv bytes (its magic) and is smaller than the fp16 cache.
    reduced = caches[0].__reduce__()
    assert reduced[1][0][:4] == vq._core._serialize_caches([caches[0]])[:4]
    assert len(reduced[1][0]) < caches[0].fp16_key_bytes + caches[0].fp16_value_bytes


def test_size_empty_trim():
    for c in (vq.KVCache(), vq.CacheGenKVCache()):
        assert c.size() == 0 and c.empty() and c.is_trimmable()
        k = np.ones((1, 1, 7, 8), np.float16)
        c.update_and_fetch(k, k)
        assert c.size() == 7 and not c.empty()
        assert c.trim(3) == 3 and c.size() == 4 and c.offset == 4
        assert c.trim(10) == 4 and c.empty()


def test_plain_state_and_meta_state():
    c = filled("plain")
    keys, values = c.state
    assert c.meta_state == ""
    other = vq.KVCache.from_state(c.state, c.meta_state)
    assert type(other) is vq.KVCache and bits_equal(other.state[0], keys) and bits_equal(other.state[1], values)
    other.meta_state = None
    other.meta_state = ()
    with pytest.raises(ValueError, match="no meta_state"):
        other.meta_state = ("x",)


def test_cachegen_state_set_from_a_read_state_is_exact():
    src = filled("cachegen", "per_call")
    st = src.state
    assert isinstance(st, tuple) and len(st) == 2
    keys, values = st  # unpacks as mlx_lm's (keys, values)
    dst = vq.CacheGenKVCache()  # another configuration: the state brings the source's
    dst.state = st
    assert_same_cache(src, dst)
    # The state is a snapshot: after the source changes, it still rebuilds the source as it was.
    src.update_and_fetch(keys[:, :, :3], values[:, :, :3])
    again = vq.CacheGenKVCache.from_state(st, dst.meta_state)
    assert again.offset == 45 and bits_equal(again.state[0], keys)
    # A read state, pickled and loaded, still carries its codes.
    fresh = vq.CacheGenKVCache()
    fresh.state = pickle.loads(pickle.dumps(st))
    assert bits_equal(fresh.state[1], values) and fresh.config.cachegen_flush == "per_call"


def test_cachegen_state_refusals():
    src = filled("cachegen")
    keys, values = src.state
    dst = vq.CacheGenKVCache()
    with pytest.raises(ValueError, match="dense keys/values alone"):
        dst.state = (keys, values)  # bare arrays: the codes are not in them
    st = src.state
    st[0][0, 0, 0, 0] += 1
    with pytest.raises(ValueError, match="changed after it was read"):
        dst.state = st
    assert dst.offset == 0


def test_cachegen_meta_state():
    c = filled("cachegen", "per_call")
    meta = c.meta_state
    assert meta == ("cachegen_bits=3", "cachegen_group_size=16", "cachegen_use_delta=True", "cachegen_per_channel=True",
                    "cachegen_layer_groups=3", "cachegen_resolved_bits=None", "cachegen_flush=per_call")
    c.meta_state = meta  # consistent: nothing changes
    with pytest.raises(ValueError, match="cannot change"):
        c.meta_state = vq.CacheGenKVCache().meta_state
    empty = vq.CacheGenKVCache()
    empty.meta_state = meta  # an empty cache takes a configuration
    assert empty.config == c.config and empty._bits == 3
    built = vq.CacheGenKVCache.from_state(vq.CacheGenKVCache().state, meta)
    assert built.offset == 0 and built.config.cachegen_group_size == 16
    for bad in ("cachegen_bits=3", ("cachegen_bits=x",) + meta[1:], meta[:-1], ("nope=1",) + meta[1:],
                ("cachegen_bits=0",) + meta[1:]):
        with pytest.raises(ValueError):
            vq.CacheGenKVCache().meta_state = bad


def test_config_is_a_full_config_copy():
    c = vq.CacheGenKVCache(KVCacheConfig(cachegen_bits=5))
    cfg = c.config
    assert type(cfg) is vq.KVCacheConfig and cfg.method == "cachegen" and cfg.cachegen_bits == 5
    cfg.cachegen_bits = 2
    assert c.config.cachegen_bits == 5 and c._bits == 5


def test_other_caches_refuse_copy_and_pickle():
    model = pathlib.Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K.bin"
    if not model.is_file():
        pytest.skip(f"{model} not found")
    (c, *_) = vq.make_caches("kivi", str(model))
    assert c._kind != "KVCache"
    for op in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=c._kind):
            op(c)


def test_empty_cachegen_layers_wider_than_4_bits_save_and_load(tmp_path):
    # An empty layer's streams do not exist yet: the file once recorded them as 4-bit (context
    # coded), so a 5..8-bit empty layer wrote a file its reader refused.
    caches = vq.KVCacheBuilder.for_model([16, 16], vq.KVCacheConfig(cachegen_bits=8, cachegen_layer_groups=1))
    k = random_walk((1, 2, 40, 16), seed=6, dtype=np.float16)
    caches[0].update_and_fetch(k, k)
    path = str(tmp_path / "wide.vqkv")
    vq.save_prompt_cache(path, caches)
    loaded = vq.load_prompt_cache(path)
    assert [c._bits for c in loaded] == [8, 8] and loaded[1].empty()
    assert_same_cache(caches[0], loaded[0])
    assert_same_cache(caches[1], loaded[1])
