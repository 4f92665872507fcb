"""Regional compilation: ``jaxaot.jit``.

* ``_jit``: :func:`jit` and :class:`RegionalFunction` (a call finds its plan);
* ``_split``: cutting a traced program into component and glue regions;
* ``_planner``: making a plan (slots, executables to load or compile);
* ``_plan``: running a plan: split, or one program;
* ``_whole``: the whole-program form, repeated layers as loops, and which
  form a program takes;
* ``_programs``: the executables of regions, keyed, loaded and stored;
* ``_placement``: shardings regions are compiled for; ``in``/``out_shardings``;
* ``_pool``: the threads that load and compile.
"""

from ._jit import RegionalFunction, jit

__all__ = ["RegionalFunction", "jit"]
