"""jaxaot: reusable, cached, compiled building blocks for JAX programs.

The public names load on first use (PEP 562), so ``import jaxaot`` and the
command line's ``jaxaot --version`` do not import JAX; ``jaxaot.component``
(or any other name) imports what it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._versions import check_installed as _check_installed

__version__ = "0.1.0"

_check_installed()  # a JAX outside the supported range: one ImportError, here

#: Public name -> the private module that defines it. A new public name is one
#: more line here (and in ``__all__``).
_NAMES = {
    "BundleError": "._store._bundle",
    "export_bundle": "._store._bundle",
    "import_bundle": "._store._bundle",
    "Cache": "._caches",
    "DirectoryCache": "._caches",
    "FsspecCache": "._caches",
    "MemoryCache": "._caches",
    "RedisCache": "._caches",
    "TieredCache": "._caches",
    "UnsafeCacheDirError": "._caches",
    "Component": "._component",
    "component": "._component",
    "wait_for_writes": "._store._writer",
    "default_cache_dir": "._store._active",
    "get_cache": "._store._active",
    "set_cache": "._store._active",
    "using_cache": "._store._active",
    "HostCopy": "._host",
    "to_host_async": "._host",
    "ClosureError": "._keys._closure",
    "ComponentKey": "._keys._key",
    "RegionalFunction": "._regional",
    "Manifest": "._regional._manifest",
    "manifest": "._regional._manifest",
    "jit": "._regional",
    "CacheInfo": "._stats",
    "stats": "._stats",
    "report": "._stats",
    "target_devices": "._jax._target",
}

if TYPE_CHECKING:
    from ._caches import Cache as Cache
    from ._caches import DirectoryCache as DirectoryCache
    from ._caches import FsspecCache as FsspecCache
    from ._caches import MemoryCache as MemoryCache
    from ._caches import RedisCache as RedisCache
    from ._caches import TieredCache as TieredCache
    from ._caches import UnsafeCacheDirError as UnsafeCacheDirError
    from ._component import Component as Component
    from ._component import component as component
    from ._host import HostCopy as HostCopy
    from ._host import to_host_async as to_host_async
    from ._jax._target import target_devices as target_devices
    from ._keys._closure import ClosureError as ClosureError
    from ._keys._key import ComponentKey as ComponentKey
    from ._regional import RegionalFunction as RegionalFunction
    from ._regional import jit as jit
    from ._regional._manifest import Manifest as Manifest
    from ._regional._manifest import manifest as manifest
    from ._stats import CacheInfo as CacheInfo
    from ._stats import report as report
    from ._stats import stats as stats
    from ._store._active import default_cache_dir as default_cache_dir
    from ._store._active import get_cache as get_cache
    from ._store._active import set_cache as set_cache
    from ._store._active import using_cache as using_cache
    from ._store._bundle import BundleError as BundleError
    from ._store._bundle import export_bundle as export_bundle
    from ._store._bundle import import_bundle as import_bundle
    from ._store._writer import wait_for_writes as wait_for_writes


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if name.startswith("_") and not name.startswith("__"):  # jaxaot._stats and friends
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))


__all__ = [
    "BundleError",
    "Cache",
    "CacheInfo",
    "ClosureError",
    "Component",
    "ComponentKey",
    "DirectoryCache",
    "FsspecCache",
    "HostCopy",
    "Manifest",
    "MemoryCache",
    "RedisCache",
    "RegionalFunction",
    "TieredCache",
    "UnsafeCacheDirError",
    "component",
    "default_cache_dir",
    "export_bundle",
    "get_cache",
    "import_bundle",
    "jit",
    "manifest",
    "report",
    "set_cache",
    "stats",
    "target_devices",
    "to_host_async",
    "using_cache",
    "wait_for_writes",
]
