"""Components: functions whose types, StableHLO and executables are cached.

* ``_decorator``: ``@jaxaot.component``; ``_component``: :class:`Component`,
  how a call is served (top level, or bound under tracing);
* ``_arguments``: static, donated and array arguments, with their names;
* ``_types``: values as the types entries are keyed and traced by;
* ``_parts``: what every key holds, and the keys of derived entries;
* ``_entries``: making an entry (trace, lower);
* ``_call``: one call of an entry, and its derived entries (vmap, JVP,
  linearize, transpose); ``_rewrites``: the jaxpr rewrites those use;
* ``_cost``: a computation's work, and whether a small one's linearization
  recomputes its forward pass (CPU);
* ``_rules``: the ``jaxaot_component`` primitive and its rules;
* ``_plain``: which programs are served as plain JAX.
"""

from ._call import Call
from ._component import Component
from ._decorator import component
from ._rules import component_p

__all__ = ["Call", "Component", "component", "component_p"]
