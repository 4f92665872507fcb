"""Writes docs/api.md: every public name of jaxaot with its signature and docstring.

Run: ``python docs/make_api.py`` (from the repository root, with jaxaot importable).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import jaxaot

INTRO = """# API reference

Every public name of `jaxaot` (`jaxaot.__all__`), with its signature and
docstring. Generated from the docstrings by `python docs/make_api.py`; do not
edit by hand. The command line is described in [Command line](cli.md) and
by `jaxaot --help`.
"""


class _Raw:
    """An annotation kept as the source text (``from __future__ import annotations``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _raw(annotation: object) -> object:
    return _Raw(annotation) if isinstance(annotation, str) else annotation


def _signature(obj: object) -> str:
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    params = [p.replace(annotation=_raw(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=_raw(sig.return_annotation)))


def _doc(obj: object) -> str:
    """The docstring as preformatted text (its Args/Returns layout survives Markdown)."""
    return "```text\n" + (inspect.getdoc(obj) or "(no docstring)") + "\n```"


def _section(name: str, obj: object) -> list[str]:
    lines: list[str] = []
    if inspect.isclass(obj):
        lines += [f"## `jaxaot.{name}`", "", f"```python\nclass {name}{_signature(obj)}\n```", ""]
        lines += [_doc(obj), ""]
        for attr, member in sorted(vars(obj).items()):
            if attr.startswith("_"):
                continue
            target = member.fget if isinstance(member, property) else member
            if isinstance(target, staticmethod | classmethod):
                target = target.__func__
            if not callable(target) or not getattr(target, "__doc__", None):
                continue
            kind = "property" if isinstance(member, property) else "method"
            sig = "" if kind == "property" else _signature(target)
            lines += [f"### `{name}.{attr}{sig}`" + (" (property)" if kind == "property" else "")]
            lines += ["", _doc(target), ""]
    elif callable(obj):
        lines += [f"## `jaxaot.{name}`", "", f"```python\n{name}{_signature(obj)}\n```", ""]
        lines += [_doc(obj), ""]
    else:
        lines += [f"## `jaxaot.{name}`", "", repr(obj), ""]
    return lines


def main() -> None:
    out = [INTRO, "## Contents", ""]
    out += [f"- [`{n}`](#jaxaot{n.lower()})" for n in sorted(jaxaot.__all__, key=str.lower)]
    out.append("")
    for name in sorted(jaxaot.__all__, key=str.lower):
        out += _section(name, getattr(jaxaot, name))
    path = Path(__file__).resolve().parent / "api.md"
    path.write_text("\n".join(out).rstrip() + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
