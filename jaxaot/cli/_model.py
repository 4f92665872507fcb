"""A small pre-norm transformer, shared by ``jaxaot demo`` and ``jaxaot bench``.

Plain JAX (no framework): parameters are dicts of arrays, one dict per block.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, jax.Array]


def init_block(key: jax.Array, width: int) -> Params:
    k = jax.random.split(key, 4)
    scale = width**-0.5
    return {
        "ln1": jnp.ones((width,)),
        "ln2": jnp.ones((width,)),
        "qkv": jax.random.normal(k[0], (width, 3 * width)) * scale,
        "proj": jax.random.normal(k[1], (width, width)) * scale,
        "up": jax.random.normal(k[2], (width, 4 * width)) * scale,
        "down": jax.random.normal(k[3], (4 * width, width)) * (4 * width) ** -0.5,
    }


def _norm(x: jax.Array, gain: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * gain


def block(params: Params, x: jax.Array, heads: int = 4, causal: bool = True) -> jax.Array:
    """One pre-norm transformer block: attention (``heads`` heads), then a GELU MLP (4x)."""
    batch, seq, width = x.shape
    h = _norm(x, params["ln1"])
    qkv = (h @ params["qkv"]).reshape(batch, seq, 3, heads, width // heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(width // heads).astype(x.dtype)
    if causal:
        mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    attn = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(batch, seq, width)
    x = x + out @ params["proj"]
    h = _norm(x, params["ln2"])
    return x + jax.nn.gelu(h @ params["up"]) @ params["down"]


def init_blocks(key: jax.Array, layers: int, width: int) -> list[Params]:
    return [init_block(k, width) for k in jax.random.split(key, layers)]


def init_lm(key: jax.Array, layers: int, width: int, vocab: int, seq: int) -> dict[str, Any]:
    k_embed, k_pos, k_blocks = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k_embed, (vocab, width)) * 0.02,
        "pos": jax.random.normal(k_pos, (seq, width)) * 0.02,
        "blocks": init_blocks(k_blocks, layers, width),
        "ln_f": jnp.ones((width,)),
    }


def lm_logits(params: dict[str, Any], tokens: jax.Array, block_fn: Any = block) -> jax.Array:
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    for p in params["blocks"]:
        x = block_fn(p, x)
    return _norm(x, params["ln_f"]) @ params["embed"].T


def lm_loss(params: dict[str, Any], tokens: jax.Array, block_fn: Any = block) -> jax.Array:
    """Mean next-token cross entropy."""
    logits = lm_logits(params, tokens[:, :-1], block_fn)
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = tokens[:, 1:]
    return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))
