"""`vq` caches in .vqkv files from Python: make_caches builds them from a checkpoint, and
load_prompt_cache(model=...) rebuilds their transforms from the same model (another is refused)."""
import pathlib

import numpy as np
import pytest
import veloxquant as vq

MODEL = pathlib.Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K.bin"

pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason="needs ../shared/models/stories260K.bin")


def test_vq_caches_round_trip_with_their_model(tmp_path):
    caches = vq.make_caches("vq:bits=2,calib=16,residual=3", str(MODEL))
    rng = np.random.default_rng(4)
    kv = [(rng.standard_normal((1, 4, 40, 8)).astype(np.float32), rng.standard_normal((1, 4, 40, 8)).astype(np.float32))
          for _ in caches]
    fetched = [c.update_and_fetch(k, v) for c, (k, v) in zip(caches, kv)]
    path = str(tmp_path / "vq.vqkv")
    vq.save_prompt_cache(path, caches, {"m": "x"})
    with pytest.raises(RuntimeError, match="fingerprint"):
        vq.load_prompt_cache(path)
    loaded, meta = vq.load_prompt_cache(path, True, model=str(MODEL))
    assert meta == {"m": "x"}
    for c, (k, v) in zip(loaded, fetched):
        assert repr(c) == "<VqKVCache offset=40>"
        k2, v2 = c.update_and_fetch(np.zeros((1, 4, 0, 8), np.float32), np.zeros((1, 4, 0, 8), np.float32))
        assert np.array_equal(k2.view(np.uint32), k.view(np.uint32)) and np.array_equal(v2.view(np.uint32), v.view(np.uint32))
    # More tokens: the loaded caches continue as the saved ones do.
    more = rng.standard_normal((1, 4, 5, 8)).astype(np.float32)
    for a, b in zip(caches, loaded):
        ka, va = a.update_and_fetch(more, more)
        kb, vb = b.update_and_fetch(more, more)
        assert np.array_equal(ka.view(np.uint32), kb.view(np.uint32)) and np.array_equal(va.view(np.uint32), vb.view(np.uint32))


def test_another_model_is_refused(tmp_path):
    caches = vq.make_caches("vq:bits=2,calib=4", str(MODEL))
    x = np.ones((1, 4, 6, 8), np.float32)
    for c in caches:
        c.update_and_fetch(x, x)
    path = str(tmp_path / "vq.vqkv")
    vq.save_prompt_cache(path, caches)
    other = bytearray(MODEL.read_bytes())
    other[28 + 512 * 64 * 4 + 5 * 64 * 4 + 100] ^= 1  # one weight of wq (legacy layout)
    (tmp_path / "other.bin").write_bytes(bytes(other))
    with pytest.raises(RuntimeError, match="fingerprint"):
        vq.load_prompt_cache(path, model=str(tmp_path / "other.bin"))
