"""The module and the C++ CLI (`veloxquant account --json`) agree on the same .npy inputs."""
import json
import subprocess

import numpy as np
import pytest
import veloxquant as vq

from vq_reference import random_walk

KEYS = ["compressed_key_bytes", "compressed_value_bytes", "fixed_width_key_bytes", "fixed_width_value_bytes",
        "fp16_key_bytes", "fp16_value_bytes", "entropy_savings", "assigned_avg_bits", "offset",
        "encoded_key_bytes", "encoded_value_bytes"]

CASES = [
    # (cli flags, config kwargs, chunk, dtype)
    ([], {}, 0, np.float32),
    (["--flush", "per_call", "--chunk", "7"], {"cachegen_flush": "per_call"}, 7, np.float16),
    (["--flush", "group_aligned", "--chunk", "7"], {}, 7, np.float32),
    (["--bits", "3", "--group-size", "16", "--no-delta", "--pooled", "--flush", "per_call"],
     {"cachegen_bits": 3, "cachegen_group_size": 16, "cachegen_use_delta": False, "cachegen_per_channel": False,
      "cachegen_flush": "per_call"}, 0, np.float16),
    (["--bits", "2", "--chunk", "1"], {"cachegen_bits": 2}, 1, np.float32),
]


@pytest.mark.parametrize("flags,kw,chunk,dtype", CASES, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_module_matches_cli_account_json(cli, tmp_path, flags, kw, chunk, dtype):
    k = random_walk((2, 3, 75, 32), seed=30, dtype=dtype)
    v = random_walk((2, 3, 75, 16), seed=31, dtype=dtype)
    kp, vp, rk = tmp_path / "k.npy", tmp_path / "v.npy", tmp_path / "rk.npy"
    np.save(kp, k)
    np.save(vp, v)
    out = subprocess.run([cli, "account", "--keys", str(kp), "--values", str(vp), "--json", "--recon-keys", str(rk)]
                         + flags, check=True, capture_output=True, text=True).stdout
    want = json.loads(out)
    assert sorted(want) == sorted(KEYS)

    cache = vq.CacheGenKVCache(vq.KVCacheConfig(**kw))
    step = chunk or k.shape[2]
    for s in range(0, k.shape[2], step):
        ko, _ = cache.update_and_fetch(k[:, :, s : s + step], v[:, :, s : s + step])
    got = {name: getattr(cache, name) for name in KEYS}
    assert got == want
    recon = np.load(rk)
    assert recon.dtype == ko.dtype and recon.tobytes() == ko.tobytes()


def test_cli_refuses_what_the_module_refuses(cli, tmp_path):
    kp = tmp_path / "k.npy"
    np.save(kp, np.zeros((1, 1, 4, 8), np.float64))
    r = subprocess.run([cli, "account", "--keys", str(kp), "--values", str(kp), "--json"], capture_output=True, text=True)
    assert r.returncode != 0 and "error" in r.stderr
    with pytest.raises(ValueError):
        vq.CacheGenKVCache().update_and_fetch(np.load(kp), np.load(kp))
