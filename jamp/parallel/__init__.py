"""Device meshes, logical axis rules and sharding helpers for jamp's trainer."""

from jamp.parallel.mesh import (
    AXES,
    LOGICAL_AXIS_RULES,
    batch_sharding,
    make_mesh,
    mesh_shape,
    replicated,
)

__all__ = ["AXES", "LOGICAL_AXIS_RULES", "batch_sharding", "make_mesh", "mesh_shape",
           "replicated"]
