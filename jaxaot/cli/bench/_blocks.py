"""The benchmark's transformer block on a mesh with explicit axes, where the
shardings are part of the types and JAX refuses what it cannot shard
unambiguously: the same computation as :func:`jaxaot.cli._model.block`, with
the resharding its layout needs written out.

* :func:`gathered_block` (FSDP): gathers each parameter (replicated) before
  the block, as FSDP does; its gradient is split again like the parameter.
* :func:`model_parallel_block` (2-D, Megatron style): ``qkv`` and ``up`` split
  by their columns and ``proj`` and ``down`` by their rows on ``model``; the
  activations stay split over ``data``. The attention heads are gathered
  before they are split apart, and each row-split product is summed over
  ``model`` into a ``data``-split result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

from .._model import Params, _norm, block

__all__ = ["gathered_block", "model_parallel_block"]


def gathered_block(params: Params, x: jax.Array) -> jax.Array:
    """The benchmark block on parameters split on their first axis (FSDP)."""
    return block({name: reshard(p, P()) for name, p in params.items()}, x)


def model_parallel_block(
    params: Params, x: jax.Array, heads: int = 4, causal: bool = True
) -> jax.Array:
    """The benchmark block with its weights split on ``model`` (2-D layout)."""
    batch, seq, width = x.shape
    h = _norm(x, params["ln1"])
    qkv = reshard(h @ params["qkv"], P("data"))
    qkv = qkv.reshape(batch, seq, 3, heads, width // heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(width // heads).astype(x.dtype)
    if causal:
        mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    attn = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(batch, seq, width)
    out = reshard(out, P("data", None, "model"))
    x = x + jnp.matmul(out, params["proj"], out_sharding=P("data"))
    h = _norm(x, params["ln2"])
    up = jax.nn.gelu(h @ params["up"])
    return x + jnp.matmul(up, params["down"], out_sharding=P("data"))
