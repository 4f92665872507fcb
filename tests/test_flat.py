"""An entry's executable on flat arrays (``jaxaot._component._flat``): transformed
component calls run eagerly (``jax.grad(component)(x)`` outside ``jax.jit``) run
their entries' cached executables, so a second process compiles none of them;
arguments placed otherwise run as JAX runs them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

_EAGER = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np, jaxaot

    @jaxaot.component
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    def plain(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w, x = jnp.ones((4, 4)) * 0.1, jnp.arange(8.0).reshape(2, 4)
    got = [jax.grad(loss)(w, x), *jax.value_and_grad(loss, argnums=1)(w, x)]
    got.append(jax.vmap(loss, in_axes=(None, 0))(w, x[:, None, :]))
    want = [jax.jit(jax.grad(plain))(w, x), *jax.jit(jax.value_and_grad(plain, argnums=1))(w, x)]
    want.append(jax.jit(jax.vmap(plain, in_axes=(None, 0)))(w, x[:, None, :]))
    for g, v in zip(got, want):
        assert g.dtype == v.dtype and g.shape == v.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(v), rtol=1e-6)
    jaxaot.wait_for_writes()
    s = jaxaot.stats()
    print(json.dumps({"report": jaxaot.report(), "compiles": s["compiles"], "loaded": s["loaded"]}))
    """
)


def test_eager_transformed_calls_warm_start_from_the_cache(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    script = tmp_path / "eager.py"
    script.write_text(_EAGER)
    env = {**subprocess_env, "JAXAOT_CACHE": "dir", "JAXAOT_CACHE_DIR": str(tmp_path / "c")}
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["compiles"] > 0, cold
    assert warm["compiles"] == 0 and warm["loaded"] > 0, warm
    assert warm["report"].startswith("jaxaot: warm start"), warm


_PLACED = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np, jaxaot

    comp = jaxaot.component(lambda w, x: jnp.sum(jnp.sin(x @ w)))
    plain = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.sin(x @ w))))
    other = jax.devices()[1]
    w, x = jax.device_put(jnp.ones((3, 3)), other), jax.device_put(jnp.ones((2, 3)), other)
    got, want = jax.grad(comp)(w, x), plain(w, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    print(json.dumps({"got": str(got.devices()), "want": str(want.devices())}))
    """
)


def test_arguments_on_another_device_run_where_jax_runs_them(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    """Committed to a device other than the default one: not the unsharded flat
    executable (compiled for the default device), but JAX's own eager path."""
    script = tmp_path / "placed.py"
    script.write_text(_PLACED)
    env = {
        **subprocess_env,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAXAOT_CACHE": "memory",
    }
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    placed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert placed["got"] == placed["want"] and "1" in placed["got"], placed
