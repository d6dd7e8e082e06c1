"""The 1-D data-parallel mesh keras_dp makes from devices or a user's mesh (`make_mesh`).

A mesh with more axes comes from a Keras distribution instead (a
`keras.distribution.ModelParallel`'s device mesh; `keras_dp.keras.layouts`).
"""

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh

from keras_dp import distributed

# The batch axis of the mesh keras_dp makes (`make_mesh`).
BATCH_AXIS = "batch"


def make_mesh(devices=None, mesh=None):
    """Return the 1-D data-parallel mesh with the single axis `"batch"`.

    Args:
        devices: the devices to train on, each once; all of JAX's devices
            when `None`.
        mesh: a user's own mesh, a `jax.sharding.Mesh` or a
            `keras.distribution.DeviceMesh`; it must have exactly one axis,
            which is taken as the batch axis whatever its name (`"data"`
            too). Mutually exclusive with `devices`.

    Returns:
        A `Mesh` with the one axis `"batch"` of type `AxisType.Auto` (Keras's
        Dropout fails under explicit-sharding axes): a user's `Auto` mesh
        named `"batch"` itself, else one over the same devices in the same
        order (`jax.make_mesh` makes `Explicit` axes by default).

    Raises:
        ValueError: both arguments given, an empty device list, a device
            listed twice, or a mesh with more than one axis.
        RuntimeError: the `KERAS_DP_*` variables ask for several processes
            (`keras-dp launch`), but `keras_dp.distributed.initialize()`
            was not called (`keras_dp.distributed.check_joined`).
    """
    distributed.check_joined()
    if mesh is not None:
        if devices is not None:
            raise ValueError(
                "Pass either `mesh` or `devices`, not both. Received: "
                f"mesh={mesh}, devices={devices}."
            )
        return _users_mesh(mesh)
    given = devices
    devices = jax.devices() if devices is None else list(np.asarray(devices, dtype=object).flat)
    if not devices:
        raise ValueError("`devices` is empty. Pass at least one JAX device.")
    if not all(isinstance(device, jax.Device) for device in devices):
        raise ValueError(
            "`devices` is a list of JAX devices, not a count or ids. Received: "
            f"devices={given!r}. Pass, for example, devices=jax.devices()[:2]."
        )
    twice = sorted({str(device) for device in devices if devices.count(device) > 1})
    if twice:
        raise ValueError(
            "Each device may appear once: a device listed twice would hold two "
            f"shards of every batch. Received: {', '.join(twice)} more than once "
            f"in devices={devices}. Pass distinct devices, for example jax.devices()[:n]."
        )
    return Mesh(
        np.asarray(devices), (BATCH_AXIS,), axis_types=(AxisType.Auto,)
    )


def _users_mesh(mesh):
    """A user's 1-D mesh, checked, as a `jax.sharding.Mesh` with an `Auto` `"batch"` axis."""
    if not isinstance(mesh, Mesh) and hasattr(mesh, "axis_names") and hasattr(mesh, "devices"):
        # A keras.distribution.DeviceMesh: its devices in its shape.
        mesh = Mesh(np.asarray(mesh.devices).reshape(tuple(mesh.shape)), tuple(mesh.axis_names))
    if not isinstance(mesh, Mesh):
        raise ValueError(
            "`mesh` is a jax.sharding.Mesh or a keras.distribution.DeviceMesh. "
            f"Received: mesh={mesh!r} of type {type(mesh).__name__}. "
            "Pass devices=[...] instead, or build one with keras_dp.make_mesh(devices)."
        )
    if len(mesh.axis_names) != 1:
        raise ValueError(
            "keras_dp's `mesh` argument needs a 1-D mesh: its single axis splits the "
            f"batch. Received: mesh.axis_names={mesh.axis_names}. Build one with "
            f"keras_dp.make_mesh(devices) or jax.make_mesh((n,), ('{BATCH_AXIS}',)), "
            "or pass devices=list(mesh.devices.flat) to train on the same devices. "
            "To split the model over an axis of the mesh too, pass a Keras "
            "distribution instead: distribution=keras.distribution.ModelParallel("
            "layout_map=..., batch_dim_name=...) (docs/guides/model-axis.md)."
        )
    # One axis, whatever its name (("data",), ("dp",)): it can only be the
    # batch axis. keras_dp's shardings name it "batch", over the same devices.
    if tuple(mesh.axis_names) != (BATCH_AXIS,) or tuple(mesh.axis_types) != (AxisType.Auto,):
        return Mesh(mesh.devices, (BATCH_AXIS,), axis_types=(AxisType.Auto,))
    return mesh
