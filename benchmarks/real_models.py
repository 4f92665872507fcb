"""Regional compilation of models written with real libraries, unannotated.

Each model's train step (``value_and_grad`` of a loss) runs under ``jax.jit`` and
under ``jaxaot.jit`` with no annotation, each contender in a fresh process:

* ``haiku``: a Haiku transformer whose blocks are ``hk.Module``s in a plain loop;
* ``linen``: a Flax linen transformer whose ``__call__`` is wrapped in ``nn.jit``
  around a plain loop of blocks (the pattern of gemma's ``Transformer``);
* ``gemma``: gemma's own ``gm.nn.Transformer`` (tiny, random init), where gemma
  is installed;
* ``diffrax``: a chain of ``diffeqsolve`` calls (Tsit5, PID controller, an
  Equinox vector field) under ``grad``.

It reports, at each depth, the time to the first result in a cold process, the
steady step, and the first result of a warm ``jaxaot.jit`` process (a second
process on the same cache) beside ``jax.jit`` with JAX's persistent cache warm,
and the XLA compiles of each first step (JAX's own compile events; the small
eager programs diffrax runs while it is traced are left out).

    pip install ".[test]"                            # haiku, flax, diffrax, equinox
    python benchmarks/real_models.py                 # L = 4, 16; prints a Markdown table
    python benchmarks/real_models.py --models haiku --layers 4 8 --out results/
    python benchmarks/real_models.py --layers 4 --trials 5   # cold: the median of 5 processes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS = ("haiku", "linen", "gemma", "diffrax")
CONTENDERS = ("jit_cold", "jit_cache_warm", "jaxaot_cold", "jaxaot_warm")
WIDTH, BATCH, SEQ, VOCAB = 64, 4, 32, 128
#: Programs diffrax compiles eagerly while it is traced (under any jit of it).
EAGER = frozenset(["jit(convert_element_type)", "jit(bitwise_or)"])


def _tokens() -> Any:
    import jax

    return jax.random.randint(jax.random.PRNGKey(0), (BATCH, SEQ), 0, VOCAB)


def _xent(logits: Any, tokens: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1))


def haiku_model(layers: int) -> tuple[Any, tuple[Any, ...]]:
    import haiku as hk
    import jax

    class Block(hk.Module):
        def __call__(self, x: Any) -> Any:
            h = hk.LayerNorm(-1, True, True)(x)
            h = hk.MultiHeadAttention(4, WIDTH // 4, w_init=hk.initializers.VarianceScaling())(
                h, h, h
            )
            x = x + h
            h = hk.LayerNorm(-1, True, True)(x)
            return x + hk.Linear(WIDTH)(jax.nn.gelu(hk.Linear(4 * WIDTH)(h)))

    def forward(tokens: Any) -> Any:
        x = hk.Embed(VOCAB, WIDTH)(tokens)
        for _ in range(layers):
            x = Block()(x)
        return hk.Linear(VOCAB)(x)

    model = hk.transform(forward)
    tokens = _tokens()
    params = model.init(jax.random.PRNGKey(1), tokens)

    def loss(params: Any, tokens: Any) -> Any:
        return _xent(model.apply(params, None, tokens), tokens)

    return jax.value_and_grad(loss), (params, tokens)


def linen_model(layers: int) -> tuple[Any, tuple[Any, ...]]:
    import flax.linen as nn
    import jax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            h = nn.LayerNorm()(x)
            x = x + nn.SelfAttention(num_heads=4)(h)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(WIDTH)(jax.nn.gelu(nn.Dense(4 * WIDTH)(h)))

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, tokens: Any) -> Any:
            x = nn.Embed(VOCAB, WIDTH)(tokens)
            for _ in range(layers):
                x = Block()(x)
            return nn.Dense(VOCAB)(x)

    model = nn.jit(Transformer)()
    tokens = _tokens()
    params = model.init(jax.random.PRNGKey(1), tokens)

    def loss(params: Any, tokens: Any) -> Any:
        return _xent(model.apply(params, tokens), tokens)

    return jax.value_and_grad(loss), (params, tokens)


def gemma_model(layers: int) -> tuple[Any, tuple[Any, ...]]:
    import jax
    from gemma import gm
    from gemma.gm.nn import _config, _modules

    config = _config.TransformerConfig(
        num_embed=VOCAB,
        embed_dim=WIDTH,
        hidden_dim=4 * WIDTH,
        num_heads=4,
        head_dim=WIDTH // 4,
        num_kv_heads=1,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        use_qk_norm=True,
        attention_types=(_modules.AttentionType.LOCAL_SLIDING,) * layers,
        query_pre_attn_norm=_config.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
        attn_logits_soft_cap=None,
        sliding_window_size=SEQ // 2,
        transpose_gating_einsum=True,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
        vision_encoder=None,
    )
    model = gm.nn.Transformer(config=config, dtype=jax.numpy.float32)
    tokens = _tokens()
    params = jax.jit(model.init)(jax.random.PRNGKey(1), tokens)

    def loss(params: Any, tokens: Any) -> Any:
        return _xent(model.apply(params, tokens).logits, tokens)

    return jax.value_and_grad(loss), (params, tokens)


def diffrax_model(layers: int) -> tuple[Any, tuple[Any, ...]]:
    import diffrax
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    class Field(eqx.Module):
        w: jax.Array

        def __call__(self, t: Any, y: Any, args: Any) -> Any:
            return jnp.tanh(y @ self.w)

    def solve(field: Any, y: Any) -> Any:
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(field),
            diffrax.Tsit5(),
            0.0,
            0.5,
            0.1,
            y,
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-6),
        )
        return sol.ys[-1]

    def loss(field: Any, y: Any) -> Any:
        for _ in range(layers):
            y = solve(field, y)
        return (y**2).mean()

    w = jax.random.normal(jax.random.PRNGKey(1), (WIDTH, WIDTH)) / WIDTH**0.5
    return jax.value_and_grad(loss), (Field(w), jnp.ones((BATCH, WIDTH)) / 4)


BUILD = {"haiku": haiku_model, "linen": linen_model, "gemma": gemma_model, "diffrax": diffrax_model}


def child(model: str, contender: str, layers: int, repeats: int) -> dict[str, Any]:
    """One contender's first result and steady step, in this (fresh) process."""
    import jax

    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: (
            compiles.append(str(kw.get("fun_name")))
            if event == "/jax/core/compile/backend_compile_duration"
            and kw.get("fun_name") not in EAGER
            else None
        )
    )
    step, args = BUILD[model](layers)
    jax.block_until_ready(args)
    if contender.startswith("jaxaot"):
        import jaxaot

        fn = jaxaot.jit(step)
    else:
        fn = jax.jit(step)
    before = len(compiles)
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    made = len(compiles) - before
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    out: dict[str, Any] = {"first": first, "steady": statistics.median(times), "compiles": made}
    if contender.startswith("jaxaot"):
        import jaxaot

        out["explain"] = fn.explain(*args)
        jaxaot.wait_for_writes()
    return out


def _spawn(model: str, contender: str, layers: int, repeats: int, env: dict[str, str]) -> Any:
    cmd = [sys.executable, __file__, "--child", model, contender, str(layers), str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose first result is the median one (an error if any failed)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    return sorted(runs, key=lambda r: r["first"])[len(runs) // 2]


def measure(model: str, layers: int, repeats: int, trials: int = 1) -> dict[str, Any]:
    """Every contender for one model and depth, each in a fresh process; the cold
    contenders ``trials`` times each, alternating, their median run kept."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        aot = dict(base, JAXAOT_CACHE_DIR=str(Path(tmp) / "jaxaot"))
        xla = dict(
            base,
            JAXAOT_CACHE="off",
            JAX_COMPILATION_CACHE_DIR=str(Path(tmp) / "jax"),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
        )
        cold: dict[str, list[dict[str, Any]]] = {"jit_cold": [], "jaxaot_cold": []}
        for trial in range(trials):
            cold["jit_cold"].append(_spawn(model, "jit_cold", layers, repeats, dict(base)))
            fresh = dict(aot, JAXAOT_CACHE_DIR=str(Path(tmp) / f"jaxaot{trial}"))
            last = trial == trials - 1  # (its cache is the warm contender's)
            cold["jaxaot_cold"].append(
                _spawn(model, "jaxaot_cold", layers, repeats, aot if last else fresh)
            )
        results.update({c: _median_run(runs) for c, runs in cold.items()})
        _spawn(model, "jit_cache_warm", layers, 1, xla)  # fills JAX's cache
        results["jit_cache_warm"] = _spawn(model, "jit_cache_warm", layers, 1, xla)
        results["jaxaot_warm"] = _spawn(model, "jaxaot_warm", layers, 1, aot)
    return results


def _available(model: str) -> bool:
    module = {"haiku": "haiku", "linen": "flax", "gemma": "gemma", "diffrax": "diffrax"}[model]
    import importlib.util

    return importlib.util.find_spec(module) is not None


def table(rows: list[tuple[str, int, dict[str, Any]]]) -> str:
    """The Markdown table of the runs: seconds, and ratios to jax.jit."""
    lines = [
        "| model | L | jax.jit cold: first / step (compiles) | jaxaot.jit cold: first / step (compiles) "
        "| cold ratio | step ratio | warm: jaxaot.jit / jax.jit + JAX cache (jaxaot compiles) |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, layers, r in rows:
        jit, aot, warm, xla = (
            r.get(c, {}) for c in CONTENDERS[:1] + CONTENDERS[2:] + (CONTENDERS[1],)
        )
        if any("error" in x or not x for x in (jit, aot, warm, xla)):
            errors = {c: r[c].get("error") for c in CONTENDERS if "error" in r.get(c, {})}
            lines.append(f"| {model} | {layers} | failed: {errors} | | | | |")
            continue
        lines.append(
            f"| {model} | {layers} | {jit['first']:.2f} s / {jit['steady'] * 1e3:.1f} ms "
            f"({jit['compiles']}) | {aot['first']:.2f} s / {aot['steady'] * 1e3:.1f} ms "
            f"({aot['compiles']}) | {aot['first'] / jit['first']:.2f}x "
            f"| {aot['steady'] / jit['steady']:.2f}x "
            f"| {warm['first']:.2f} s / {xla['first']:.2f} s ({warm['compiles']}) |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        model, contender, layers, repeats = argv[1], argv[2], int(argv[3]), int(argv[4])
        print(json.dumps(child(model, contender, layers, repeats)))
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--layers", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--repeats", type=int, default=20, help="steady-step calls (median)")
    parser.add_argument(
        "--trials",
        type=int,
        default=1,
        help="fresh cold processes per contender (the median first result is kept)",
    )
    parser.add_argument("--out", type=Path, help="a folder for real_models.md and .json")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models:
        if not _available(model):
            print(f"{model}: not installed, skipped", file=sys.stderr)
            continue
        for layers in args.layers:
            print(f"{model} L={layers} ...", file=sys.stderr)
            rows.append((model, layers, measure(model, layers, args.repeats, args.trials)))
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "real_models.md").write_text(text + "\n")
        data = [{"model": m, "layers": n, **r} for m, n, r in rows]
        (args.out / "real_models.json").write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
