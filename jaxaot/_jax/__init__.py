"""Every use of JAX internals in jaxaot (imported in ``_internals``), and nothing else of jaxaot.

A JAX upgrade should only ever need changes in this package. It is a leaf:
it imports no other module of jaxaot but ``_versions``. The names below are
the small surface jaxaot depends on:

* ``_jaxpr``: jaxpr types, walking jaxprs, call bodies, effects and callbacks;
* ``_intercept``: seeing inner ``jit`` and ``checkpoint`` calls as they are bound;
* ``_callbacks``: host callbacks in serialized executables, bound again in the
  process that loads them;
* ``_interpret``: evaluating a jaxpr equation by equation, binding one equation;
* ``_primitive``: defining a primitive (abstract evaluation, lowering,
  batching, JVP, linearization, transpose), linking a StableHLO module into
  the module being lowered, partial evaluation and batching of jaxprs;
* ``_runtime``: lowering platform names, the tracing context ``jax.jit``'s
  caches key on and the axis environment, the concrete shardings JAX's device
  assignment sees in a jaxpr, the distributed runtime's key-value client,
  types made again by pickling comparing equal (``AutoLayout``), serialized
  executables and JAX's C++ dispatcher;
* ``_target``: compile targets without their devices (TPU topologies), the
  active one, and how keys describe a target's devices.

Supported JAX: 0.10.2 through 0.12.x (``SUPPORTED_JAX``). The differences
between those versions are all handled here, keyed on the installed version
(``JAX_VERSION``):

* 0.11.1 changed the linearization-rule protocol: a rule returns five values
  (``out, nonzeros, residuals, structured_residuals, linearized``) and JAX calls
  ``linearized(residuals, structured_residuals, *tangents)``; jaxaot's rules use
  the four-value form, adapted by ``register_linearization``.
* 0.11.1 replaced the ``closed_call``/``core_call`` primitives by ``eval_jaxpr``
  (its body in the ``call_jaxpr`` parameter): see ``CALL_PRIMITIVES`` and
  ``call_body``.
* 0.11 merged ``ClosedJaxpr`` into ``Jaxpr`` (a ``Jaxpr`` carries its consts;
  ``Jaxpr(jaxpr, consts)`` still builds a closed one) and 0.12 removed the
  ``ClosedJaxpr`` name: ``ClosedJaxpr`` here is whichever class closes a jaxpr.
* 0.11.2 computes tanh's derivative with a ``one_minus_square`` primitive:
  ``ELEMENTWISE_ARITHMETIC`` lists it with the other cheap elementwise ops.
* From 0.12 a ``checkify`` rule takes the checkify context first
  (``register_checkify`` tells by ``checkify_jaxpr``'s signature).
* 0.10 ignores a negative ``donate_argnums``; later versions count it from the
  last argument (``donates_negative_argnums``, asked of ``jax.jit``).
* Newer JAX puts a layout on every type, ``AutoLayout`` by default (see
  ``_runtime.one_auto_layout``).
"""

from ._callbacks import (
    CallbacksNotRebindable,
    binds_callbacks,
    callback_arguments,
    callback_equations,
    callback_functions,
    called_callbacks,
    holds_host_callbacks,
    is_callback_equation,
    lowered_host_callbacks,
    rebind_unsupported,
    register_program,
    relowering,
    serialize_relowered,
    serialize_with_callbacks,
)
from ._intercept import (
    BoundCall,
    bind_plainly,
    call_jaxpr,
    current_trace,
    differentiating,
    forwarded,
    hoisted,
    hoisted_draws,
    intercepting,
    is_inline,
    is_plain_jit,
    jaxpr_program,
    not_intercepting,
    pruned,
    used_inputs,
    within,
)
from ._interpret import bind_equation, evaluate
from ._jaxpr import (
    CALL_PRIMITIVES,
    CUSTOM_VJP_PRIMITIVES,
    ELEMENTWISE_ARITHMETIC,
    JAX_VERSION,
    SUPPORTED_JAX,
    ArrayImpl,
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    Literal,
    Primitive,
    PRNGKeyArray,
    ShapedArray,
    Tracer,
    Zero,
    apply_primitive,
    call_body,
    has_host_callbacks,
    is_ordered_effect,
    jaxpr_as_fun,
    jaxprs_in_params,
    join_effects,
    named,
    named_axis_effect,
    trace_state_clean,
    under_staging,
    uses_primitive,
    walk_jaxprs,
)
from ._primitive import (
    ad,
    batch_jaxpr,
    batching,
    call_module_function,
    inline_jaxpr_lowering,
    lower_linkable,
    lowering_platforms,
    lowering_rules,
    module_to_bytecode,
    not_mapped,
    partial_eval_jaxpr,
    prng_impl,
    register_checkify,
    register_jet,
    register_linearization,
    register_lowering,
)
from ._runtime import (
    EXCLUDED_FLAGS,
    KNOWN_PLATFORMS,
    accelerator_left_out,
    api_boundary,
    canonical_platform,
    compile_flags,
    cpp_dispatcher,
    default_platform,
    deserialize_executable,
    device_zeros,
    distributed_client,
    donates_negative_argnums,
    explicit_mesh_axes_in_scope,
    fastpath_miss,
    hide_internal_frames,
    host_cpu_text,
    jax_explains_misses,
    jax_explanations_off,
    jit_disabled,
    local_accelerator,
    named_shardings,
    nan_found,
    one_auto_layout,
    options_set,
    run_on_zeros,
    serialize_executable,
    thread_options,
    trace_context,
    trace_context_items,
    with_trees,
)
from ._target import (
    EXTRA,
    Target,
    TargetError,
    active_target,
    check_tpu_available,
    on_target,
    parse_target,
    platform_version_text,
    refuse_call,
    set_target,
    target_devices,
    target_platform,
    topology_text,
)

one_auto_layout()
hide_internal_frames()

__all__ = [
    "EXTRA",
    "Target",
    "TargetError",
    "accelerator_left_out",
    "active_target",
    "check_tpu_available",
    "local_accelerator",
    "on_target",
    "parse_target",
    "platform_version_text",
    "refuse_call",
    "set_target",
    "target_devices",
    "target_platform",
    "topology_text",
    "CALL_PRIMITIVES",
    "CUSTOM_VJP_PRIMITIVES",
    "ELEMENTWISE_ARITHMETIC",
    "EXCLUDED_FLAGS",
    "JAX_VERSION",
    "KNOWN_PLATFORMS",
    "SUPPORTED_JAX",
    "ArrayImpl",
    "PRNGKeyArray",
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "Literal",
    "Primitive",
    "ShapedArray",
    "Tracer",
    "Zero",
    "BoundCall",
    "ad",
    "apply_primitive",
    "batch_jaxpr",
    "batching",
    "bind_equation",
    "callback_arguments",
    "callback_functions",
    "callback_equations",
    "called_callbacks",
    "CallbacksNotRebindable",
    "is_callback_equation",
    "rebind_unsupported",
    "register_program",
    "holds_host_callbacks",
    "lowered_host_callbacks",
    "relowering",
    "serialize_relowered",
    "serialize_with_callbacks",
    "bind_plainly",
    "binds_callbacks",
    "call_jaxpr",
    "current_trace",
    "differentiating",
    "call_body",
    "call_module_function",
    "canonical_platform",
    "compile_flags",
    "cpp_dispatcher",
    "default_platform",
    "donates_negative_argnums",
    "deserialize_executable",
    "device_zeros",
    "run_on_zeros",
    "with_trees",
    "api_boundary",
    "hide_internal_frames",
    "host_cpu_text",
    "jit_disabled",
    "jax_explains_misses",
    "jax_explanations_off",
    "nan_found",
    "distributed_client",
    "evaluate",
    "explicit_mesh_axes_in_scope",
    "fastpath_miss",
    "has_host_callbacks",
    "forwarded",
    "hoisted",
    "hoisted_draws",
    "inline_jaxpr_lowering",
    "intercepting",
    "is_inline",
    "is_plain_jit",
    "pruned",
    "used_inputs",
    "is_ordered_effect",
    "jaxpr_as_fun",
    "jaxpr_program",
    "named",
    "jaxprs_in_params",
    "join_effects",
    "lower_linkable",
    "lowering_platforms",
    "lowering_rules",
    "module_to_bytecode",
    "named_axis_effect",
    "named_shardings",
    "not_intercepting",
    "not_mapped",
    "one_auto_layout",
    "partial_eval_jaxpr",
    "prng_impl",
    "register_checkify",
    "register_jet",
    "register_linearization",
    "register_lowering",
    "serialize_executable",
    "trace_context",
    "trace_context_items",
    "thread_options",
    "options_set",
    "trace_state_clean",
    "under_staging",
    "uses_primitive",
    "walk_jaxprs",
    "within",
]
