"""What precompiling did: one :class:`ItemResult` per signature, and the run's
:class:`PrecompileReport`. Plain records, with no JAX: the parent process of
``jaxaot precompile`` reads its workers' results into them while the workers,
not it, import JAX and compile."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ItemResult", "PrecompileReport"]


@dataclass
class ItemResult:
    """What precompiling one signature did: ``made`` entries here, ``loaded``
    entries another process made while this one waited, in ``seconds``.
    ``state``: ``"made"`` (something was made here), ``"loaded"`` (only loaded
    after waiting), ``"present"`` (everything was in the cache already) or
    ``"elsewhere"`` (another process precompiled it), ``"plain"`` (nothing to
    cache) or ``"failed"`` (its arguments are wrong for its function). ``note``
    says why a signature leaves nothing in the cache (a ``jaxaot.jit`` function
    that runs under plain ``jax.jit``; a failed one's error)."""

    index: int
    label: str
    state: str
    made: int = 0
    loaded: int = 0
    seconds: float = 0.0
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": round(self.seconds, 3)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ItemResult:
        return cls(
            int(raw["index"]),
            str(raw["label"]),
            str(raw["state"]),
            int(raw.get("made", 0)),
            int(raw.get("loaded", 0)),
            float(raw.get("seconds", 0.0)),
            str(raw.get("note", "")),
        )


@dataclass
class PrecompileReport:
    """What precompiling a manifest did: one :class:`ItemResult` per signature
    precompiled (or skipped: ``"elsewhere"``) in ``seconds``."""

    signatures: int
    items: list[ItemResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def made(self) -> int:
        """Entries made (lowered entries, derived entries, executables)."""
        return sum(r.made for r in self.items)

    @property
    def loaded(self) -> int:
        """Entries loaded once another process had made them."""
        return sum(r.loaded for r in self.items)

    @property
    def present(self) -> int:
        """Signatures whose entries were all in the cache already."""
        here = {r.index for r in self.items if r.state != "elsewhere"}
        made = {r.index for r in self.items if r.state in ("made", "loaded", "failed", "plain")}
        return len(here - made)

    @property
    def plain(self) -> list[ItemResult]:
        """The signatures that run under plain ``jax.jit``: nothing of them is cached
        (each with why, once)."""
        return list({r.index: r for r in self.items if r.state == "plain"}.values())

    @property
    def failed(self) -> list[ItemResult]:
        """The signatures that could not be precompiled, each with its error (once,
        where two processes failed it)."""
        done = {r.index for r in self.items if r.state != "failed"}
        failed = {r.index: r for r in self.items if r.state == "failed" and r.index not in done}
        return list(failed.values())

    @property
    def elsewhere(self) -> int:
        """Signatures another process precompiled (none of them here)."""
        here = {r.index for r in self.items if r.state != "elsewhere"}
        return len({r.index for r in self.items} - here)

    def line(self, target: str = "") -> str:
        """``precompiled N signatures: M entries made, L loaded, P already present, in T s``
        (with ``, K by other processes`` when another process precompiled some, and
        ``, F failed`` when some could not be precompiled, ``, U not cached``
        when some run under plain ``jax.jit``); ``target``: the
        compile target they were made for (``for tpu:v5e:2x2`` after the count)."""
        others = f", {self.elsewhere} by other processes" if self.elsewhere else ""
        failed = f", {len(self.failed)} failed" if self.failed else ""
        if self.plain:
            failed += f", {len(self.plain)} not cached (plain jax.jit)"
        made_for = f" for {target}" if target else ""
        return (
            f"precompiled {self.signatures} signature{'s' if self.signatures != 1 else ''}"
            f"{made_for}: "
            f"{self.made} entr{'ies' if self.made != 1 else 'y'} made, {self.loaded} loaded, "
            f"{self.present} already present{others}{failed}, in {self.seconds:.1f} s"
        )
