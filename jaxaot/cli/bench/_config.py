"""What a benchmark run is: the model's shape and step, the mesh of the sharded
suite, one worker's job, the whole run's settings, and each suite's contenders.

All of it is plain frozen values: the command line builds a :class:`BenchConfig`
once, the suites derive a :class:`Job` per worker process from it, and the job
travels to the worker as JSON on its command line. Nothing here reads the
environment or keeps state between runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "saved",
    "write",
    "AXIS_TYPES",
    "CONTENDERS",
    "LAYOUTS",
    "MODES",
    "REGIONAL",
    "SHARDED",
    "SUITES",
    "ArgumentError",
    "BenchConfig",
    "Job",
    "MeshLayout",
    "ModelShape",
    "Table",
]

SUITES = ("warm-start", "regional", "sharded", "fleet", "precompile", "edits", "all")
#: "train": ``value_and_grad`` of the loss; "inference": the loss (forward pass) alone.
MODES = ("train", "inference")
#: The sharded suite's layouts: the batch split over every device, the parameters
#: replicated (``data-parallel``) or split on their first axis (``fsdp``); or a
#: 2-D ``data`` x ``model`` mesh, the batch on ``data`` and the attention and MLP
#: weights on ``model`` (``2d``).
LAYOUTS = ("data-parallel", "fsdp", "2d")
#: The mesh's axis types: ``explicit`` (``jax.make_mesh``'s default: shardings in
#: the types, under ``jax.set_mesh``) or ``auto`` (XLA's propagation).
AXIS_TYPES = ("explicit", "auto")

#: A suite's contenders: name -> (label, the preparation contender it needs or None).
Table = dict[str, tuple[str, str | None]]

#: The warm-start suite.
CONTENDERS: Table = {
    "jit_cold": ("jax.jit, cold", None),
    "jit_components_cold": ("jax.jit calling components, cold", None),
    "pcc_cold": ("jax.jit + JAX persistent cache, cold", None),
    "pcc_warm": ("jax.jit + JAX persistent cache, warm", "pcc_cold"),
    "export_warm": ("jax.export artifact, fresh process", "export_prepare"),
    "jaxaot_cold": ("jaxaot component, cold", None),
    "jaxaot_warm": ("jaxaot component, warm", "jaxaot_cold"),
    "limit": ("physical limit: read + deserialize_and_load", "limit_prepare"),
}

#: The regional-compilation suite.
REGIONAL: Table = {
    "jit_cold": ("jax.jit, cold", None),
    "scan_cold": ("scan over stacked layers, cold", None),
    "jit_components_cold": ("jax.jit calling components, cold", None),
    "noinline_cold": ("Equinox noinline layers, cold", None),
    "regional_cold": ("jaxaot.jit, cold", None),
    "pcc_warm": ("jax.jit + JAX persistent cache, warm", "pcc_cold"),
    "regional_warm": ("jaxaot.jit, warm", "regional_cold"),
    # The common large-model form: no annotation, each layer a jax.checkpoint.
    "remat_jit_cold": ("remat'd layers: jax.jit, cold", None),
    "remat_scan_cold": ("remat'd layers: scan over stacked layers, cold", None),
    "remat_regional_cold": ("remat'd layers: jaxaot.jit (no annotation), cold", None),
    "remat_regional_warm": (
        "remat'd layers: jaxaot.jit (no annotation), warm",
        "remat_regional_cold",
    ),
    "remat_limit": (
        "remat'd layers: physical limit: load its executables + one step",
        "remat_regional_cold",
    ),
}

#: The sharded suite: the regional suite's contenders that run on a mesh, and the
#: physical limit of a warm start (the warm-start suite's).
SHARDED: Table = {
    **{
        name: REGIONAL[name]
        for name in ("jit_cold", "scan_cold", "regional_cold", "pcc_warm", "regional_warm")
    },
    "limit": CONTENDERS["limit"],
}


class ArgumentError(ValueError):
    """Settings a suite cannot run with (the command line reports it in one line)."""


@dataclass(frozen=True)
class ModelShape:
    """The benchmark model: ``layers`` pre-norm transformer blocks (4 heads, GELU
    MLP 4x) on inputs of ``batch`` x ``seq`` x ``width``; the step is ``mode``."""

    batch: int = 8
    seq: int = 128
    width: int = 256
    mode: str = "train"

    def __post_init__(self) -> None:
        if min(self.batch, self.seq, self.width) < 1:
            raise ArgumentError(f"the model's batch, sequence and width must be positive: {self}")
        if self.mode not in MODES:
            raise ArgumentError(f"mode must be one of {MODES}, not {self.mode!r}")

    @property
    def inference(self) -> bool:
        return self.mode == "inference"

    def step_text(self) -> str:
        """The step, as the reports name it."""
        return "forward pass (inference)" if self.inference else "train step (value_and_grad)"


#: ``--quick`` of the sharded suite: a tiny model (batch and width divisible by 8).
QUICK_SHARDED_SHAPE = ModelShape(batch=8, seq=8, width=32)


@dataclass(frozen=True)
class MeshLayout:
    """Where a sharded worker puts the model: ``devices`` simulated CPU devices in
    ``layout`` (one of :data:`LAYOUTS`) on a mesh of ``axis_types``."""

    layout: str
    devices: int
    axis_types: str = "auto"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ArgumentError(f"layout must be one of {LAYOUTS}, not {self.layout!r}")
        if self.axis_types not in AXIS_TYPES:
            raise ArgumentError(f"axis types must be one of {AXIS_TYPES}, not {self.axis_types!r}")
        if self.devices < 1 or (self.layout == "2d" and self.devices % 2):
            raise ArgumentError(
                f"--devices {self.devices}: the {self.layout} layout needs a positive"
                + (" even" if self.layout == "2d" else "")
                + " number of devices"
            )

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Axis name -> size: one ``data`` axis, or ``data`` x ``model`` (model 2) for 2-D."""
        if self.layout == "2d":
            return {"data": self.devices // 2, "model": 2}
        return {"data": self.devices}

    def check(self, shape: ModelShape) -> None:
        """Raises :class:`ArgumentError` unless ``shape`` splits evenly over the mesh."""
        sizes = self.mesh_shape
        width_split = {"data-parallel": 1, "fsdp": self.devices, "2d": sizes.get("model", 1)}
        if shape.batch % sizes["data"] or shape.width % width_split[self.layout]:
            raise ArgumentError(
                f"batch {shape.batch} and width {shape.width} must be multiples of the mesh "
                f"axes they are split over ({self.layout} on --devices {self.devices}: "
                + " x ".join(f"{n} {s}" for n, s in sizes.items())
                + ")"
            )


@dataclass(frozen=True)
class Job:
    """One worker's task: time ``contender`` at depth ``layers`` in the work folder
    ``work`` shared by one trial's processes (``mesh``: on simulated devices;
    ``cache``: the fleet suite's shared cache)."""

    contender: str
    layers: int
    work: str
    repeats: int
    shape: ModelShape = field(default_factory=ModelShape)
    mesh: MeshLayout | None = None
    #: The fleet suite's shared cache: ``{"dir": path}`` or ``{"redis": url, "prefix": p}``.
    cache: dict[str, str] | None = None
    #: The edits suite's program: its edits, comma-separated (``loss``, ``lr``).
    edit: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        data: dict[str, Any] = json.loads(text)
        mesh = data.pop("mesh")
        return cls(
            shape=ModelShape(**data.pop("shape")),
            mesh=MeshLayout(**mesh) if mesh is not None else None,
            **data,
        )

    def at(self, contender: str) -> Job:
        """The same job for another contender (its preparation)."""
        return replace(self, contender=contender)


@dataclass(frozen=True)
class BenchConfig:
    """One ``jaxaot bench`` run.

    ``width``, ``batch``, ``seq`` and ``inference`` change the regional and sharded
    suites' model (the warm-start suite keeps the default one); ``devices``,
    ``contenders``, ``layouts`` and ``axis_types`` are the sharded suite's;
    ``processes`` is the fleet suite's (cold processes started together). The edits
    suite takes the model's size and ``contenders`` too.
    """

    suite: str = "warm-start"
    layers: tuple[int, ...] | None = None
    full: bool = False
    quick: bool = False
    repeats: int = 3
    trials: int = 1
    max_jit_layers: int = 48
    width: int | None = None
    batch: int | None = None
    seq: int | None = None
    inference: bool = False
    devices: int = 8
    contenders: tuple[str, ...] | None = None
    layouts: tuple[str, ...] | None = None
    axis_types: tuple[str, ...] | None = None
    processes: int = 4
    out: Path | None = None  # where the files go; None: the terminal only

    def shape(self, suite: str) -> ModelShape:
        """The model ``suite`` runs: the warm-start suite's is the default; the
        others take ``width``, ``batch``, ``seq`` and ``inference`` (the sharded
        suite starts from a tiny model with ``quick``)."""
        if suite == "warm-start":
            return ModelShape()
        base = QUICK_SHARDED_SHAPE if suite == "sharded" and self.quick else ModelShape()
        return ModelShape(
            batch=self.batch or base.batch,
            seq=self.seq or base.seq,
            width=self.width or base.width,
            mode="inference" if self.inference else base.mode,
        )


def saved(config: BenchConfig, name: str) -> Path | None:
    """Where the run's file ``name`` goes (its folder made), or ``None`` when the
    run names no ``--out`` folder: the tables go to the terminal only, and a run
    inside a checkout writes nothing into it."""
    if config.out is None:
        return None
    config.out.mkdir(parents=True, exist_ok=True)
    return config.out / name


def write(config: BenchConfig, name: str, rows: object, text: str) -> None:
    """``name.json`` (the rows) and ``name.md`` (the table) in ``--out``, if named."""
    if data := saved(config, f"{name}.json"):
        data.write_text(json.dumps(rows, indent=1))
    if table := saved(config, f"{name}.md"):
        table.write_text(text)
