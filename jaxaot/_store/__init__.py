"""Entries and their lookup.

* ``_entry``: the cache entry and its byte format (verification, encoding,
  decoding), with ``_trees`` for tree structures as JSON;
* ``_readwrite``: reading and writing entries in a byte cache, faults as misses;
* ``_executables``: executable entries, loaded and stored (big ones in the background);
* ``_prefetch``: a signature's executables, noted in the cache by the process
  that used them, loaded by the next one while it traces the signature;
* ``_lookup``: :class:`Store`, one component's lookup chain (this process, the
  active cache, the job, another process of the fleet, or made here);
* ``_once``: one maker per entry across a fleet of processes sharing a cache
  (the cache's leases; ``JAXAOT_LEASE_WAIT``, ``JAXAOT_LEASE_TTL``);
* ``_job``: one compile per multi-process job (``jax.distributed``);
* ``_active``: which cache is active (``set_cache``, ``using_cache``, ``JAXAOT_CACHE``);
* ``_bundle``: entries packed into one file.

The entry format's verification (``_entry.check_stored``) is given to the
caches that need it: with each quarantine (``_readwrite.discard``), and to a
tiered cache when it becomes the active cache (``_active``).
"""
