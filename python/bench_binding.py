#!/usr/bin/env python3
"""Overhead of the Python binding's update_and_fetch over the same C++ call, for a one-token decode
step (B=1, H=8, D=128, float16, default config: 4 bits, group 32, group_aligned).

Both are timed in this process on caches in the same state: a fresh cache prefilled with
--context tokens, then --n one-token calls with the same chunk, by timeit (Python) and by
veloxquant._bench_cpp_update (a C++ loop over CacheGenKVCache::update_and_fetch, which returns views,
no copy). Best of --repeat runs, interleaved. copy=False is the binding's zero-copy path (read-only
views); copy=True (the default) also copies the whole [B, H, offset, D] cache into new arrays, which
grows with the context.

    PYTHONPATH=build/python /usr/bin/python3 python/bench_binding.py
"""
import argparse
import glob
import os
import sys
import timeit

here = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("VQ_PYTHON_PATH"):
    sys.path[:0] = os.environ["VQ_PYTHON_PATH"].split(os.pathsep)
else:
    found = sorted(glob.glob(os.path.join(here, "..", "build*", "python", "veloxquant", "_core*.so")), key=os.path.getmtime)
    if found:
        sys.path.insert(0, os.path.dirname(os.path.dirname(found[-1])))

import numpy as np  # noqa: E402
import veloxquant as vq  # noqa: E402


def prefilled(context, rng_seed=0, B=1, H=8, D=128, flush="group_aligned"):
    cache = vq.CacheGenKVCache(vq.KVCacheConfig(cachegen_flush=flush))
    if context:
        rng = np.random.default_rng(rng_seed)
        k = rng.normal(size=(B, H, context, D)).astype(np.float16)
        cache.update_and_fetch(k, k)
    return cache


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="0,1024", help="prefilled tokens before the timed decode steps")
    ap.add_argument("--n", type=int, default=200, help="decode calls per timed run")
    ap.add_argument("--repeat", type=int, default=31, help="runs, interleaved; the best of each is reported")
    ap.add_argument("--flush", default="group_aligned")
    a = ap.parse_args()

    rng = np.random.default_rng(1)
    k1 = rng.normal(size=(1, 8, 1, 128)).astype(np.float16)
    v1 = rng.normal(size=(1, 8, 1, 128)).astype(np.float16)
    print(f"one-token decode step, B=1 H=8 D=128 float16, flush={a.flush}, {a.n} calls per run, best of {a.repeat}")
    print(f"{'context':>8} {'C++ us':>8} {'py copy=False':>14} {'overhead':>9} {'py copy=True':>13} {'overhead':>9}")
    for context in [int(c) for c in a.contexts.split(",")]:
        cpp, view, copy = [], [], []
        for _ in range(a.repeat):
            cache = prefilled(context, flush=a.flush)
            cpp.append(vq._bench_cpp_update(cache, k1, v1, a.n))
            cache = prefilled(context, flush=a.flush)
            t = timeit.Timer("f(k, v, copy=False)", globals={"f": cache.update_and_fetch, "k": k1, "v": v1})
            view.append(t.timeit(a.n) / a.n)
            cache = prefilled(context, flush=a.flush)
            t = timeit.Timer("f(k, v)", globals={"f": cache.update_and_fetch, "k": k1, "v": v1})
            copy.append(t.timeit(a.n) / a.n)
        c, w, p = (min(x) * 1e6 for x in (cpp, view, copy))
        print(f"{context:>8} {c:>8.2f} {w:>14.2f} {w - c:>9.2f} {p:>13.2f} {p - c:>9.2f}")


if __name__ == "__main__":
    main()
