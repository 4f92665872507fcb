"""Default keys from the traced program: a canonical form of a closed jaxpr.

What a component computes is what JAX traced, not the Python that produced it:
whatever changes the computation (an edited helper, a constant, a nested
config value, a derivative rule) changes the program. :func:`program_parts`
reduces a closed jaxpr to key parts that are the same in every process:

* ``program``: a digest over the equations, with variables numbered by first
  use (no names that vary between runs), input and output types (shapes,
  dtypes, weak types and whatever else the type prints), and parameters,
  nested jaxprs included; no source locations, no memory addresses;
* ``consts``: each constant's type and a digest of its content
  (``f32[3]:<digest>``), in order;
* ``rules``: for each ``custom_jvp``/``custom_vjp``/``custom_vmap`` function
  the program calls, a digest of the jaxpr of its JVP (for ``custom_jvp``), of
  its VJP, forward and backward (for ``custom_vjp``), or of its batching rule
  with every input batched (for ``custom_vmap``): the rules are traced, so a
  rule that changes changes the key. So are the rules those rules call, down
  to a rule already being traced (a rule calling its own function); past
  :data:`_MAX_RULE_DEPTH` levels, by their code. A Python function held in a
  parameter is keyed by its name and its code. A rule that sees which inputs
  are differentiated or batched is marked (:func:`sees_masks`): the
  transformations of its program are keyed by what they compute.

The parts are separate so that :meth:`ComponentKey.explain` can say which of
them changed. The ``program`` part also carries explanation data (a
:class:`~jaxaot._keys._key.Described` string: never a part, so the digest is
the same with or without it): the arguments' paths, each top-level constant's
value as short text, and each top-level equation as ``primitive:digest``
(bounded in number), so that an explanation can name the constant or the
equation that changed.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._jax import (
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    Literal,
    Tracer,
    bind_equation,
    called_callbacks,
    is_callback_equation,
    lowering_rules,
    named_shardings,
    prng_impl,
)
from ._callbacks import callback_text, register_callbacks
from ._closure import ClosureError, code_digest, users_code_digest
from ._key import ComponentKey, Described
from ._sharding import sharded_type, sharding_text, value_text
from ._text import jax_type_text, strip_addresses

__all__ = [
    "arg_names",
    "content_digest",
    "equation_digests",
    "program_digest",
    "program_parts",
    "sees_masks",
]

_RULE_PRIMITIVES = ("custom_jvp_call", "custom_vjp_call", "custom_vmap_call")
#: Where each rule primitive holds its rule (for its name and code).
_RULE_PARAMS = ("jvp_jaxpr_fun", "bwd", "rule")
_COMPONENT_PRIMITIVE = "jaxaot_component"
# Rules calling rules are traced this deep (a third derivative is three levels);
# a rule calling its own function stops at once (see ``_Canonical.rule``).
_MAX_RULE_DEPTH = 6
#: Bounds on the explanation data a program key carries: equations listed, and
#: characters of a constant's value text.
_ABOUT_EQNS = 512
_ABOUT_TEXT = 60


def content_digest(value: Any) -> str:
    """A digest of an array's type and bytes (typed PRNG keys by their key data)."""
    if isinstance(value, Tracer):
        raise TypeError("a traced value has no content")
    dtype = getattr(value, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        impl = str(dtype)
        value = jax.random.key_data(value)
    else:
        impl = ""
    array = np.asarray(value)
    h = hashlib.sha256()
    h.update(f"{impl}|{array.dtype.str}|{array.shape}|".encode())
    h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:32]


def _callable_name(fun: Any) -> str:
    inner = getattr(fun, "f", None)  # a linear_util.WrappedFun
    if inner is not None and callable(inner):
        fun = inner
    module = getattr(fun, "__module__", None) or ""
    qualname = getattr(fun, "__qualname__", None) or type(fun).__qualname__
    return f"{module}.{qualname}"


def _source(fun: Any) -> str:
    """Where ``fun`` (a function, a wrapped function or a jaxpr) was defined, as
    its debug info says (``f_jvp at model.py:12``); ``""`` where it says nothing."""
    return str(getattr(getattr(fun, "debug_info", None), "func_src_info", None) or "")


def _sds(aval: Any, dtype: Any = None) -> jax.ShapeDtypeStruct:
    sharding = aval.sharding if sharded_type(aval) else None  # a sharding the type carries
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype if dtype is None else dtype, sharding=sharding
    )


#: Marks a rule (in a key's ``rules`` part) that sees which of its inputs are
#: differentiated or batched, see :func:`sees_masks`.
MASKED = "[masked]"


def _sees_masks(eqn: Any) -> bool:
    # A batching rule is told which inputs are batched; a rule with symbolic zeros,
    # which tangents are zero (custom_jvp) or which inputs are perturbed and which
    # cotangents are zero (custom_vjp). JAX instantiates them for the others.
    return eqn.primitive.name == "custom_vmap_call" or bool(eqn.params.get("symbolic_zeros"))


def sees_masks(key: ComponentKey) -> bool:
    """Whether the program of ``key`` calls a custom rule that sees which of its
    inputs a transformation differentiates or batches: the rule is traced for its
    key with every input differentiated (or batched), so each transformation of
    the program must be keyed by what it computes (see ``_component._call``)."""
    return any(MASKED in name for name, _ in key.parts.get("rules", ()))


def _rule_jaxpr(eqn: Any) -> Any:
    """The jaxpr of an equation's JVP (custom_jvp), VJP (custom_vjp) or batching rule
    with every input batched (custom_vmap): the program of its rules, traced."""
    in_avals = [v.aval for v in eqn.invars]

    def run(*args: Any) -> list[Any]:
        return bind_equation(eqn, args)

    if eqn.primitive.name == "custom_vmap_call":
        batched = [jax.ShapeDtypeStruct((2, *a.shape), a.dtype) for a in in_avals]
        return jax.make_jaxpr(jax.vmap(run))(*batched)

    primals = [_sds(a) for a in in_avals]
    if eqn.primitive.name == "custom_jvp_call":
        tangents = [_sds(a, a.to_tangent_aval().dtype) for a in in_avals]
        return jax.make_jaxpr(lambda p, t: jax.jvp(run, list(p), list(t)))(primals, tangents)
    cts = [_sds(v.aval, v.aval.to_tangent_aval().dtype) for v in eqn.outvars]

    def forward_backward(p: Sequence[Any], c: Sequence[Any]) -> Any:
        out, pull = jax.vjp(run, *p)
        return out, pull(list(c))

    return jax.make_jaxpr(forward_backward)(primals, cts)


class _Canonical:
    def __init__(self, component: str, rules: bool = True) -> None:
        self.component = component
        # Whether custom rules are traced (a component's key: a rule that changes
        # changes what its derivatives compute) or named by their code only (an
        # executable's program: it runs none of them).
        self.trace_rules = rules
        # An executable's program (``program_digest``), by id: the values of its
        # own trace that its nested jaxprs hold. ``None`` for a component's key,
        # where such a value is a ClosureError.
        self.traced: dict[int, int] | None = None if rules else {}
        # What the digest hashes, item by item (each item, then a NUL byte), hashed
        # once at the end: one update per item costs more than the walk itself.
        self._items: list[str] = []
        self.consts: list[str] = []
        self.rules: list[tuple[str, str]] = []
        self.depth = 0
        # The rules being traced, outermost first (shared with the inner forms).
        self.tracing: list[tuple[str, ...]] = []
        # Callback equations, in the order visited: rebound by index when an
        # executable with host callbacks is loaded (``_jax._callbacks``).
        self.callbacks: list[Any] = []
        # Explanation data (top level only): constants as text, equations as
        # ``primitive:digest`` (the digest over everything the equation emits).
        self.const_texts: list[str] = []
        self.eqns: list[str] = []
        self.eqn_count = 0
        self._nesting = 0
        # Type texts by the type's id (JAX shares a few type objects among all of a
        # program's variables), each with its type, which it keeps alive.
        self._types: dict[int, tuple[Any, str]] = {}

    def type_text(self, aval: Any) -> str:
        known = self._types.get(id(aval))
        if known is None or known[0] is not aval:
            known = self._types[id(aval)] = (
                aval,
                jax_type_text(aval) + _impl_text(aval),
            )
        return known[1]

    def emit(self, *items: str) -> None:
        self._items.extend(items)

    def hexdigest(self, start: int = 0) -> str:
        """The digest of the items emitted (from item ``start`` on)."""
        items = self._items[start:]
        text = "\0".join(items) + "\0" if items else ""
        return hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()

    def const(self, value: Any, where: str) -> str:
        if isinstance(value, Tracer) and self.traced is not None:
            # A value of the program's own trace that a nested jaxpr holds (JAX
            # 0.12 keeps some there): computed from its inputs, named by its type
            # and the order it is met in.
            n = self.traced.setdefault(id(value), len(self.traced))
            return f"traced:{jax_type_text(value.aval)}:{n}"
        if isinstance(value, Tracer):
            raise ClosureError(
                f"jaxaot.component {self.component!r}: the function closes over a traced "
                f"value ({where}, shape {tuple(value.shape)}, dtype {value.dtype}), from a "
                "transformation outside the component. Pass it to the component as an "
                "argument instead."
            )
        return content_digest(value)

    def closed(self, closed: Any, top: bool = False) -> None:
        digests = []
        for i, c in enumerate(closed.consts):
            digest = self.const(c, f"constant {i}")
            digests.append(digest)
            if top:
                self.consts.append(f"{jax_type_text(jax.typeof(c))}:{digest}")
                self.const_texts.append(_value_text(c))
        # The program's own constants are a part of their own (``consts``), so
        # that an explanation can say which one changed; nested ones count here.
        self.emit("closed", str(len(digests)), *([] if top else digests))
        self.jaxpr(closed.jaxpr)

    def jaxpr(self, jaxpr: Any) -> None:
        names: dict[Any, int] = {}

        def var(v: Any) -> str:
            if isinstance(v, Literal):
                return self.literal(v)
            if isinstance(v, DropVar):
                return "_"
            n = names.get(v)
            if n is None:
                n = names[v] = len(names)
            return f"v{n}:{self.type_text(v.aval)}"

        self.emit("jaxpr", *[var(v) for v in jaxpr.constvars], "|", *[var(v) for v in jaxpr.invars])
        top = self._nesting == 0
        self._nesting += 1
        try:
            for eqn in jaxpr.eqns:
                start = len(self._items)
                self.eqn(eqn, var)
                if top:
                    self.eqn_count += 1
                    if len(self.eqns) < _ABOUT_EQNS:
                        literals = ",".join(
                            _value_text(v.val) for v in eqn.invars if isinstance(v, Literal)
                        )
                        item = f"{eqn.primitive.name}:{self.hexdigest(start)[:12]}:{literals}"
                        self.eqns.append(item[: _ABOUT_TEXT * 2])
        finally:
            self._nesting -= 1
        self.emit("out", *[var(v) for v in jaxpr.outvars])
        self.emit("effects", *sorted(strip_addresses(str(e)) for e in jaxpr.effects))

    def literal(self, v: Any) -> str:
        return f"lit({self.value(v.val)}:{self.type_text(v.aval)})"

    def eqn(self, eqn: Any, var: Callable[[Any], str]) -> None:
        ins = [var(v) for v in eqn.invars]
        self.emit("eqn", eqn.primitive.name, *ins)
        for name in sorted(eqn.params):
            self.emit(name)
            if name == "devices" and eqn.primitive.name == _COMPONENT_PRIMITIVE:
                # A component call's device witness: keyed by the devices it names
                # (its own equations' parameters depend on the context it was made in).
                self.emit(*(sharding_text(s) for s in named_shardings(eqn.params[name])))
            else:
                self.param(eqn.params[name])
        self.emit("->", *[var(v) for v in eqn.outvars])
        lowering = _lowering_text(eqn.primitive)
        if lowering:
            self.emit(lowering)
        if is_callback_equation(eqn):
            self.emit(callback_text(eqn))
            self.callbacks.append(eqn)
        if eqn.primitive.name in _RULE_PRIMITIVES and self.trace_rules:
            self.rule(eqn)

    def rule(self, eqn: Any) -> None:
        fun = next((eqn.params[p] for p in _RULE_PARAMS if p in eqn.params), None)
        name = "" if fun is None else _callable_name(fun)
        # Which rule of which function, for which types (in this process: the
        # wrappers' names are JAX's, their debug info names the user's code).
        code = "" if fun is None else code_digest(fun)
        body = next(
            (eqn.params[p] for p in ("call_jaxpr", "call", "fun_jaxpr") if p in eqn.params), None
        )
        this = (
            eqn.primitive.name,
            _source(fun),
            _source(getattr(body, "jaxpr", body)),
            code,
            ",".join(jax_type_text(v.aval) for v in eqn.invars),
        )
        if this in self.tracing:
            # A rule calling its own function, for the same types: that rule is
            # the one being traced, and is keyed by it.
            self.emit("rule-recursion", str(self.tracing.index(this)))
            return
        if self.depth >= _MAX_RULE_DEPTH:
            self.emit("rule-depth", name, code)
            return
        self.depth += 1
        self.tracing.append(this)
        try:
            inner = _Canonical(self.component, self.trace_rules)
            inner.traced = self.traced
            inner.depth = self.depth
            inner.tracing = self.tracing
            try:
                inner.closed(_rule_jaxpr(eqn))
                digest = inner.hexdigest()[:32]
            except ClosureError:
                raise
            except Exception as e:  # a rule that cannot be traced for these types
                digest = f"untraceable:{type(e).__name__}:{strip_addresses(str(e))[:200]}"
                digest += f":{code}"
            kind = eqn.primitive.name + (MASKED if _sees_masks(eqn) else "")
            self.rules.append((f"{kind}:{name}", digest))
            self.rules.extend(inner.rules)
            self.emit("rule", str(len(self.rules)))  # its digest is in ``rules``
        finally:
            self.tracing.pop()
            self.depth -= 1

    def param(self, value: Any) -> None:
        if isinstance(value, ClosedJaxpr):
            self.closed(value)
        elif isinstance(value, Jaxpr):
            self.jaxpr(value)
        elif isinstance(value, list | tuple):
            self.emit(type(value).__name__, str(len(value)))
            for v in value:
                self.param(v)
        else:
            self.emit(self.value(value))

    def value(self, value: Any) -> str:
        if value is None or isinstance(value, bool | int | float | complex | str | bytes):
            return f"{type(value).__name__}:{value!r}"
        if isinstance(value, np.ndarray | np.generic | jax.Array):
            return f"array:{self.const(value, 'a literal')}"
        if isinstance(value, enum.Enum):
            return f"enum:{type(value).__qualname__}.{value.name}"
        if isinstance(value, np.dtype):
            return f"dtype:{value.name}"
        if isinstance(value, type):
            return f"type:{value.__module__}.{value.__qualname__}"
        sharding = value_text(value)
        if sharding is not None:  # a mesh, sharding or spec: axes, devices and spec
            return f"sharding:{sharding}"
        if isinstance(value, ClosedJaxpr | Jaxpr):
            sub = _Canonical(self.component, self.trace_rules)
            sub.traced = self.traced
            sub.depth = self.depth
            sub.param(value)
            self.consts.extend(sub.consts)
            self.rules.extend(sub.rules)
            self.callbacks.extend(sub.callbacks)
            return f"jaxpr:{sub.hexdigest()}"
        if isinstance(value, dict) or (
            hasattr(value, "items") and callable(value.items) and hasattr(value, "keys")
        ):
            items = sorted((str(k), self.value(v)) for k, v in value.items())
            return "dict{" + ",".join(f"{k}={v}" for k, v in items) + "}"
        if isinstance(value, list | tuple | frozenset | set):
            inner = [self.value(v) for v in value]
            if isinstance(value, frozenset | set):
                inner.sort()
            return f"{type(value).__name__}(" + ",".join(inner) + ")"
        if isinstance(value, types.FunctionType | types.MethodType | functools.partial):
            return f"callable:{_callable_name(value)}:{code_digest(value)}"
        key = getattr(value, "key", None)
        if isinstance(key, ComponentKey):  # a component call: by its entry's key
            self.callbacks.extend(called_callbacks(value))  # lowered inline with it
            if self.trace_rules and sees_masks(key):
                # Its rules see what a transformation of this program moves, too.
                self.rules.append((f"component{MASKED}:{key.parts.get('component')}", key.digest))
            return f"component:{key.digest}"
        if callable(value) and hasattr(value, "f") and hasattr(value, "transforms"):
            return f"wrapped:{_callable_name(value)}:{code_digest(value)}"
        text = f"{type(value).__qualname__}:{strip_addresses(repr(value))}"
        # A callable object (a custom_vmap rule, a custom_partitioning callback)
        # prints its function by name at most: its code tells edits apart.
        return f"{text}:{code_digest(value)}" if callable(value) else text


def _impl_text(aval: Any) -> str:
    """The user's code in the PRNG implementation of a typed key type (one made with
    ``jax.extend.random.define_prng_impl``): its functions run only when the
    program is lowered, so the program does not show them; ``""`` for JAX's own."""
    impl = prng_impl(getattr(aval, "dtype", None))
    if impl is None:
        return ""
    digest = users_code_digest([f for f in impl if callable(f) and not isinstance(f, type)])
    return "" if digest is None else f"{{impl {digest}}}"


#: Primitives whose lowering rules hold none of the user's code (JAX's own, or
#: jaxaot's, which may be a checkout), with the rules that showed it. A user's
#: primitive is digested each time: the values its rule reads may change.
_LIBRARY_LOWERINGS: dict[Any, tuple[Any, ...]] = {}


def _lowering_text(prim: Any) -> str:
    """The user's code in the lowering rules of ``prim`` (a primitive of the user's
    own, whose rule the program does not show), or ``""``."""
    rules = lowering_rules(prim)
    known = _LIBRARY_LOWERINGS.get(prim)
    if (
        known is not None
        and len(known) == len(rules)
        and all(a is b for a, b in zip(known, rules, strict=True))
    ):
        return ""
    own = all(getattr(getattr(r, "func", r), "__module__", "").startswith("jaxaot.") for r in rules)
    digest = None if own else users_code_digest(rules)
    if digest is None:
        _LIBRARY_LOWERINGS[prim] = rules
        return ""
    return f"lowering={digest}"


def program_parts(closed: Any, component: str) -> dict[str, Any]:
    """The key parts that name the program ``closed`` computes (see the module docstring).

    Raises :class:`ClosureError` when a constant is a traced value of an outer
    transformation (it has no content to key on)."""
    canon = _Canonical(component)
    canon.closed(closed, top=True)
    register_callbacks(component, canon.hexdigest(), canon.callbacks)
    about = {
        "args": arg_names(closed),
        "consts": canon.const_texts,
        "eqns": canon.eqns,
        "eqn_count": canon.eqn_count,
    }
    return {
        "program": Described(canon.hexdigest(), about),
        "consts": tuple(canon.consts),
        "rules": tuple(canon.rules),
    }


def program_digest(program: Any, what: str) -> str:
    """A digest of what ``program`` (a closed jaxpr, or a jaxpr whose constants are
    inputs) computes, for the key of an executable of it: its canonical form, the
    constants of nested jaxprs by content, host callbacks by their functions,
    component calls by their entries' keys. Custom rules are named by their code,
    not traced: the executable runs none of them. (A jaxpr's text leaves out the
    constants of the jaxprs it nests: two programs differing only there print
    alike.) ``what``: the program's owner, as a :class:`ClosureError` names it."""
    canon = _Canonical(what, rules=False)
    canon.param(program)
    canon.emit("consts", *canon.consts, "rules", *(f"{n}={d}" for n, d in canon.rules))
    return canon.hexdigest()


def equation_digests(eqns: Sequence[Any], what: str) -> list[str | None]:
    """For each of ``eqns`` (equations of one program), a digest of what it
    computes from its inputs, keyed as :func:`program_digest` keys a program:
    its primitive, its parameters and its input and output types. Two equations
    of one digest compute the same outputs from the same inputs. A value of the
    program's own trace that a nested jaxpr holds is named by the order it is
    first met in ``eqns``: the same value, the same name. ``None`` for an equation
    that calls back into the host, itself or in what it calls (its callbacks'
    functions are not compared)."""
    traced: dict[int, int] = {}
    digests: list[str | None] = []
    for eqn in eqns:
        canon = _Canonical(what, rules=False)
        canon.traced = traced

        def var(v: Any, canon: _Canonical = canon) -> str:
            return canon.literal(v) if isinstance(v, Literal) else canon.type_text(v.aval)

        canon.eqn(eqn, var)
        canon.emit("consts", *canon.consts, "rules", *(f"{n}={d}" for n, d in canon.rules))
        digests.append(None if canon.callbacks else canon.hexdigest())
    return digests


def arg_names(closed: Any) -> list[str] | None:
    """The inputs' paths as JAX's debug info names them (``x``, ``params['w']``)."""
    jaxpr = getattr(closed, "jaxpr", closed)
    names = getattr(getattr(jaxpr, "debug_info", None), "arg_names", None)
    invars = getattr(jaxpr, "invars", None)
    if names is None or invars is None or len(names) != len(invars):
        return None
    if not all(isinstance(n, str) and n for n in names):
        return None
    return list(names)


def _value_text(value: Any) -> str:
    """A constant's value as short text (``[1. 2. 3.]``, ``[0. 1. ... 99.]``)."""
    try:
        dtype = getattr(value, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        text = np.array2string(
            np.asarray(value), threshold=6, edgeitems=2, max_line_width=10_000, separator=" "
        )
    except Exception:  # a value NumPy cannot print: the explanation says less
        return "?"
    text = " ".join(text.split())
    return text if len(text) <= _ABOUT_TEXT else text[: _ABOUT_TEXT - 1] + "…"
