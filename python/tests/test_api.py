"""The module's API surface: config, plain cache, builder, schedule, errors."""
import pathlib

import numpy as np
import pytest
import veloxquant as vq


def test_config_defaults_and_attributes():
    c = vq.KVCacheConfig()
    assert (c.cachegen_bits, c.cachegen_group_size, c.cachegen_use_delta, c.cachegen_per_channel) == (4, 32, True, True)
    assert c.cachegen_layer_groups == 3 and c.cachegen_resolved_bits is None and c.cachegen_flush == "group_aligned"
    c = vq.KVCacheConfig(cachegen_bits=3, cachegen_group_size=16, cachegen_use_delta=False, cachegen_per_channel=False,
                         cachegen_layer_groups=2, cachegen_resolved_bits=2, cachegen_flush="per_call")
    assert (c.cachegen_bits, c.cachegen_group_size, c.cachegen_use_delta, c.cachegen_per_channel) == (3, 16, False, False)
    assert (c.cachegen_layer_groups, c.cachegen_resolved_bits, c.cachegen_flush) == (2, 2, "per_call")
    assert c.effective_bits() == 2
    c.cachegen_resolved_bits = None
    c.cachegen_flush = "group_aligned"
    c.cachegen_bits = 5
    assert c.effective_bits() == 5 and c.cachegen_flush == "group_aligned"
    assert c == vq.KVCacheConfig(cachegen_bits=5, cachegen_group_size=16, cachegen_use_delta=False,
                                 cachegen_per_channel=False, cachegen_layer_groups=2)
    assert "cachegen_bits=5" in repr(c)


@pytest.mark.parametrize("kw", [{"cachegen_bits": 0}, {"cachegen_bits": 9}, {"cachegen_group_size": 0},
                                {"cachegen_layer_groups": 0}, {"cachegen_resolved_bits": 9},
                                {"cachegen_flush": "sometimes"}])
def test_config_refuses_bad_values_with_value_error(kw):
    with pytest.raises(ValueError):
        vq.KVCacheConfig(**kw)


def test_invalid_config_set_later_refused_by_cache():
    c = vq.KVCacheConfig()
    c.cachegen_bits = 12
    with pytest.raises(ValueError, match="cachegen_bits"):
        vq.CacheGenKVCache(c)
    with pytest.raises(ValueError):
        c.cachegen_flush = "never"


def test_cache_config_and_no_bits_attribute():
    cache = vq.CacheGenKVCache(vq.KVCacheConfig(cachegen_bits=3))
    assert not hasattr(cache, "bits")
    assert cache.config.cachegen_bits == 3
    assert isinstance(cache, vq.KVCache)
    assert vq.CacheGenKVCache().config == vq.KVCacheConfig()


def test_plain_kv_cache_is_exact():
    rng = np.random.default_rng(0)
    cache = vq.KVCache()
    k = rng.normal(size=(1, 2, 10, 8)).astype(np.float16)
    v = rng.normal(size=(1, 2, 10, 4)).astype(np.float16)
    ko, vo = cache.update_and_fetch(k[:, :, :6], v[:, :, :6])
    ko, vo = cache.update_and_fetch(k[:, :, 6:], v[:, :, 6:])
    np.testing.assert_array_equal(ko, k)
    np.testing.assert_array_equal(vo, v)
    assert cache.offset == 10 and cache.is_trimmable() and cache.nbytes > 0
    assert cache.trim(3) == 3 and cache.offset == 7
    sk, sv = cache.state
    np.testing.assert_array_equal(sk, k[:, :, :7])
    other = vq.KVCache()
    other.state = (sk, sv)
    assert other.offset == 7
    np.testing.assert_array_equal(other.state[1], v[:, :, :7])
    assert not hasattr(cache, "compressed_key_bytes")


def test_cachegen_state_assignment_refused():
    cache = vq.CacheGenKVCache()
    k = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError):
        cache.state = (k, k)


@pytest.mark.parametrize("bad,match", [
    (np.zeros((1, 1, 4, 8), np.float64), "float16 or float32"),
    (np.zeros((1, 1, 4, 8), np.int32), "float16 or float32"),
    (np.zeros((1, 1, 4, 8), ">f4"), "native byte order"),
    (np.zeros((1, 4, 8), np.float32), "4-D"),
    (np.zeros((1, 1, 1, 4, 8), np.float32), "4-D"),
    ("keys", "4-D"),
])
def test_bad_inputs_raise_value_error(bad, match):
    cache = vq.CacheGenKVCache()
    good = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match=match):
        cache.update_and_fetch(bad, good)
    with pytest.raises(ValueError, match=match):
        vq.KVCache().update_and_fetch(good, bad)
    assert cache.offset == 0


def test_nested_lists_refused_as_float64():
    # A nested list becomes float64 in numpy: refused rather than silently narrowed.
    with pytest.raises(ValueError, match="float64"):
        vq.KVCache().update_and_fetch([[[[1.0]]]], [[[[1.0]]]])


def test_layer_group_bits():
    assert vq.layer_group_bits(28, 4) == [4] * 9 + [3] * 10 + [2] * 9
    assert vq.layer_group_bits(24, 4) == [4] * 8 + [3] * 8 + [2] * 8
    assert vq.layer_group_bits(0, 4) == []
    assert vq.layer_group_bits(2, 4) == [4, 3]
    assert vq.layer_group_bits(5, 4, n_groups=2) == [4, 4, 3, 3, 3]  # round(2.5) = 2
    with pytest.raises(ValueError):
        vq.layer_group_bits(8, 4, n_groups=0)


@pytest.mark.parametrize("n_layers", [8, 9, 12])
def test_builder_schedule_non_increasing(n_layers):
    cfg = vq.KVCacheConfig(cachegen_bits=4)
    caches = vq.KVCacheBuilder.for_model([64] * n_layers, cfg)
    assert len(caches) == n_layers
    assert all(type(c) is vq.CacheGenKVCache for c in caches)
    bits = [c.config.cachegen_resolved_bits for c in caches]
    assert bits == vq.layer_group_bits(n_layers, 4)
    assert bits[0] == 4 and bits[-1] < 4
    assert all(a >= b for a, b in zip(bits, bits[1:]))
    assert cfg.cachegen_resolved_bits is None  # the caller's config is not modified


def test_builder_layers_without_attention_and_model_objects():
    class Model:
        layer_head_dims = [64, None, 64, np.int64(64), None]

    caches = vq.KVCacheBuilder.for_model(Model(), vq.KVCacheConfig(cachegen_bits=3))
    kinds = [type(c).__name__ for c in caches]
    assert kinds == ["CacheGenKVCache", "KVCache", "CacheGenKVCache", "CacheGenKVCache", "KVCache"]
    assert [c.config.cachegen_resolved_bits for c in caches if isinstance(c, vq.CacheGenKVCache)] == [3, 2, 2]
    assert len(vq.KVCacheBuilder.for_model([64, 64])) == 2  # default config
    # The caches work.
    k = np.zeros((1, 1, 3, 64), np.float16)
    assert caches[0].update_and_fetch(k, k)[0].shape == (1, 1, 3, 64)


def test_builder_refuses_resolved_bits_preset_and_bad_models():
    with pytest.raises(ValueError, match="resolved_bits"):
        vq.KVCacheBuilder.for_model([64] * 4, vq.KVCacheConfig(cachegen_resolved_bits=3))
    with pytest.raises(ValueError, match="head dim"):
        vq.KVCacheBuilder.for_model([64, 0])
    with pytest.raises(ValueError, match="layer_head_dims"):
        vq.KVCacheBuilder.for_model(["64"])
    with pytest.raises(ValueError, match="layer_head_dims"):
        vq.KVCacheBuilder.for_model(object())


def test_error_classes():
    # InvalidArgument -> ValueError (a subclass of neither RuntimeError nor the reverse).
    with pytest.raises(ValueError) as e:
        vq.CacheGenKVCache().trim(-2)
    assert not isinstance(e.value, RuntimeError)
    assert "must be >= 0" in str(e.value)


def test_save_and_load_prompt_cache_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    k = np.cumsum(rng.normal(0, 0.05, (1, 2, 70, 16)), axis=2).astype(np.float16)
    caches = vq.KVCacheBuilder.for_model([16, 16, None], vq.KVCacheConfig(cachegen_bits=3))
    fetched = [c.update_and_fetch(k, k) for c in caches[:2]]
    path = str(tmp_path / "prompt.vqkv")
    vq.save_prompt_cache(path, caches, {"model": "test"})
    loaded, meta = vq.load_prompt_cache(path, return_metadata=True)
    assert meta == {"model": "test"}
    assert [type(c).__name__ for c in loaded] == ["CacheGenKVCache", "CacheGenKVCache", "KVCache"]
    assert loaded[0].config.cachegen_resolved_bits != loaded[1].config.cachegen_resolved_bits
    for c, saved, (fk, fv) in zip(loaded, caches, fetched):
        assert c.offset == 70 and c.config == saved.config  # resolved bits of the schedule included
        keys, values = c.state
        assert np.array_equal(keys.view(np.uint16), fk.view(np.uint16)) and np.array_equal(values.view(np.uint16), fv.view(np.uint16))
        assert (c.encoded_key_bytes, c.compressed_value_bytes) == (saved.encoded_key_bytes, saved.compressed_value_bytes)
    assert loaded[2].offset == 0
    # The loaded cache keeps working like the saved one.
    k2 = k[:, :, :5]
    a = caches[0].update_and_fetch(k2, k2)[0]
    b = loaded[0].update_and_fetch(k2, k2)[0]
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
    assert vq.load_prompt_cache(path)[0].offset == 70


def test_load_prompt_cache_errors(tmp_path):
    with pytest.raises(OSError):
        vq.load_prompt_cache(str(tmp_path / "missing.vqkv"))
    bad = tmp_path / "bad.vqkv"
    bad.write_bytes(b"not a cache at all")
    with pytest.raises(RuntimeError, match="vqkv"):
        vq.load_prompt_cache(str(bad))


GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "tests" / "golden"


@pytest.mark.parametrize(
    "name, match",
    [
        ("huge_tokens_empty_layers.vqkv", "every layer is empty"),
        ("huge_tokens_no_closed_tokens.vqkv", "need at least"),
    ],
)
def test_load_prompt_cache_refuses_headers_claiming_more_than_the_file_holds(name, match):
    # ~100-byte files claiming 2^32 tokens in chunks of 1: the reader used to walk every
    # (chunk, layer, side) position (holding the GIL for tens of seconds, then returning nothing).
    path = GOLDEN / name
    assert path.stat().st_size < 300
    with pytest.raises(RuntimeError, match=match):
        vq.load_prompt_cache(str(path))


def test_cache_config_is_a_copy_edits_never_reach_the_cache():
    cache = vq.CacheGenKVCache(vq.KVCacheConfig(cachegen_group_size=4))
    cfg = cache.config
    cfg.cachegen_group_size = 0  # invalid: would reach the cache unvalidated through a live handle
    cache.config.cachegen_resolved_bits = 200
    assert cache.config.cachegen_group_size == 4 and cache.config.cachegen_resolved_bits is None
    assert cfg.cachegen_group_size == 0  # the copy itself is an ordinary, editable config
    with pytest.raises(ValueError, match="cachegen_group_size"):
        vq.CacheGenKVCache(cfg)


def test_config_edit_mid_stream_leaves_a_file_that_loads(tmp_path):
    rng = np.random.default_rng(5)
    k = rng.standard_normal((1, 2, 10, 8)).astype(np.float16)
    cache = vq.CacheGenKVCache(vq.KVCacheConfig(cachegen_group_size=4))
    cache.update_and_fetch(k, k)
    cache.config.cachegen_group_size = 3  # once changed the group size of a stream with closed groups
    cache.update_and_fetch(k, k)
    path = str(tmp_path / "edited.vqkv")
    vq.save_prompt_cache(path, [cache])
    (loaded,) = vq.load_prompt_cache(path)
    assert loaded.config == cache.config and loaded.config.cachegen_group_size == 4
    np.testing.assert_array_equal(loaded.state[0], cache.state[0])


def test_huge_dimensions_beside_a_zero_are_refused():
    # numpy allows an empty array whose other dimensions multiply to 2^42; a tensor may not (2^40),
    # so nothing is ever sized by them (this once asked for a histogram per 2^42 channels).
    k = np.lib.stride_tricks.as_strided(np.zeros(1, np.float16), shape=(1, 1 << 21, 0, 1 << 21), strides=(0, 0, 0, 2))
    with pytest.raises(ValueError, match="too large"):
        vq.CacheGenKVCache().update_and_fetch(k, k)


def test_memory_follows_the_data():
    empty = np.zeros((1, 1024, 0, 1024), np.float16)
    cache = vq.CacheGenKVCache()
    cache.update_and_fetch(empty, empty)
    assert cache.nbytes <= 64 * 1024
    one = np.ones((1, 64, 1, 256), np.float16)
    cache = vq.CacheGenKVCache()
    cache.update_and_fetch(one, one)
    assert cache.nbytes <= 4 * 2 * one.nbytes + 64 * 1024


def test_methods_table_lists_every_method_and_its_specs_build():
    rows = vq.methods()
    names = [r["name"] for r in rows]
    for expected in ("fp32", "fp16", "cachegen", "kivi", "q8_0", "q4_0", "q4_1", "fp8", "lmcache", "cachegen_paper", "vq"):
        assert expected in names
    assert len(set(names)) == len(names)
    for r in rows:
        assert r["family"] in ("baseline", "ours", "reference", "peer")
        assert r["usage"].startswith(r["name"])
        # Every key's default is what the canonical text of the bare spec says (where it says it).
        for k in r["keys"]:
            if k["default"] and f"{k['name']}=" in r["canonical_default"]:
                assert f"{k['name']}={k['default']}" in r["canonical_default"], (r["name"], k)
    assert {r["name"] for r in rows if r["family"] == "ours"} == {"vq"}
