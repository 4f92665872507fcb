"""What names a cache entry.

* ``_key``: :class:`ComponentKey`, an entry's complete identity as named parts,
  its digest and explanations of differences;
* ``_text``: values, types and tree structures as stable text;
* ``_sharding``: meshes, partition specs, shardings and placements as text;
* ``_program``: the key parts of a traced program (default keys);
* ``_closure``: what a function sees by name, and a digest of its code;
* ``_context``: the tracing context and ``vmap`` axes as key parts.

This package imports nothing of jaxaot but ``_jax``. Its ``__init__`` stays
empty so that ``_key`` (used by the command line to read entry headers) loads
without JAX.
"""
