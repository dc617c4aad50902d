"""Building the ('data', 'model', 'pipe') device mesh from a config.

Example:
  >>> from jamp.parallel import mesh_shape
  >>> mesh_shape({"data": -1, "model": 2, "pipe": 1}, num_devices=8)
  (4, 2, 1)
"""

from __future__ import annotations

import dataclasses
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

CPU_DEVICES_FLAG = "XLA_FLAGS=--xla_force_host_platform_device_count=8"
"""How to get several devices on a CPU (here 8): set it in the environment before JAX starts."""


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


def zero_splits_nothing(stage: int, mesh: Mesh, use: str) -> str | None:
    """The one-line warning for a ZeRO ``stage`` on a mesh whose 'data' axis has 1 device
    (it splits nothing), or None; ``use`` names the caller's way to a larger 'data' axis.

    The one home of the message, for ``jamp.boost`` and the trainer.

    Example:
      >>> from jamp.parallel import make_mesh
      >>> zero_splits_nothing(3, make_mesh({"data": 1}), "mesh={'data': -1}").split(":")[0]
      "zero_stage=3 on a mesh whose 'data' axis has 1 device splits nothing"
      >>> zero_splits_nothing(3, make_mesh({"data": 2}), "mesh={'data': -1}") is None
      True
    """
    if not stage or mesh.shape["data"] > 1:
        return None
    return (f"zero_stage={stage} on a mesh whose 'data' axis has 1 device splits nothing: "
            f"every device holds the whole state. Use a 'data' axis over several devices "
            f"({use}; on a CPU: {CPU_DEVICES_FLAG} before JAX starts).")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What a mesh runs on: the JAX backend ('cpu', 'gpu', 'tpu'), the device kind and count.

    ``str()`` gives the short form the progress line and the run summary show:
    ``gpu: NVIDIA H100 80GB HBM3 x1``, or ``cpu x8`` where the kind only repeats the backend.
    """

    backend: str
    device_kind: str
    device_count: int

    def __str__(self) -> str:
        same = self.device_kind.lower() == self.backend.lower()
        return f"{self.backend}{'' if same else f': {self.device_kind}'} x{self.device_count}"


def hardware(mesh: Mesh) -> Hardware:
    """The backend, device kind and device count of ``mesh`` (its first device's kind).

    Example:
      >>> from jamp.parallel import make_mesh
      >>> str(hardware(make_mesh({"data": 1})))
      'cpu x1'
    """
    first = mesh.devices.flat[0]
    return Hardware(first.platform, first.device_kind, int(mesh.devices.size))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch: leading axis over 'data', the rest replicated.

    Example:
      >>> from jax.sharding import PartitionSpec
      >>> from jamp.parallel import batch_sharding, make_mesh
      >>> batch_sharding(make_mesh({"data": 1})).spec == PartitionSpec("data")
      True
    """
    return NamedSharding(mesh, PartitionSpec("data"))
