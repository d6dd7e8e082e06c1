"""Memory you can see before you run: the state's bytes and one step's peak.

`memory_plan` lays the state out as `state_sharding` says (`keras_dp.layout`)
without placing it, compiles the train step for one global batch against
abstract arrays (`jax.ShapeDtypeStruct`s with their shardings), and reads
XLA's own memory analysis of that program. Nothing is put on a device.

`keep_last_good` decides, from the same numbers, whether a fit's steps
keep the last completed state (see `ShardedTrainer`'s `keep_last_good`).
"""

import dataclasses

import jax
import numpy as np

from keras_dp import layout
from keras_dp import sharding as mesh_lib
from keras_dp import sources as pipeline
from keras_dp.core import placement
from keras_dp.core.state import TrainState

# keep_last_good="auto" keeps the state of the last completed step when, where
# the devices report their memory, a step plus the states kept needs at most
# this fraction of every device's free memory.
KEEP_FRACTION = 0.5
# XLA:CPU reports no memory; its devices are host RAM, so there the states
# kept on all of the process's devices together may take at most this much.
CPU_KEEP_CAP_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of the training state and of one compiled train step.

    Attributes:
        state_sharding: the mode the plan is for.
        devices: the device count the state and batch are split over.
        weights, non_trainable, optimizer, metrics: bytes per device of each
            state group, as laid out (a split array counts 1/N of its bytes).
        arguments, outputs, temporaries: XLA's memory analysis of the
            compiled step: its inputs (state and batch), outputs, and the
            scratch it needs while running, per device.
        peak: `arguments + outputs - aliased + temporaries`, the most the
            step holds at once (donated state is aliased with its output).
        capacity: the device's memory (`memory_stats()["bytes_limit"]`), or
            None where the platform does not report it (CPU).
        resident_data: of `arguments`, the training data kept on the
            devices (`data_on_device`), all of it on each; 0 for the step
            fed batch by batch from the host.
    """

    state_sharding: str
    devices: int
    weights: int
    non_trainable: int
    optimizer: int
    metrics: int
    arguments: int
    outputs: int
    temporaries: int
    peak: int
    capacity: int | None
    resident_data: int = 0

    def fits(self):
        """Whether the peak is within the capacity (True when unknown)."""
        return self.capacity is None or self.peak <= self.capacity

    def __str__(self):
        mib = format_bytes
        lines = [
            f"Memory per device ({self.devices} devices, state_sharding="
            f"{self.state_sharding!r}):",
            f"  weights {mib(self.weights)}, non-trainable {mib(self.non_trainable)}, "
            f"optimizer {mib(self.optimizer)}, metrics {mib(self.metrics)}",
            ("  compiled step over the training data kept on the devices "
             f"({mib(self.resident_data)} of its arguments):" if self.resident_data else
             "  compiled step, fed from the host:"),
            f"    arguments {mib(self.arguments)}, outputs "
            f"{mib(self.outputs)}, temporaries {mib(self.temporaries)}, peak {mib(self.peak)}",
            "  capacity " + ("not reported by this platform" if self.capacity is None
                             else f"{mib(self.capacity)}"),
        ]
        return "\n".join(lines)


def format_bytes(nbytes):
    """`nbytes` in the largest binary unit it fills: 32 B, 37.0 KiB, 1.5 MiB, 2.00 GiB."""
    nbytes = int(nbytes)
    if nbytes < 2**10:
        return f"{nbytes} B"
    if nbytes < 2**20:
        return f"{nbytes / 2**10:.1f} KiB"
    if nbytes < 2**30:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**30:,.2f} GiB"


def plan(trainer, batch, step=None, arguments=None):
    """The `MemoryPlan` of `trainer`'s train step on one global host `batch`.

    Of `step` (one of the trainer's jitted train steps), by default the
    step in use: it donates its state unless a fit chose to keep the last
    completed state (`trainer.keeps_last_good`). `arguments`: the step's
    abstract arguments after the state, by default `batch`'s `DeviceBatch`
    (a resident step takes `keras_dp.core.feed.abstract_arguments`). The
    model must be built (`trainer.build(batch)`).
    """
    state = TrainState.abstract_of(trainer.model, trainer.state_layout())
    per_group = state_bytes(trainer, state)
    resident_data = 0
    if arguments is None:
        arguments = (placement.abstract_batch(batch, pipeline.batch_rows(batch), trainer.mesh),)
    else:  # the resident arrays come first, whole on every device
        resident_data = sum(map(layout.bytes_per_device, jax.tree.leaves(arguments[0])))
    step = trainer.programs.train_step if step is None else step
    analysis = step.lower(state, *arguments).compile().memory_analysis()
    peak = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)
    return MemoryPlan(
        state_sharding=trainer.state_sharding, devices=mesh_lib.num_devices(trainer.mesh),
        weights=per_group["trainable"], non_trainable=per_group["non_trainable"],
        optimizer=per_group["optimizer"], metrics=per_group["metrics"],
        arguments=analysis.argument_size_in_bytes, outputs=analysis.output_size_in_bytes,
        temporaries=analysis.temp_size_in_bytes, peak=peak,
        capacity=device_capacity(trainer.mesh.devices.flat[0]), resident_data=resident_data,
    )


def state_bytes(trainer, state=None):
    """`{group: bytes per device}` of the built model's training state, as laid out.

    `state`: that state, abstract (`TrainState.abstract_of`), when the
    caller has made it already.
    """
    if state is None:
        state = TrainState.abstract_of(trainer.model, trainer.state_layout())
    return {name: sum(map(layout.bytes_per_device, values)) for name, values in state.groups()}


def memory_plan(model, x, y=None, *, batch_size=32, sample_weight=None, devices=None,
                mesh=None, state_sharding="replicated", optimizer=None, loss=None,
                metrics=None, data_on_device=False):
    """Plan the memory of training `model` on `devices` before running it.

    Args:
        model: a `keras.Model`, compiled or given `optimizer`/`loss`.
        x, y, sample_weight: a few rows of the data as arrays, for their
            shapes (all of it with `data_on_device`), read as `fit` reads
            them.
        batch_size: the global batch to plan for.
        devices, mesh, state_sharding, optimizer, loss, metrics: as for
            `ShardedTrainer`.
        data_on_device: as for `ShardedTrainer.memory_plan`: True or
            "auto" plan the step over the data kept on the devices when a
            fit with that setting keeps it.

    Returns:
        A `MemoryPlan`: per device, the bytes of weights, optimizer and
        metrics as laid out, and the compiled step's arguments,
        temporaries and peak from XLA's memory analysis.
    """
    from keras_dp.trainer import ShardedTrainer  # noqa: PLC0415 (trainer imports this)

    trainer = ShardedTrainer(model, optimizer=optimizer, loss=loss, metrics=metrics,
                             devices=devices, mesh=mesh, state_sharding=state_sharding)
    return trainer.memory_plan(x, y, batch_size=batch_size, sample_weight=sample_weight,
                               data_on_device=data_on_device)


def device_capacity(device):
    """The device's memory in bytes, or None where the platform does not say."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some platforms raise instead of returning None
        return None
    return None if not stats else stats.get("bytes_limit")


def check_arrays(x, y=None):
    """Refuse data that is not arrays, which a plan cannot take its rows from, naming the fix.

    `fit` reads such data as batches (`pipeline.is_array_data`); reading
    one here would take a pass from a dataset that reshuffles.
    """
    if pipeline.is_array_data(x, y):
        return
    inputs = f" {pipeline.LIST_AS_INPUTS}" if pipeline.may_be_inputs(x) else ""
    raise ValueError(
        f"A memory plan takes a few rows of the data as arrays; fit reads this x (a "
        f"{type(x).__name__}) as batches, which a plan does not read. Pass one batch's "
        f"arrays instead as x and y (of a dataset: `next(iter(dataset))`).{inputs}"
    )


def batch_of(batch, batch_size):
    """`batch`'s rows repeated or cut to `batch_size` rows (only shapes matter here)."""
    rows = pipeline.batch_rows(batch)
    if rows == batch_size:
        return jax.tree.map(np.asarray, batch)
    return jax.tree.map(
        lambda a: np.resize(np.asarray(a), (batch_size,) + np.shape(a)[1:]), batch)


def check_fits(memory_plan):
    """Raise a `MemoryError` with the numbers and the fixes if the step cannot fit."""
    if memory_plan.fits():
        return
    raise MemoryError(
        f"One train step needs {memory_plan.peak / 2**30:.2f} GiB per device, and "
        f"the device has {memory_plan.capacity / 2**30:.2f} GiB.\n{memory_plan}\n"
        "To fit: split the state over the devices (state_sharding='full', or "
        "'optimizer'), use a smaller batch_size, or compute in bfloat16 "
        "(keras.mixed_precision.set_global_policy('mixed_bfloat16'))."
    )


def keeps_fit(state_bytes, steps_in_flight, *, free=None, peak=None, local_devices=1):
    """Whether keeping the last completed state fits: the rule of `keep_last_good="auto"`.

    Kept, a fit holds `steps_in_flight` states per device more than when
    they are donated (each call in flight makes a new one while the last
    completed one stays). Where the devices report their memory, the step's
    peak with its state donated plus those states must take at most
    `KEEP_FRACTION` of `free`; where they do not (XLA:CPU), the states kept
    on all `local_devices` at most `CPU_KEEP_CAP_BYTES`.

    Args:
        state_bytes: the training state's bytes per device, as laid out.
        steps_in_flight: the bound on unfinished calls (`inflight.bound`).
        free: the least free memory of the process's devices, in bytes;
            None where they do not report it.
        peak: the train step's peak per device with its state donated
            (`MemoryPlan.peak`); default `state_bytes` (the state alone).
        local_devices: how many devices share the host (XLA:CPU).
    """
    extra = steps_in_flight * state_bytes
    if free is None:
        return extra * local_devices <= CPU_KEEP_CAP_BYTES
    return (state_bytes if peak is None else peak) + extra <= KEEP_FRACTION * free


def keep_last_good(trainer, plan=None):
    """Whether `trainer`'s next fit keeps the last completed state (True) or donates it.

    `trainer.keep_last_good` if it is True or False; for `"auto"`, the rule
    of `keeps_fit` on the built model's state as laid out, the devices'
    free memory now (so data already placed there counts) and `plan` (a
    `MemoryPlan` of the donating step, where fit made one). Across
    processes the answer decides the compiled programs, which must be the
    same everywhere. On XLA:CPU the rule reads only what every process
    computes alike (the state's layout, `steps_in_flight`, the mesh's
    devices per process), so no exchange is needed; where free memory is
    read, the state is kept only if every process would keep it (one host
    round trip per fit).
    """
    if trainer.keep_last_good != "auto":
        return trainer.keep_last_good
    devices = list(trainer.mesh.devices.flat)
    state = sum(state_bytes(trainer).values())
    free = least_free([device for device in devices
                       if device.process_index == jax.process_index()])
    if free is None:
        processes = len({device.process_index for device in devices})
        return keeps_fit(state, trainer.steps_in_flight, local_devices=len(devices) // processes)
    keep = keeps_fit(state, trainer.steps_in_flight, free=free,
                     peak=None if plan is None else plan.peak)
    if trainer.multiprocess:
        keep = not trainer.placement.any_process(not keep)
    return keep


def least_free(devices):
    """The least free memory of `devices` (`bytes_limit - bytes_in_use`), or None if unreported."""
    free = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - some platforms raise instead of returning None
            stats = None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free, default=None)
