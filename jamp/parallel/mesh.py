"""Building the ('data', 'model', 'pipe') device mesh from a config.

Example:
  >>> from jamp.parallel import mesh_shape
  >>> mesh_shape({"data": -1, "model": 2, "pipe": 1}, num_devices=8)
  (4, 2, 1)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

AXES = ("data", "model", "pipe")
"""Mesh axis names, outermost first."""

LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("seq", None),
    ("embed", None),
    ("heads", "model"),
    ("kv", None),
    ("mlp", "model"),
    ("vocab", None),
    ("layers", "pipe"),
)
"""Flax logical axis -> mesh axis: Megatron-style tensor parallelism over 'model'."""


def mesh_shape(spec: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
    """Resolves ``{data, model, pipe}`` sizes (one may be -1 = the rest) for ``num_devices``.

    Raises:
      ValueError: unknown axis names, more than one -1, or sizes that do not
        divide the device count.

    Example:
      >>> from jamp.parallel import mesh_shape
      >>> mesh_shape({"data": 2, "model": 1, "pipe": 1}, num_devices=8)
      (2, 1, 1)
    """
    unknown = sorted(set(spec) - set(AXES))
    if unknown:
        raise ValueError(f"Unknown mesh axes {unknown}: use {', '.join(AXES)}.")
    sizes = [int(spec.get(axis, 1)) for axis in AXES]
    named = dict(zip(AXES, sizes, strict=True))
    if sizes.count(-1) > 1:
        raise ValueError(f"Only one mesh axis may be -1 (the rest), got {named}.")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"Mesh sizes must be positive or -1, got {named}.")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(
                f"The mesh {named} needs the device count ({num_devices}) to be "
                f"a multiple of {known}; change --config.mesh.* so their product divides it."
            )
        sizes[sizes.index(-1)] = num_devices // known
    elif known > num_devices:
        raise ValueError(
            f"The mesh {named} needs {known} devices but only {num_devices} "
            "exist; shrink --config.mesh.* or set one axis to -1."
        )
    return tuple(sizes)


def make_mesh(spec: Mapping[str, int], devices: list | None = None) -> Mesh:
    """Builds a ``Mesh`` with axes ('data', 'model', 'pipe') over all processes' devices.

    When the sizes multiply to fewer devices than exist, the first ones are used.

    Example:
      >>> from jamp.parallel import make_mesh
      >>> make_mesh({"data": 1, "model": 1, "pipe": 1}).shape["data"]
      1
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(spec, len(devices))
    count = math.prod(shape)
    # Auto axes: shardings are hints the partitioner propagates (jax.make_mesh's
    # default became Explicit, where with_sharding_constraint turns into an assert).
    auto = (AxisType.Auto,) * len(AXES)
    if count == len(devices):
        try:
            return jax.make_mesh(shape, AXES, devices=devices, axis_types=auto)
        except (TypeError, ValueError):  # topologies it cannot tile
            pass
    return Mesh(np.asarray(devices[:count]).reshape(shape), AXES, axis_types=auto)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch: leading axis over 'data', the rest replicated.

    Example:
      >>> from jax.sharding import PartitionSpec
      >>> from jamp.parallel import batch_sharding, make_mesh
      >>> batch_sharding(make_mesh({"data": 1})).spec == PartitionSpec("data")
      True
    """
    return NamedSharding(mesh, PartitionSpec("data"))
