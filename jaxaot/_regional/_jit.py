"""``jaxaot.jit``: regional compilation of programs made of components.

``jax.jit`` inlines every component call, so XLA compiles the whole unrolled program.
``jaxaot.jit`` traces the program the same way, then cuts its jaxpr at the component
calls (``_planner``, ``_split``): each call runs its component's own executable,
compiled once per entry, and the equations between calls form glue programs, compiled
once per distinct program (``_programs``). Which form a program runs in, split or one
program with its repeated layers as loops (``_whole``), is decided from the program
when its plan is made (``_plan``). A program with nothing to split is served whole,
as one cached region; one that cannot be split runs under plain ``jax.jit``. Either
way the result is the one ``jax.jit`` would give.

Donation, sharded programs (regions compiled for their inputs' shardings, in program
order), multi-process jobs (each process decides alike): docs/regional.md, sharding.md.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .. import _stats
from .._component._arguments import Arguments, note_module_flags, unfit_value
from .._component._rules import naming
from .._component._types import ARRAY_SCALARS
from .._env import SettingError
from .._jax import (
    ArrayImpl,
    PRNGKeyArray,
    Tracer,
    api_boundary,
    cpp_dispatcher,
    fastpath_miss,
    jax_explains_misses,
    jit_disabled,
    nan_found,
    refuse_call,
    trace_context,
    trace_state_clean,
    under_staging,
)
from .._store._active import explain_misses
from ._named import check_blocks
from ._placement import (
    UNSET,
    MeshContext,
    check_shardings,
    input_targets,
    place_inputs,
    reshard,
)
from ._plan import WHOLE as WHOLE_MODE
from ._plan import Plan, PlanFailed, agreed, refuse_unsplit
from ._planner import PlanSpec, build_plan, describe
from ._signatures import AVAL, SHARDING, loading_ahead, plan_signature, say_new_signature
from ._tracing import check_options, entering

__all__ = ["RegionalFunction", "jit"]

logger = logging.getLogger("jaxaot")
_IN_A_TRACE = "called inside another trace (jax.jit, grad, vmap): an inner jax.jit of its program"
_EAGER = (
    "jaxaot.jit {0}: called under jax.grad, jax.vmap or another transformation outside "
    "any jit, it runs as jax.jit would: JAX compiles the transformed program in every "
    "process, and jaxaot caches none of it. Put the transformation inside to cache it: "
    "jaxaot.jit(jax.grad({0})), jaxaot.jit(jax.vmap({0}))"
)
# Concrete arrays (typed PRNG keys included): no tracer, a type and sharding each.
_ARRAY_TYPES = {ArrayImpl, PRNGKeyArray}
_NOT_LOOKED_UP = object()
# Inputs that are arrays without asking jax.typeof.
_LEAF_TYPES = (jax.Array, np.ndarray, Tracer, *ARRAY_SCALARS)


class RegionalFunction:
    """A function compiled region by region; see :func:`jit`."""

    def __init__(
        self,
        fun: Callable[..., Any],
        *,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (),
        donate_argnames: str | Sequence[str] = (),
        whole_program: bool = True,
        in_shardings: Any = UNSET,
        out_shardings: Any = UNSET,
        auto_regions: bool = True,
        blocks: Any = (),
        inline: bool = False,
        keep_unused: bool = False,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        self.__wrapped__ = fun
        name = getattr(fun, "__name__", "function")
        check_options(name, whole_program, auto_regions, keep_unused, compiler_options)
        # Static arguments completed from each other through the signature, as
        # jax.jit completes them (it does not when given both, as below).
        self._arguments = arguments = Arguments(
            name, fun, static_argnums, static_argnames, donate_argnums, kind="jaxaot.jit"
        )
        self._donate_argnums, self._donate_argnames = self._arguments.donated(donate_argnames)
        donates = bool(self._donate_argnums or self._donate_argnames)
        self._arguments_plain = self._arguments.simple and not donates
        options: dict[str, Any] = {
            "static_argnums": arguments.static_argnums,
            "static_argnames": arguments.static_argnames,
            "donate_argnums": self._donate_argnums,
        }
        if self._donate_argnames:
            options["donate_argnames"] = self._donate_argnames
        if inline:  # (only inside another trace, where it is an inner jax.jit)
            options["inline"] = True
        for what, shardings in (("in_shardings", in_shardings), ("out_shardings", out_shardings)):
            if shardings is not UNSET:
                check_shardings(what, shardings)
                options[what] = shardings
        self._in_shardings = in_shardings
        self._in_targets: dict[Any, tuple[Any, ...]] = {}
        try:
            self._jitted = jax.jit(fun, **options)
        except (TypeError, ValueError) as e:  # jax.jit's, of static_argnames...
            raise naming(e, name, "jaxaot.jit") from None
        self._plans: dict[Any, Plan | None] = {}

        entered = entering(name, fun)

        def tracer() -> Any:  # a jax.jit to trace plans with (a trace cache of its own)
            wrapped = functools.wraps(fun)(lambda *args, **kwargs: entered(*args, **kwargs))
            return jax.jit(wrapped, **options)

        self._spec = PlanSpec(
            name=name,
            retracer=tracer,
            whole_program=bool(whole_program),
            out_shardings=out_shardings,
            auto_regions=bool(auto_regions),
            blocks=check_blocks(blocks),
            program=fun,
        )
        # Calls of plain arguments whose plan runs its whole-program form go through
        # JAX's C++ dispatcher straight to that executable (``_dispatch_miss``),
        # static arguments keyed by it, donated inputs donated by the executable,
        # as under jax.jit's C++ path; not with placements.
        self._simple = (
            all(i >= 0 for i in self._arguments.static_argnums)
            and in_shardings is UNSET
            and out_shardings is UNSET
        )
        self._dispatch: Callable[..., Any] | None = None
        # Whether calls try the C++ dispatcher first: only once a plan runs its
        # whole program (the dispatcher has nothing else to offer, and each of
        # its misses adds to a call's time), until the dispatcher is reset.
        self._hot = False
        # The last call's signature, in parts, and its plan (see ``_lookup``).
        self._last: tuple[Any, ...] | None = None
        self._lock = threading.Lock()
        self.__name__ = name
        self.__doc__ = getattr(fun, "__doc__", None)
        self._reset_dispatch()

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # A method decorated with jaxaot.jit binds its instance, as under jax.jit
        # (the instance is then the first argument: a pytree, or static).
        if obj is None:
            return self
        return functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"<jaxaot.jit {self.__name__}>"

    def _dynamic(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], values: bool = True
    ) -> tuple[list[Any], Any, tuple[Any, ...], list[int]]:
        """The flat dynamic inputs, their tree, the static values (by position or
        name) and which inputs are donated.

        Raises:
          ValueError: a static value is not hashable (``jax.jit``'s error, naming
            the argument).
          TypeError: an input is not an array, naming its path.
        """
        if self._arguments_plain:
            leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
            if not set(map(type, leaves)) <= _ARRAY_TYPES:
                self._check_leaves(leaves, args, kwargs, values)
            return leaves, treedef, (), []
        arguments = self._arguments
        n = len(args)
        static_pos = arguments.static_positions(n)
        static_names = arguments.static_argnames
        donate_pos = {i % n for i in self._donate_argnums if -n <= i < n} if n else set()
        dyn_args: list[Any] = []
        statics: list[tuple[Any, Any]] = []
        donated_flags: list[bool] = []
        for i, a in enumerate(args):
            if i in static_pos:
                statics.append((i, a))
            else:
                dyn_args.append(a)
                donated_flags.append(i in donate_pos)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_names}
        statics += [(k, v) for k, v in sorted(kwargs.items()) if k in static_names]
        try:
            hash(tuple(statics))
        except Exception:
            arguments.check_statics(args, kwargs)  # names the argument
            raise
        leaves, treedef = jax.tree_util.tree_flatten((tuple(dyn_args), dyn_kwargs))
        if not set(map(type, leaves)) <= _ARRAY_TYPES:
            self._check_leaves(leaves, tuple(dyn_args), dyn_kwargs, values)
        donated_leaves: list[int] = []
        offset = 0
        # (Flattened: positional arguments, then keyword ones by name, donated by name.)
        named = [(dyn_kwargs[k], k in self._donate_argnames) for k in sorted(dyn_kwargs)]
        for a, donated in [*zip(dyn_args, donated_flags, strict=True), *named]:
            count = len(jax.tree_util.tree_leaves(a))
            if donated:
                donated_leaves.extend(range(offset, offset + count))
            offset += count
        return leaves, treedef, tuple(statics), donated_leaves

    def _check_leaves(
        self,
        leaves: list[Any],
        dyn_args: tuple[Any, ...],
        dyn_kwargs: dict[str, Any],
        values: bool = True,
    ) -> None:
        """Raises the error that names the path of the first input JAX takes for no
        array (what ``jax.jit`` would refuse), as components word it; with
        ``values`` (a call, not ``precompile`` or ``explain``), a
        ``jax.ShapeDtypeStruct`` too."""
        for i, leaf in enumerate(leaves):
            if type(leaf) is int or type(leaf) is np.ndarray:  # of a type JAX has?
                if unfit_value(self._arguments.who, "", leaf) is not None:
                    raise self._arguments.leaf_error(dyn_args, dyn_kwargs, i) from None
                continue
            if isinstance(leaf, _LEAF_TYPES):
                continue
            try:
                jax.typeof(leaf)
                if values and isinstance(leaf, jax.ShapeDtypeStruct):  # a type, not a value
                    raise TypeError
            except TypeError:
                raise self._arguments.leaf_error(dyn_args, dyn_kwargs, i) from None

    def _placed(self, leaves: list[Any], treedef: Any) -> list[Any] | None:
        """The leaves placed as ``in_shardings`` says (``place_inputs``)."""
        targets = self._in_targets.get(treedef)
        if targets is None:
            dyn_args, _ = jax.tree_util.tree_unflatten(treedef, leaves)
            targets = input_targets(self._in_shardings, dyn_args, len(leaves))
            self._in_targets[treedef] = targets
        return place_inputs(leaves, targets)

    def _reset_dispatch(self) -> None:
        """A fresh C++ dispatcher: it knows no executable (calls skip it until a
        plan runs its whole program)."""
        self._hot = False
        arguments = self._arguments
        self._dispatch = (
            cpp_dispatcher(
                self.__name__,
                self._dispatch_miss,
                arguments.static_argnums,
                arguments.static_argnames,
                self.__wrapped__,
            )
            if self._simple
            else None
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            dispatch = self._dispatch
            if dispatch is not None and self._hot and trace_state_clean():
                # Hot path: a signature seen before whose plan runs the whole program
                # runs in C++; every other call comes back to ``_dispatch_miss``.
                return dispatch(*args, **kwargs)
            if jit_disabled():  # as jax.jit does: the function runs as plain Python
                return self.__wrapped__(*args, **kwargs)
            return self._call_slow(args, kwargs, *self._dynamic(args, kwargs))
        except Exception as error:
            if not nan_found(error):
                if isinstance(error, ValueError):  # (the C++ path's, for an unhashable
                    self._dynamic(args, kwargs)  # static: named as the Python path does)
                note_module_flags(error, f"jaxaot.jit {self.__name__!r}", args, kwargs)
                raise
        # A NaN under jax_debug_nans: jax.jit of the function finds where, op by op.
        return self._jitted(*args, **kwargs)

    # Errors are reported as jax.jit's are: without JAX's frames, nor jaxaot's.
    __call__ = api_boundary(__call__)  # type: ignore[method-assign]

    def _plainly(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call under plain ``jax.jit`` (its compiles count in ``stats()``)."""
        with _stats.eager():
            return self._jitted(*args, **kwargs)

    def _dispatch_miss(self, *args: Any, **kwargs: Any) -> tuple[Any, Any, bool]:
        """A call the C++ dispatcher has no fast path for. It gets one (the
        whole-program executable, taking the call's argument tree) when this
        call's plan, found as the Python path finds it, runs the whole program:
        the dispatcher's signature (tree, types with weak types, shardings,
        committedness, configuration) then stands for this plan's. Otherwise the
        call runs the Python path, and the next one with its signature comes back
        here. A plan that leaves the whole program resets the dispatcher."""
        refuse_call(f"jaxaot.jit {self.__name__}", "RegionalFunction.precompile")
        parts = self._dynamic(args, kwargs)
        leaves, treedef, statics, donated = parts
        found: Plan | None | object = _NOT_LOOKED_UP
        if trace_state_clean() and set(map(type, leaves)) <= _ARRAY_TYPES and MeshContext().empty:
            found = plan = self._lookup(args, kwargs, leaves, treedef, statics, donated, True)
            if plan is not None and plan.mode is WHOLE_MODE:
                exe = plan.structured(treedef)
                if exe is not None:
                    # (It takes the dynamic arguments: the dispatcher keys the static ones.)
                    dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
                    return fastpath_miss(exe, dyn_args, dyn_kwargs)  # type: ignore[no-any-return]
        # No fast path for this signature yet: forgotten (True), for a later call to give.
        return self._call_slow(args, kwargs, *parts, plan=found), None, True

    def _call_slow(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        treedef: Any,
        statics: tuple[Any, ...],
        donated: list[int],
        plan: Plan | None | object = _NOT_LOOKED_UP,
    ) -> Any:
        """A call on the Python path; ``plan``: its plan, where the dispatcher's
        miss has looked it up already (the same leaves, plain arrays)."""
        if plan is _NOT_LOOKED_UP:
            arrays = set(map(type, leaves)) <= _ARRAY_TYPES  # so no tracer among them
            if not trace_state_clean() or (
                not arrays and any(isinstance(x, Tracer) for x in leaves)
            ):
                if under_staging():
                    self._spec.say(_IN_A_TRACE)  # cached with the program staging it
                    return self._jitted(*args, **kwargs)  # traced into the program around it
                # (Once per function: its own record of what it said.)
                _stats.warn_once("eager", _EAGER.format(self.__name__), self._spec.said)
                return self._plainly(args, kwargs)  # transformed eagerly: JAX compiles it
            refuse_call(f"jaxaot.jit {self.__name__}", "RegionalFunction.precompile")
            if self._in_shardings is not UNSET:
                try:
                    placed = self._placed(leaves, treedef)
                except (TypeError, ValueError):  # jax.jit says what is wrong with them
                    placed = None
                if placed is None:
                    return self._plainly(args, kwargs)
                leaves = placed
                arrays = set(map(type, leaves)) <= _ARRAY_TYPES
            plan = self._lookup(args, kwargs, leaves, treedef, statics, donated, arrays)
        else:
            arrays = True
        if plan is None:
            return self._plainly(args, kwargs)
        assert isinstance(plan, Plan)
        if (
            not self._hot
            and plan.mode is WHOLE_MODE
            and self._dispatch is not None
            and arrays
            and not (plan.consts or plan.whole_calls_back)
            and MeshContext().empty
        ):
            # The dispatcher can give this signature a fast path: from now on calls
            # try it first; the executable it will call starts loading.
            self._hot = True
            plan.structured(treedef)
        try:
            out, failed = plan(leaves), None
        except PlanFailed as e:  # nothing donated yet: jax.jit gives the result
            failed = e
        if failed is not None:
            sig = plan_signature(leaves, treedef, statics, arrays)
            # Out of the except: where jax.jit refuses too, its error alone is raised.
            self._give_up(sig, failed)
            result = self._plainly(args, kwargs)
            self._say_unsplit(failed)
            return result
        if plan.out_shardings is not None:
            out = reshard(out, plan.out_shardings)
        return jax.tree_util.tree_unflatten(plan.out_tree, out)

    def _lookup(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        treedef: Any,
        statics: tuple[Any, ...],
        donated: list[int],
        arrays: bool,
    ) -> Plan | None:
        """The plan for these leaves (made on the first call of its signature). A step
        loop calls with the same signature every time: for plain arrays, the last call's
        signature is compared part by part (each part's elements are mostly the very
        objects of the last call, which compare at once), before the full signature is
        built and hashed."""
        if arrays:
            shardings: tuple[Any, ...] = tuple(map(SHARDING, leaves))
            types = tuple(map(AVAL, leaves))
            mesh = (jax.sharding.get_abstract_mesh(), jax.sharding.get_mesh())
            context = trace_context()
            last = self._last
            if (
                last is not None
                and last[0] == treedef
                and last[1] == types
                and last[2] == shardings
                and last[3] == mesh
                and last[4] == statics
                and last[5] == context
            ):
                return last[6]  # type: ignore[no-any-return]
        sig = plan_signature(leaves, treedef, statics, arrays)
        plan = self._plans.get(sig, False)
        if plan is False:
            with self._lock:
                plan = self._plans.get(sig, False)
                if plan is False:
                    if self._plans and (explain_misses() or jax_explains_misses()):
                        say_new_signature(
                            self.__name__,
                            self._arguments,
                            self._last,
                            args,
                            leaves,
                            treedef,
                            statics,
                            arrays,
                        )
                    plan = self._plan(args, kwargs, leaves, treedef, statics, donated)
                    plan = agreed(self.__name__, plan)
                    self._plans[sig] = plan
        if arrays:
            self._last = (treedef, types, shardings, mesh, statics, context, plan)
        return plan  # type: ignore[return-value]

    def _give_up(self, sig: Any, error: Exception, for_good: bool = True) -> None:
        """This signature runs under jax.jit from now on (said by the caller once
        jax.jit has taken the arguments: where it refuses them, the error is theirs);
        not ``for_good``: its plan is forgotten, and made again by the next call."""
        then = "using jax.jit" if for_good else "planned again by the next call"
        logger.debug("jaxaot.jit %s: not split (%s); %s", self.__name__, error, then)
        with self._lock:
            if for_good:
                self._plans[sig] = None
            else:
                self._plans.pop(sig, None)
            self._last = None
            self._reset_dispatch()

    def _looked_up(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call's signature and ``_dynamic``'s parts, inputs placed by ``in_shardings``
        (``None``: an input is committed elsewhere)."""
        leaves, treedef, statics, donated = self._dynamic(args, kwargs, values=False)
        if self._in_shardings is not UNSET:
            placed = self._placed(leaves, treedef)
            if placed is None:
                return None
            leaves = placed
        sig = plan_signature(leaves, treedef, statics, set(map(type, leaves)) <= _ARRAY_TYPES)
        return sig, (leaves, treedef, statics, donated)

    # JAX's stages of the whole program, as jax.jit makes them (a call's plan is cut from it).

    # (Errors are reported as jax.jit's are: without JAX's frames, nor jaxaot's.)
    @api_boundary
    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """JAX's ``Traced`` stage of the whole program (``jax.jit(f).trace``)."""
        return self._jitted.trace(*args, **kwargs)

    @api_boundary
    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """JAX's ``Lowered`` stage of the whole program (``jax.jit(f).lower``);
        its ``compile()`` is JAX's, uncached: calls and ``precompile`` use the cache."""
        return self._jitted.lower(*args, **kwargs)

    @api_boundary
    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The results' ``ShapeDtypeStruct``s, as ``jax.eval_shape`` gives them."""
        return jax.eval_shape(self._jitted, *args, **kwargs)

    @api_boundary
    def precompile(self, *args: Any, **kwargs: Any) -> None:
        """Traces, splits and loads or compiles every executable for this signature,
        without running anything; returns when all are ready.

        Raises:
          Exception: what ``jax.jit`` of the function raises for these arguments
            (a call would raise it too): the program cannot be traced with them.
        """
        looked = self._looked_up(args, kwargs)
        if looked is None:
            # A leaf placed other than in_shardings says: jax.jit's error says how.
            self._jitted.lower(*args, **kwargs)
            return
        sig, parts = looked
        with self._lock:
            if sig not in self._plans:
                self._plans[sig] = agreed(self.__name__, self._plan(args, kwargs, *parts))
            plan = self._plans[sig]
        failed: PlanFailed | None = None
        if plan is not None:
            try:
                plan.wait()
            except PlanFailed as e:
                if isinstance(e.__cause__, jax.errors.JaxRuntimeError):
                    # XLA failed at run time (out of memory while autotuning): this
                    # precompile's failure, not the program's; it is planned again.
                    self._give_up(sig, e, for_good=False)
                    raise e.__cause__ from None
                self._give_up(sig, e)
                plan, failed = None, e
        if plan is None:
            # Not split: a call runs it under jax.jit. Where that cannot lower it either
            # (devices that do not fit), the arguments are wrong: said now, not deployed.
            self._jitted.lower(*args, **kwargs)
            if failed is not None:
                refuse_unsplit(self.__name__, failed)  # (nothing made for a compile target)
                self._say_unsplit(failed)

    @api_boundary
    def explain(self, *args: Any, **kwargs: Any) -> str:
        """What ``jaxaot.jit`` makes of a call with these arguments, without running
        or compiling anything (it traces and cuts the program, as a call would):
        per component and block found, how many calls of each entry run as
        regions; the glue programs; the blocks left in their glue; the components
        it cannot reach (under ``lax.scan``); or that the program is served whole,
        and why; and whether it runs as one program, its layers as loops. A call
        that would fail raises its error."""
        looked = self._looked_up(args, kwargs)
        if looked is None:
            return f"jaxaot.jit {self.__name__}: jax.jit (an input is committed elsewhere)"
        sig, (leaves, _, _, donated) = looked
        with self._lock:
            plan = self._plans.get(sig, _NOT_LOOKED_UP)
        head = f"jaxaot.jit {self.__name__}"
        if plan is None:
            self._raise_own_error(args, kwargs)
            return f"{head}: jax.jit (not split; DEBUG logs say why)"
        if isinstance(plan, Plan):
            summary, why = plan.summary, plan.served_whole
        else:
            try:
                described = describe(self._spec, args, kwargs, donated, leaves)
            except SettingError:
                raise
            except Exception as e:  # a call would fall back to jax.jit, or fail
                self._raise_own_error(args, kwargs)
                return f"{head}: jax.jit (not split: {type(e).__name__}: {e})"
            if described is None:
                return f"{head}: jax.jit (nothing to compile)"
            summary, why = described
        if why is not None:
            # A program served whole: its reason, then why its calls are not blocks.
            return "\n".join([f"{head}: one program, cached whole ({why})", *summary.splitlines()])
        return f"{head}: split into\n{summary}"

    def _raise_own_error(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raises the error the program itself gives these arguments (a shape, a
        missing argument), as a call raises it; returns where it traces."""
        try:
            self._jitted.trace(*args, **kwargs)
        except Exception as own:
            raise own from None

    def _plan(self, args: tuple[Any, ...], kwargs: dict[str, Any], *parts: Any) -> Plan | None:
        leaves, treedef, statics, donated = parts  # (those of ``_dynamic``)
        try:
            with loading_ahead(self.__wrapped__, leaves, treedef, statics):
                return build_plan(self._spec, args, kwargs, donated, leaves)
        except SettingError:
            raise  # a JAXAOT_* setting to fix: said, as components say it
        except Exception as e:  # never a wrong result: fall back to jax.jit
            name, why = self.__name__, f"{type(e).__name__}: {e}"
            logger.debug("jaxaot.jit %s: not split (%s); using jax.jit", name, why)
            try:
                self._jitted.lower(*args, **kwargs)  # (JAX keeps it for the call)
            except Exception:
                return None  # the program's own error: the call raises it, as jax.jit does
            refuse_unsplit(self.__name__, e)
            self._say_unsplit(e)
            return None

    def _say_unsplit(self, error: Exception) -> None:
        """Says once per function and cause that a program runs under plain ``jax.jit``."""
        first = (str(error).strip().splitlines() or [""])[0][:200]
        _stats.warn_once(
            f"jit-unsplit:{self.__name__}:{type(error).__name__}",
            f"jaxaot.jit {self.__name__}: runs under plain jax.jit, neither split nor cached "
            f"({type(error).__name__}: {first}); a limitation or a bug of jaxaot's, worth "
            "reporting",
        )


def jit(
    fun: Callable[..., Any] | None = None,
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
    whole_program: bool = True,
    in_shardings: Any = UNSET,
    out_shardings: Any = UNSET,
    auto_regions: bool = True,
    blocks: Any = (),
    inline: bool = False,
    keep_unused: bool = False,
    compiler_options: dict[str, Any] | None = None,
) -> Any:
    """Like ``jax.jit``, compiled region by region: each component is compiled
    once per signature (and per derived transformation) instead of once per
    call site, and the glue between component calls is compiled once per
    distinct glue program. Executables live in the cache, so a warm process
    neither traces component bodies nor compiles them.

    With ``auto_regions`` (the default), a program needs no annotation: the
    blocks it repeats (inner ``jax.jit`` functions and ``jax.checkpoint``
    regions, as Flax ``nnx.remat``/``nn.remat`` and Equinox
    ``filter_checkpoint`` make them, called more than once) are found while
    the program is traced and become components, keyed by their programs.
    ``explain(*args)`` says what was found (it traces, and compiles nothing). Code without such boundaries (a
    plain Python loop of layers) names its blocks: ``blocks=(Layer, ...)``,
    module classes (Equinox, Flax NNX and linen modules, any pytree class) or
    functions, whose calls then become blocks, their arrays passed as
    arguments. ``auto_regions=False`` finds none. A program with nothing to
    split is served whole, as one cached program.

    With ``whole_program`` (the default), a program whose repeated layers are
    small (by an estimate of their work from their programs, when its plan is made) runs
    as one program, one executable in which the repeated layers are a loop over
    one compiled layer, from its first call: small steps then cost what one
    executable costs, not one executable per layer. The program decides this,
    the same in every process; no timing does.

    ``inline`` is ``jax.jit``'s (a call inside another trace is an inner
    ``jax.jit``). ``keep_unused=True`` and ``compiler_options`` are refused
    with a ``ValueError``: the cached programs prune unused inputs, and their
    keys hold XLA's flags (``XLA_FLAGS``), not options of one function.

    ``in_shardings`` and ``out_shardings`` are those of ``jax.jit`` (shardings,
    or partition specs under ``jax.set_mesh``, in a pytree prefix of the
    positional arguments or of the results; ``None``: unconstrained). Inputs
    are placed as ``jax.jit`` places them (a committed array elsewhere goes to
    ``jax.jit``, which says what is wrong); results are moved where
    ``out_shardings`` says. Sharded programs are split too; see the module
    docstring for the shardings each region is compiled for and for what an
    output's sharding is without ``out_shardings``.

    Example::

        @jaxaot.jit
        def train_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # loss_fn calls components
            ...
    """

    def wrap(f: Callable[..., Any]) -> RegionalFunction:
        return RegionalFunction(
            f,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            whole_program=whole_program,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            auto_regions=auto_regions,
            blocks=blocks,
            inline=inline,
            keep_unused=keep_unused,
            compiler_options=compiler_options,
        )

    return wrap if fun is None else wrap(fun)
