"""Memory you can see before you run: the state's bytes and one step's peak.

`step_plan` (behind `keras_dp.memory_plan`) takes the state laid out as the
`keras_dp.sharding.Layout` says, without placing it, compiles the train
step for one global batch against abstract arrays (`jax.ShapeDtypeStruct`s
with their shardings), and reads XLA's own memory analysis of that
program. Nothing is put on a device.

`keep_last_good` decides, from the same numbers, whether a fit's steps
keep the last completed state (see `ShardedTrainer`'s `keep_last_good`).
"""

import dataclasses

import jax
import numpy as np

from keras_dp import options
from keras_dp import sharding
from keras_dp.checks import model as model_checks
from keras_dp.core import feed
from keras_dp.core import programs as programs_lib
from keras_dp.core.feed import least_free
from keras_dp.core.state import TrainState
from keras_dp.sources import inputs

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
        micro_batches: the slices each batch runs as (`micro_batches`).
        batch_size: the global batch the step was planned for.
        remedies: where the peak exceeds the capacity, the changes a fit
            could make, each planned: `(what, MemoryPlan)` pairs
            (`remedies_of`); empty otherwise.
        mesh: the mesh's `(axis, size)` pairs, the batch axis's first.
        variables: a `VariablePlan` per state variable, group by group in
            the state's order: its path, shape, dtype, `PartitionSpec`
            and bytes per device (their sums are the group fields).
        loading: the most a device holds while weights are loaded into the
            model as it lies (`model.load_weights`, `set_weights` under
            `keras_dp.sharded_birth()`): its variables' bytes per device,
            each as its own layout splits it, plus the largest one's (the
            old and new values of the variable being assigned). Computed
            from the layouts; `tests/test_sharded_birth.py` measures it
            on device 0. None where the plan has no model (a remedy's).
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
    micro_batches: int = 1
    batch_size: int | None = None
    remedies: tuple = ()
    mesh: tuple = ()
    variables: tuple = ()
    loading: int | None = None

    def fits(self):
        """Whether the peak is within the capacity (True when unknown)."""
        return self.capacity is None or self.peak <= self.capacity

    def __str__(self):
        mib = format_bytes
        where = (f"{self.devices} devices" if len(self.mesh) < 2 else "mesh " + ", ".join(
            f"{axis}={size}" for axis, size in self.mesh))
        settings = f"state_sharding={self.state_sharding!r}"
        if self.micro_batches > 1:
            settings += f", micro_batches={self.micro_batches}"
        lines = [
            f"Memory per device ({where}, {settings}):",
            f"  weights {mib(self.weights)}, non-trainable {mib(self.non_trainable)}, "
            f"optimizer {mib(self.optimizer)}, metrics {mib(self.metrics)}",
            ("  compiled step over the training data kept on the devices "
             f"({mib(self.resident_data)} of its arguments):" if self.resident_data else
             "  compiled step, fed from the host:"),
            f"    arguments {mib(self.arguments)}, outputs "
            f"{mib(self.outputs)}, temporaries {mib(self.temporaries)}, peak {mib(self.peak)}",
            "  capacity " + ("not reported by this platform" if self.capacity is None
                             else f"{mib(self.capacity)}" + ("" if self.fits() else
                                                             ": does not fit")),
        ]
        if self.loading is not None:
            lines.append(f"  loading weights shard by shard (keras_dp.sharded_birth): "
                         f"{mib(self.loading)}")
        if len(self.mesh) > 1:  # a model axis: where each variable lies
            lines.append("  each variable, as laid out:")
            lines.extend("    " + line for line in variable_lines(self.variables))
        for what, plan in self.remedies:
            verdict = "fits" if plan.fits() else "does not fit"
            lines.append(f"  with {what}: peak {mib(plan.peak)}, temporaries "
                         f"{mib(plan.temporaries)}: {verdict}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class VariablePlan:
    """One state variable as laid out: `group`, `path`, `shape`, `dtype`, `spec`, `bytes` per device."""

    group: str
    path: str
    shape: tuple
    dtype: str
    spec: tuple
    bytes: int


def variable_plans(variables, state):
    """A `VariablePlan` per variable of `variables` (a `TrainState` of Keras variables).

    `state`: the matching `TrainState` of arrays or `jax.ShapeDtypeStruct`s
    with their shardings (`TrainState.abstract_of`).
    """
    return tuple(
        VariablePlan(group, variable.path, tuple(value.shape), str(value.dtype),
                     tuple(value.sharding.spec), sharding.bytes_per_device(value))
        for group, group_variables, values in zip(state._fields, variables, state)
        if values is not None
        for variable, value in zip(group_variables, values))


def variable_lines(plans):
    """One aligned line per `VariablePlan`: group, path, shape, dtype, spec, bytes per device."""
    width = max((len(plan.path) for plan in plans), default=0)
    def spec(plan):  # every dimension's entry, None where it is whole
        entries = list(plan.spec) + [None] * (len(plan.shape) - len(plan.spec))
        return f"PartitionSpec({', '.join(map(repr, entries))})"

    return [f"{plan.group:<14}{plan.path:<{width + 2}}{str(plan.shape):<16}{plan.dtype:<9}"
            f"{spec(plan):<36}{format_bytes(plan.bytes):>10}" for plan in plans]


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


def step_plan(state, step, arguments, layout, resident=False, capacity=None, micro_batches=1,
              batch_size=None, variables=None):
    """The `MemoryPlan` of a compiled train `step`, from its abstract arguments.

    Nothing is placed: `step` (a jitted train program) is lowered and
    compiled against `state` (the abstract `TrainState`, with its
    shardings: `TrainState.abstract_of`) and `arguments` (its abstract
    arguments after the state: a `DeviceBatch` from `sharding.abstract_batch`,
    or the resident arrays and rows, `feed.abstract_arguments`, with
    `resident`), and XLA's memory analysis of it is read. `capacity`: the
    bytes a device has, default what it reports (None on CPU). `variables`:
    the Keras variables of `state` (a `TrainState`), for the plan's
    `variables`.
    """
    per_group = state_bytes(state)
    resident_data = 0
    if resident:  # the resident arrays come first, whole on every device
        resident_data = sum(map(sharding.bytes_per_device, jax.tree.leaves(arguments[0])))
    analysis = step.lower(state, *arguments).compile().memory_analysis()
    peak = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)
    return MemoryPlan(
        state_sharding=layout.state_sharding, devices=layout.batch_shards,
        weights=per_group["trainable"], non_trainable=per_group["non_trainable"],
        optimizer=per_group["optimizer"], metrics=per_group["metrics"],
        arguments=analysis.argument_size_in_bytes, outputs=analysis.output_size_in_bytes,
        temporaries=analysis.temp_size_in_bytes, peak=peak,
        capacity=device_capacity(layout.devices[0]) if capacity is None else capacity,
        resident_data=resident_data, micro_batches=micro_batches, batch_size=batch_size,
        mesh=tuple(sorted(layout.mesh.shape.items(),
                          key=lambda item: item[0] != layout.batch_axis)),
        variables=() if variables is None else variable_plans(variables, state),
        loading=None if variables is None else loading_bytes(variables),
    )


def loading_bytes(variables):
    """Bytes per device of Keras `variables` (a `TrainState`) as they lie, plus the largest one's."""
    sizes = [sharding.bytes_per_device(variable.value)
             for group in variables for variable in group]
    return sum(sizes) + max(sizes, default=0)


def state_bytes(state):
    """`{group: bytes per device}` of a training state as laid out (abstract or placed)."""
    return {name: sum(map(sharding.bytes_per_device, values))
            for name, values in zip(state._fields, state)}


def device_capacity(device):
    """The device's memory in bytes, or None where the platform does not say."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some platforms raise instead of returning None
        return None
    return None if not stats else stats.get("bytes_limit")


def check_arrays(x, y=None):
    """Refuse data that is not arrays, which a plan cannot take its rows from, naming the fix.

    `fit` reads such data as batches (`sources.inputs.is_array_data`); reading
    one here would take a pass from a dataset that reshuffles.
    """
    if inputs.is_array_data(x, y):
        return
    words = f" {inputs.LIST_AS_INPUTS}" if inputs.may_be_inputs(x) else ""
    raise ValueError(
        f"A memory plan takes a few rows of the data as arrays; fit reads this x (a "
        f"{type(x).__name__}) as batches, which a plan does not read. Pass one batch's "
        f"arrays instead as x and y (of a dataset: `next(iter(dataset))`).{words}"
    )


def batch_of(batch, batch_size):
    """`batch`'s rows repeated or cut to `batch_size` rows (only shapes matter here)."""
    rows = sharding.batch_rows(batch)
    if rows == batch_size:
        return jax.tree.map(np.asarray, batch)
    return jax.tree.map(
        lambda a: np.resize(np.asarray(a), (batch_size,) + np.shape(a)[1:]), batch)


def check_fits(memory_plan):
    """Raise a `MemoryError` with the numbers and the fixes if the step cannot fit.

    The fixes the plan tried (`MemoryPlan.remedies`) come first, those that
    fit named as such; then the ones a plan cannot try by itself.
    """
    if memory_plan.fits():
        return
    fitting = [what for what, plan in memory_plan.remedies if plan.fits()]
    tried = (f"These fit: {'; '.join(fitting)}. " if fitting else
             "None of the changes tried fits alone. " if memory_plan.remedies else "")
    raise MemoryError(
        f"One train step needs {memory_plan.peak / 2**30:.2f} GiB per device, and "
        f"the device has {memory_plan.capacity / 2**30:.2f} GiB.\n{memory_plan}\n"
        f"{tried}To fit: split the state over the devices (state_sharding='full', or "
        "'optimizer'), run each batch in slices (micro_batches=M), use a smaller "
        "batch_size, rematerialize activations (build the model under "
        "keras.RematScope(mode='full')), or compute in bfloat16 "
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


def keep_last_good(choice, state, *, steps_in_flight, layout, hosts, plan=None):
    """Whether a fit keeps the last completed state (True) or donates it.

    `choice` (`keep_last_good`) if it is True or False; for `"auto"`, the
    rule of `keeps_fit` on `state` (the built model's abstract state as
    laid out), the devices' free memory now (so data already placed there
    counts) and `plan` (a `MemoryPlan` of the donating step, where fit made
    one). Across processes the answer decides the compiled programs, which
    must be the same everywhere. On XLA:CPU the rule reads only what every
    process computes alike (the state's layout, `steps_in_flight`, the
    mesh's devices per process), so no exchange is needed; where free
    memory is read, the state is kept only if every process would keep it
    (`hosts.any_process`: one host round trip per fit across processes).
    """
    if choice != "auto":
        return choice
    devices = layout.devices
    nbytes = sum(state_bytes(state).values())
    free = least_free([device for device in devices
                       if device.process_index == jax.process_index()])
    if free is None:
        processes = len({device.process_index for device in devices})
        return keeps_fit(nbytes, steps_in_flight, local_devices=len(devices) // processes)
    keep = keeps_fit(nbytes, steps_in_flight, free=free,
                     peak=None if plan is None else plan.peak)
    return not hosts.any_process(not keep)


# -- The plans a trainer makes ------------------------------------------------


def plan_of_fit(trainer, x, y=None, *, batch_size=32, sample_weight=None, data_on_device=False,
                capacity=None):
    """The `MemoryPlan` of the step `trainer`'s fit on this data would run (`ShardedTrainer.memory_plan`).

    On XLA:CPU that is the one `keep_last_good` picks, and a fit on batches
    of this size finds it compiled; on accelerators it is the step that
    donates its state, whose plan a fit reads to choose. With
    `data_on_device` (True or "auto"), the step over the data kept on the
    devices, when a fit with that setting keeps it. `capacity` replaces the
    device's own (to plan for another device); where the step exceeds it,
    the plan holds its `remedies`.

    Raises:
        ValueError: `data_on_device=True` and data a fit could not keep on
            the devices; data that is not arrays.
    """
    data_on_device = options.data_on_device(data_on_device, trainer.hosts.whole_data)
    x = inputs.model_inputs(x, y, trainer.model)  # read as fit reads it
    check_arrays(x, y)
    batch = batch_of(inputs.checked_arrays(x, y, sample_weight), batch_size)
    trainer.build(batch)
    on_cpu = trainer.layout.on_cpu  # the choice needs no plan there
    host_plan = None if on_cpu else plan_of_step(trainer, batch, trainer.programs.train_step)
    programs = trainer.programs.train_programs(
        not on_cpu or not keep_last_good_of(trainer, host_plan))
    if data_on_device is not False:
        batches = trainer.batches_of(x, y, sample_weight, batch_size, False)
        keep, why_not = feed.decide(batches, choice=data_on_device, layout=trainer.layout,
                                    hosts=trainer.hosts, plan=host_plan)
        if keep:
            return plan_of_step(trainer, batch, programs["resident_step"],
                                feed.abstract_arguments(batches, trainer.layout), capacity)
        if data_on_device is True:
            raise feed.refusal(why_not)
    donate = programs is trainer.programs.train_programs(True)
    if host_plan is None or capacity is not None:
        host_plan = plan_of_step(trainer, batch, programs["train_step"], capacity=capacity)
    return with_remedies(trainer, batch, host_plan, donate)


def plan_of_step(trainer, batch, step, arguments=None, capacity=None):
    """The `MemoryPlan` of `trainer`'s train `step` on one global host `batch`.

    `arguments`: the step's abstract arguments after the state, where they
    are the resident data's (`feed.abstract_arguments`); by default the
    batch's `DeviceBatch`. The model must be built (`trainer.build`).
    """
    state = TrainState.abstract_of(trainer.model, trainer.state_layout())
    rows = sharding.batch_rows(batch)
    settings = dict(capacity=capacity, micro_batches=trainer.micro_batches, batch_size=rows,
                    variables=TrainState.variables_of(trainer.model))
    if arguments is None:
        like = sharding.abstract_batch(batch, rows, trainer.layout)
        return step_plan(state, step, (like,), trainer.layout, **settings)
    return step_plan(state, step, arguments, trainer.layout, resident=True, **settings)


def with_remedies(trainer, batch, plan, donate=True):
    """`plan`, with the changes a fit could make planned where the step does not fit (`remedies_of`).

    `donate`: whether the planned step donates its state, as the remedies' will.
    """
    if plan.fits():
        return plan
    return dataclasses.replace(
        plan, remedies=tuple(remedies_of(trainer, batch, plan.capacity, donate)))


def remedies_of(trainer, batch, capacity, donate=True):
    """`(what, MemoryPlan)` of each change a fit could make alone, compiled and planned.

    A split state (`state_sharding` "optimizer", "full", where not already),
    micro-batches (2, 4, 8, where the model allows them and the batch has
    the rows), and half the batch. Each is planned as the fit's step with
    that one change, on the same devices and `capacity`, donating its state
    or not as `donate` says.
    """
    layout, model = trainer.layout, trainer.model
    rows = sharding.batch_rows(batch)
    changes = [(f"state_sharding={mode!r}", dict(state_sharding=mode), batch)
               for mode in ("optimizer", "full")
               if sharding.MODES.index(mode) > sharding.MODES.index(layout.state_sharding)]
    if model_checks.allows_micro_batches(model):
        changes += [(f"micro_batches={count}", dict(micro_batches=count), batch)
                    for count in (2, 4, 8) if count > trainer.micro_batches and count <= rows]
    if rows > 1:
        changes.append((f"batch_size={rows // 2}", {}, batch_of(batch, rows // 2)))
    plans = []
    for what, change, planned in changes:
        mode = change.get("state_sharding", layout.state_sharding)
        micro_batches = change.get("micro_batches", trainer.micro_batches)
        trial = sharding.Layout(layout.mesh, mode, layout.batch_axis)
        program = programs_lib.Programs(model, trial, unroll=trainer.unroll, donate=donate,
                                        micro_batches=micro_batches).train_step
        state = TrainState.abstract_of(model, trial.state_shardings(TrainState.variables_of(model)))
        count = sharding.batch_rows(planned)
        like = sharding.abstract_batch(planned, count, trial)
        plans.append((what, step_plan(state, program, (like,), trial, capacity=capacity,
                                      micro_batches=micro_batches, batch_size=count)))
    return plans


def keep_last_good_of(trainer, plan=None):
    """Whether `trainer`'s next fit keeps the last completed state (`keep_last_good`).

    `plan`: the fit's `MemoryPlan` of the donating step, where it made one.
    """
    return keep_last_good(
        trainer.keep_last_good, TrainState.abstract_of(trainer.model, trainer.state_layout()),
        steps_in_flight=trainer.steps_in_flight, layout=trainer.layout, hosts=trainer.hosts,
        plan=plan)
