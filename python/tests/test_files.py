"""save_prompt_cache / load_prompt_cache and the files they are given: outputs that are not regular
files, links, permissions, FIFOs and directories as inputs, NUL bytes in paths."""
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import veloxquant as vq


def _caches():
    k = np.cumsum(np.random.default_rng(5).normal(0, 0.05, (1, 2, 40, 8)), axis=2).astype(np.float16)
    caches = vq.KVCacheBuilder.for_model([8], vq.KVCacheConfig())
    caches[0].update_and_fetch(k, k)
    return caches


def test_save_refuses_what_is_not_a_regular_file(tmp_path):
    fifo, adir = tmp_path / "fifo", tmp_path / "adir"
    os.mkfifo(fifo)
    adir.mkdir()
    os.symlink("fifo", tmp_path / "link_to_fifo")
    for path, says in [(fifo, "it is a FIFO, not a regular file"), (adir, "it is a directory, not a regular file"),
                       (tmp_path / "link_to_fifo", "is a FIFO, not a regular file")]:
        with pytest.raises(OSError, match=says):
            vq.save_prompt_cache(str(path), _caches())
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and adir.is_dir() and not any(adir.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "fifo", "link_to_fifo"]  # no temporary left


def test_save_through_a_link_keeps_the_link_and_the_mode(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "p.vqkv").write_bytes(b"old")
    os.chmod(store / "p.vqkv", 0o600)
    os.symlink("store/p.vqkv", tmp_path / "p.vqkv")
    vq.save_prompt_cache(str(tmp_path / "p.vqkv"), _caches())
    assert os.path.islink(tmp_path / "p.vqkv")
    assert stat.S_IMODE(os.stat(store / "p.vqkv").st_mode) == 0o600
    assert vq.load_prompt_cache(str(tmp_path / "p.vqkv"))[0].offset == 40
    assert sorted(p.name for p in store.iterdir()) == ["p.vqkv"]


def test_save_to_a_dangling_link_is_refused(tmp_path):
    os.symlink("nowhere.vqkv", tmp_path / "p.vqkv")
    with pytest.raises(OSError, match="symbolic link to a missing file"):
        vq.save_prompt_cache(str(tmp_path / "p.vqkv"), _caches())
    assert not (tmp_path / "nowhere.vqkv").exists()


def test_paths_with_a_nul_byte_are_value_errors(tmp_path):
    # The path used to be cut at the NUL: this wrote (and read) tmp_path / "a".
    cut = str(tmp_path / "a")
    with pytest.raises(ValueError, match="NUL"):
        vq.save_prompt_cache(cut + "\0.vqkv", _caches())
    assert not os.path.exists(cut)
    vq.save_prompt_cache(cut, _caches())
    with pytest.raises(ValueError, match="NUL"):
        vq.load_prompt_cache(cut + "\0.vqkv")


def test_load_refuses_a_directory_and_a_fifo_at_once(tmp_path):
    with pytest.raises(OSError, match="it is a directory, not a regular file"):
        vq.load_prompt_cache(str(tmp_path))
    # In a child process with a time limit: the old reader blocked on a FIFO forever.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = ("import veloxquant as vq, sys\n"
            "try:\n    vq.load_prompt_cache(sys.argv[1])\n"
            "except OSError as e:\n    print('OSError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    assert "OSError:" in r.stdout and "it is a FIFO, not a regular file" in r.stdout, r.stdout
