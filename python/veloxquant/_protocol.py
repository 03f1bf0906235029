"""mlx_lm's cache protocol on veloxquant's cache classes (installed when the package is imported).

The classes are the C++ extension's (veloxquant._core), so a cache that load_prompt_cache,
make_caches or KVCacheBuilder.for_model returns has all of it. What a host gets:

- ``state`` (get): ``(keys, values)`` up to ``offset``, fresh arrays, as before.
  ``state`` (set): a plain ``KVCache`` takes any ``(keys, values)`` pair (copied). A
  ``CacheGenKVCache`` cannot be rebuilt from dense arrays (the codes and scales are not in them):
  it takes a state read from a ``CacheGenKVCache``, which carries an exact copy of that cache, and
  becomes that cache (configuration, codes, scales, residual, counters); a bare pair is refused
  with ValueError, as is a read state whose arrays were changed since.
- ``meta_state``: ``""`` for a plain cache (as mlx_lm's); for a ``CacheGenKVCache`` its
  configuration as ``"field=value"`` strings. Setting it checks it against the cache, and may
  change the configuration of an empty CacheGenKVCache.
- ``from_state(state, meta_state)`` (class method): a new cache, the state and meta_state set.
- ``size()``, ``empty()``, ``is_trimmable()``, ``trim(n)``, ``nbytes``, and ``_bits`` on a
  ``CacheGenKVCache`` (the layer's bit width, as the reference names it): in the extension.
- ``copy.deepcopy`` / ``copy.copy``: an exact, independent copy. ``pickle``: through the cache's
  ``.vqkv`` bytes (docs/format.md), loaded back bit for bit. Plain KVCache and CacheGenKVCache
  only: other caches (``vq`` layers need their model to load) raise TypeError; use
  save_prompt_cache.
- ``CacheGenKVCache.config`` returns a ``veloxquant.KVCacheConfig`` (a copy, as before).
"""
from __future__ import annotations

import numpy as np

from veloxquant import _core
from veloxquant.cache.base import KVCacheConfig, _CACHEGEN_FIELDS

KVCache = _core.KVCache
CacheGenKVCache = _core.CacheGenKVCache

_core_state = KVCache.state  # the extension's property: dense get, dense set (refused by CacheGen)
_core_config = CacheGenKVCache.config
_COPYABLE = ("KVCache", "CacheGenKVCache")


class CacheGenState(tuple):
    """``(keys, values)`` of a CacheGenKVCache, with an exact copy of the cache it was read from, so
    that assigning it to another CacheGenKVCache's ``state`` rebuilds that cache exactly."""

    def __new__(cls, keys, values, snapshot):
        self = super().__new__(cls, (keys, values))
        self._snapshot = snapshot
        return self

    def __reduce__(self):
        return (CacheGenState, (self[0], self[1], self._snapshot))


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    unsigned = np.dtype(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a.dtype
    return bool(np.array_equal(a.view(unsigned), b.view(unsigned)))


def _get_state(self):
    keys, values = _core_state.fget(self)
    if isinstance(self, CacheGenKVCache):
        return CacheGenState(keys, values, self._clone())
    return (keys, values)


def _set_state(self, state):
    if not isinstance(self, CacheGenKVCache):
        _core_state.fset(self, state)
        return
    snapshot = getattr(state, "_snapshot", None)
    if not isinstance(snapshot, CacheGenKVCache):
        raise ValueError(
            "a CacheGenKVCache cannot be rebuilt from dense keys/values alone (its codes and scales would be lost): "
            "assign a state read from a CacheGenKVCache (it carries them), or copy the cache with copy.deepcopy, "
            "pickle or save_prompt_cache/load_prompt_cache")
    keys, values = _core_state.fget(snapshot)
    if not (_same_bits(state[0], keys) and _same_bits(state[1], values)):
        raise ValueError("this CacheGenKVCache state's arrays were changed after it was read; a CacheGenKVCache "
                         "takes its state only as read (dense arrays cannot rebuild its codes)")
    self._assign(snapshot)


def _meta_of(config) -> tuple:
    return tuple(f"{name}={getattr(config, name)}" for name in _CACHEGEN_FIELDS)


def _config_from_meta(meta) -> KVCacheConfig:
    if isinstance(meta, str) or not all(isinstance(m, str) for m in meta):
        raise ValueError(f"a CacheGenKVCache meta_state is a tuple of 'field=value' strings, got {meta!r}")
    fields = {}
    for item in meta:
        name, sep, text = item.partition("=")
        if not sep or name not in _CACHEGEN_FIELDS or name in fields:
            raise ValueError(f"bad CacheGenKVCache meta_state entry {item!r} (fields: {', '.join(_CACHEGEN_FIELDS)})")
        fields[name] = text
    if set(fields) != set(_CACHEGEN_FIELDS):
        raise ValueError(f"a CacheGenKVCache meta_state names every field of {', '.join(_CACHEGEN_FIELDS)}; got {meta!r}")

    def as_int(name):
        try:
            return int(fields[name])
        except ValueError:
            raise ValueError(f"CacheGenKVCache meta_state: {name} must be an integer, got {fields[name]!r}") from None

    def as_bool(name):
        if fields[name] not in ("True", "False"):
            raise ValueError(f"CacheGenKVCache meta_state: {name} must be True or False, got {fields[name]!r}")
        return fields[name] == "True"

    return KVCacheConfig(cachegen_bits=as_int("cachegen_bits"), cachegen_group_size=as_int("cachegen_group_size"),
                         cachegen_use_delta=as_bool("cachegen_use_delta"), cachegen_per_channel=as_bool("cachegen_per_channel"),
                         cachegen_layer_groups=as_int("cachegen_layer_groups"),
                         cachegen_resolved_bits=None if fields["cachegen_resolved_bits"] == "None" else as_int("cachegen_resolved_bits"),
                         cachegen_flush=fields["cachegen_flush"])


def _get_meta_state(self):
    if isinstance(self, CacheGenKVCache):
        return _meta_of(_core_config.fget(self))
    return ""


def _set_meta_state(self, meta):
    if not isinstance(self, CacheGenKVCache):
        if meta:  # mlx_lm's plain caches take only an empty meta_state
            raise ValueError(f"this cache has no meta_state, but {meta!r} was set")
        return
    wanted = _config_from_meta(meta)
    if wanted == _core_config.fget(self):
        return
    if self.offset != 0:
        raise ValueError(f"meta_state {meta!r} disagrees with this cache's configuration {_get_meta_state(self)!r}, "
                         f"which cannot change while it holds tokens")
    self._reset_config(wanted)


def _from_state(cls, state, meta_state=""):
    """A new cache of this class with `state` and `meta_state` set (mlx_lm's from_state)."""
    if issubclass(cls, CacheGenKVCache):
        obj = cls(_config_from_meta(meta_state)) if meta_state else cls()
    else:
        obj = cls()
    obj.state = state
    obj.meta_state = meta_state
    return obj


def _check_copyable(self, what):
    if self._kind not in _COPYABLE:
        raise TypeError(f"cannot {what} a {self._kind} (only KVCache and CacheGenKVCache can be); "
                        f"save it with save_prompt_cache")


def _deepcopy(self, memo=None):
    _check_copyable(self, "copy")
    return self._clone()


def _reduce(self):
    _check_copyable(self, "pickle")
    return (_from_vqkv, (_core._serialize_caches([self]),))


def _from_vqkv(data: bytes):
    """The cache pickled as the .vqkv bytes `data`."""
    caches = _core._deserialize_caches(data)
    if len(caches) != 1:
        raise ValueError(f"a pickled cache holds exactly one layer, this one {len(caches)}")
    return caches[0]


def _config(self):
    return KVCacheConfig._from_core(_core_config.fget(self))


def install() -> None:
    KVCache.state = property(_get_state, _set_state, doc=_core_state.__doc__)
    KVCache.meta_state = property(_get_meta_state, _set_meta_state,
                                  doc="mlx_lm's meta_state: '' for a plain cache; a CacheGenKVCache's configuration as "
                                      "'field=value' strings.")
    KVCache.from_state = classmethod(_from_state)
    KVCache.__deepcopy__ = _deepcopy
    KVCache.__copy__ = _deepcopy
    KVCache.__reduce__ = _reduce
    CacheGenKVCache.config = property(_config, doc=_core_config.__doc__)


install()
