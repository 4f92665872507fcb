"""jaxaot: reusable, cached, compiled building blocks for JAX programs."""

from ._bundle import BundleError as BundleError
from ._bundle import export_bundle as export_bundle
from ._bundle import import_bundle as import_bundle
from ._caches import Cache as Cache
from ._caches import DirectoryCache as DirectoryCache
from ._caches import FsspecCache as FsspecCache
from ._caches import MemoryCache as MemoryCache
from ._caches import RedisCache as RedisCache
from ._caches import TieredCache as TieredCache
from ._caches import UnsafeCacheDirError as UnsafeCacheDirError
from ._component import Component as Component
from ._component import component as component
from ._component import wait_for_writes as wait_for_writes
from ._config import default_cache_dir as default_cache_dir
from ._config import get_cache as get_cache
from ._config import set_cache as set_cache
from ._config import using_cache as using_cache
from ._host import HostCopy as HostCopy
from ._host import to_host_async as to_host_async
from ._key import ClosureError as ClosureError
from ._key import ComponentKey as ComponentKey
from ._regional import RegionalFunction as RegionalFunction
from ._regional import jit as jit
from ._stats import CacheInfo as CacheInfo
from ._stats import stats as stats

__version__ = "0.1.0"

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
    "set_cache",
    "stats",
    "to_host_async",
    "using_cache",
    "wait_for_writes",
]
