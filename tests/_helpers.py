"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import pytest

import jaxaot
from jaxaot._store import _entry


def make_blob(name: str = "t", payload: bytes = b"payload", tag: Any = 0) -> tuple[str, bytes]:
    """A sound entry (no JAX compilation involved) and its cache key."""
    key = jaxaot.ComponentKey({"component": f"key:{name!r}", "tag": tag})
    entry = _entry.Entry(
        key=key,
        name=name,
        in_avals=(),
        out_avals=(),
        out_tree=jax.tree_util.tree_structure(()),
        arg_names=(),
        result_paths=(),
        stablehlo=payload,
    )
    return key.digest, _entry.encode(entry)


def cold_and_warm(script: Path, source: str, env: dict[str, str], unsaid: str) -> list[Any]:
    """Writes ``source`` to ``script`` and runs it in two fresh processes on one
    cache (``env``'s), a cold one then a warm one: what each printed last, as
    JSON. Neither may fail, nor say ``unsaid`` on its standard error."""
    script.write_text(source)
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert unsaid not in proc.stderr, proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs


# -- a second user, for the trust tests ---------------------------------------------------

OTHER_UID = 65534  # nobody


def need_root() -> None:
    """Skips unless this process may act as another user (only root may)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second user (uid 65534) through setpriv")
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is missing: the trust tests need it", pytrace=False)


def as_other_user(script: str, stdin: bytes = b"") -> None:
    """Runs the shell ``script`` as uid/gid 65534 with no supplementary groups."""
    subprocess.run(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
        + ["sh", "-c", script],
        input=stdin,
        check=True,
        timeout=60,
        capture_output=True,
    )


@contextlib.contextmanager
def traversable_dir() -> Iterator[Path]:
    """A fresh directory that the other user can reach (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="jaxaot-trust-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def forge_entry(header: bytes, payload: bytes = b"") -> bytes:
    """An entry of the current format with a sound (unsigned) checksum around an
    arbitrary header: what anyone who can write an unsigned cache can plant."""
    import hashlib

    body = (
        _entry._PREFIX.pack(_entry.MAGIC, _entry.ENTRY_FORMAT_VERSION, 0, len(header))
        + header
        + payload
    )
    return body + hashlib.sha256(body).digest()
