"""Subprocess worker for the DirectoryCache stress tests (tests/test_directory.py).

Run as ``python tests/_directory_worker.py MODE JSON_ARGS``. Every mode prints
``ready`` once the cache is open; modes that start together then wait for a
line on stdin (the start barrier). Results go to stdout as one JSON line.

Only ``jaxaot._caches._directory`` is loaded (the parent packages are stubbed)
so that a worker starts in a fraction of a second, whatever ``jaxaot/__init__``
imports.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import random
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]


def load_directory_module() -> types.ModuleType:
    for name, sub in (
        ("jaxaot", _REPO / "jaxaot"),
        ("jaxaot._caches", _REPO / "jaxaot" / "_caches"),
    ):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(sub)]
            sys.modules[name] = pkg
    return importlib.import_module("jaxaot._caches._directory")


def make_value(rng: random.Random, size: int, tag: int = 0) -> bytes:
    """A self-verifying value: sha256(body) + body, ``size`` bytes in all (>= 40)."""
    body = tag.to_bytes(8, "big") + rng.randbytes(size - 40)
    return hashlib.sha256(body).digest() + body


def is_valid(value: bytes) -> bool:
    return len(value) >= 40 and hashlib.sha256(value[32:]).digest() == value[:32]


def _ready() -> None:
    sys.stdout.write("ready\n")
    sys.stdout.flush()


def stress(args: dict[str, Any]) -> dict[str, Any]:
    mod = load_directory_module()
    cache = mod.DirectoryCache(args["root"], args["max_bytes"], lock_timeout=60.0)
    rng = random.Random(args["seed"])
    keys: list[str] = args["keys"]
    lo, hi = args["min_size"], args["max_size"]
    counts = {"put": 0, "get": 0, "hit": 0, "delete": 0, "bad": 0}
    errors: list[str] = []
    _ready()
    sys.stdin.readline()  # the barrier: the parent releases every worker at once
    start = time.time()
    for _ in range(args["ops"]):
        key = rng.choice(keys)
        op = rng.random()
        try:
            if op < 0.45:
                size = int(lo * (hi / lo) ** rng.random())  # log-uniform in [lo, hi]
                cache.put(key, make_value(rng, size))
                counts["put"] += 1
            elif op < 0.9:
                got = cache.get(key)
                counts["get"] += 1
                if got is not None:
                    counts["hit"] += 1
                    if not is_valid(got):
                        counts["bad"] += 1
            else:
                cache.delete(key)
                counts["delete"] += 1
        except BaseException:
            errors.append(traceback.format_exc())
    end = time.time()
    return {"pid": os.getpid(), "start": start, "end": end, "counts": counts, "errors": errors}


def writer(args: dict[str, Any]) -> None:
    """Deletes and re-puts one key for ever, with new values; the parent SIGKILLs it."""
    mod = load_directory_module()
    cache = mod.DirectoryCache(args["root"], args["max_bytes"], lock_timeout=60.0)
    rng = random.Random(args["seed"])
    value = make_value(rng, args["size"], tag=1)
    _ready()
    i = 1
    while True:
        cache.delete(args["key"])
        cache.put(args["key"], value)
        i += 1
        # A new value each round (the tag makes it distinct; the body need not change).
        body = i.to_bytes(8, "big") + value[40:]
        value = hashlib.sha256(body).digest() + body


def evictor(args: dict[str, Any]) -> dict[str, Any]:
    """Puts and deletes until the stop file appears, so entries are evicted constantly."""
    mod = load_directory_module()
    cache = mod.DirectoryCache(args["root"], args["max_bytes"], lock_timeout=60.0)
    rng = random.Random(args["seed"])
    keys: list[str] = args["keys"]
    stop = args["stop"]
    values = [make_value(rng, args["size"], tag=i) for i in range(8)]
    _ready()
    puts = deletes = 0
    errors: list[str] = []
    while not os.path.exists(stop):
        key = rng.choice(keys)
        try:
            if rng.random() < 0.2:
                cache.delete(key)
                deletes += 1
            else:
                cache.put(key, rng.choice(values))
                puts += 1
        except BaseException:
            errors.append(traceback.format_exc())
    st = cache.stats()
    return {"puts": puts, "deletes": deletes, "evictions": st["evictions"], "errors": errors}


def holdlock(args: dict[str, Any]) -> None:
    """Takes the writers' lock and sleeps; the parent SIGKILLs it."""
    mod = load_directory_module()
    cache = mod.DirectoryCache(args["root"])
    cache._filelock.acquire()
    sys.stdout.write("locked\n")
    sys.stdout.flush()
    time.sleep(3600)


def main() -> None:
    mode, raw = sys.argv[1], sys.argv[2]
    args = json.loads(raw)
    if mode == "stress":
        result = stress(args)
    elif mode == "evictor":
        result = evictor(args)
    elif mode == "writer":
        writer(args)
        return
    elif mode == "holdlock":
        holdlock(args)
        return
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
