"""The train programs of a fit: compiled once per call shape, the epoch's rest ahead of time.

An epoch of array data has a plan known before it starts: its calls of K
steps, then the remainder (a partial last batch, or the last steps that do
not fill a call of K), each of its own shape, so each its own program.
Left to `jax.jit`, the remainder's program compiles when it is first
called, at the end of epoch 1, while the devices wait. `CompilingFeed`
wraps a fit's feed (`loop.HostFeed` or `resident.ResidentFeed`) and
compiles every program explicitly with `jitted.lower(...).compile()`,
whose executable `jax.jit` then reuses for the same shapes and shardings
(no second compile; `tests/test_programs.py` counts them): a new shape's
right before its first call, and, once the epoch's first call is
dispatched, the plan's other shapes, in a background thread while the
epoch's steps run (a call that needs one first waits for it). On
accelerators the host is idle while the devices run; on XLA:CPU, where
the devices are the host's own cores, the thread competes with the steps,
and whether it beats compiling in line was not settled by the runs made
(README, "Where the time goes").

Each compiled program also says what it costs: `Compiled.cost_analysis()`
gives the FLOPs one device runs per call, so the feed counts the FLOPs of
every call of an epoch (`flops`) at no extra compile, for
`keras_dp.timing`.
"""

import concurrent.futures
import threading

import jax

from keras_dp import mesh as mesh_lib
from keras_dp import placement
from keras_dp import resident


class CompilingFeed:
    """A fit's feed, its programs compiled per call shape and their FLOPs counted.

    Has the feed's interface (`epoch`, `call`); `flops` is the FLOPs of the
    calls since the current epoch began (summed over the devices), or None
    where XLA gives no count.

    Args:
        feed: the feed to run (`loop.HostFeed`, `resident.ResidentFeed`);
            its `program(steps)` is `(jitted, leading arguments)`.
        trainer: the `ShardedTrainer` (its mesh, `steps_per_execution`,
            `unroll`).
        batches: the fit's host batches, for the epoch's plan
            (`placement.planned_calls`).
    """

    background = True  # compile the plan's programs in a thread (False: in line)

    def __init__(self, feed, trainer, batches):
        self._feed, self._batches = feed, batches
        self._mesh = trainer.mesh
        self._steps_per_execution, self._unroll = trainer.steps_per_execution, trainer.unroll
        self._multiprocess = trainer.multiprocess
        self._programs = {}  # call key -> Compiled, or a Future of one
        self._flops = {}  # call key -> FLOPs of one call (None: unknown), once compiled
        self._plan = None
        self.flops = 0.0

    def epoch(self, epoch, skip):
        """The feed's `(steps, batch)` for epoch `epoch`; plans the epoch's programs."""
        self.flops = 0.0
        self._plan = None if self._multiprocess else placement.planned_calls(
            self._batches, self._steps_per_execution, skip)
        return self._feed.epoch(epoch, skip)

    def call(self, state, steps, batch):
        """Run one call as the feed does, its program compiled first if new."""
        key = call_key(steps, batch)
        if key not in self._flops:  # cost analysis walks the program: once per program
            self._flops[key] = self._call_flops(self._compiled(state, steps, batch, key), steps)
        flops = self._flops[key]
        self.flops = None if flops is None or self.flops is None else self.flops + flops
        result = self._feed.call(state, steps, batch)
        if self._plan is not None:  # the epoch's first call is on its way
            plan, self._plan = self._plan, None
            try:
                self._ahead(result[0], steps, batch, plan)
            except Exception:  # noqa: BLE001 - it compiles, or raises, at its first call
                pass  # never lose the state `result` holds to an early compile
        return result

    def _compiled(self, state, steps, batch, key):
        """The program of a call (`key`: its `call_key`), compiled now unless ahead of time."""
        program = self._programs.get(key)
        if isinstance(program, concurrent.futures.Future):
            try:
                program = program.result()
            except Exception:  # noqa: BLE001 - compiled again below, where it raises
                program = None
        if program is None:
            jitted, leading = self._feed.program(steps)
            program = jitted.lower(state, *leading, batch).compile()
        self._programs[key] = program
        return program

    def _ahead(self, state, steps, batch, plan):
        """Compile the plan's programs not compiled yet, for calls like `batch`.

        Traced here (Keras's tracing stays on this thread); compiled here
        or in a background thread (`background`).
        """
        state = jax.tree.map(abstract, state)
        for plan_steps, rows in plan:
            like = like_batch(batch, steps, plan_steps, rows, self._mesh)
            key = call_key(plan_steps, like)
            if key in self._programs:
                continue
            jitted, leading = self._feed.program(plan_steps)
            lowered = jitted.lower(state, *leading, like)
            self._programs[key] = (_in_background(lowered.compile) if self.background
                                   else lowered.compile())

    def _call_flops(self, compiled, steps):
        """FLOPs of one call of `compiled`, all devices, or None if XLA gives none.

        XLA counts a loop's body once (measured on XLA:CPU): a K-step call
        whose scan is not fully unrolled runs `unroll` steps per counted
        body and `K % unroll` more unrolled after it, so the count scales
        by K over the steps counted.
        """
        flops = cost_flops(compiled)
        if flops is None:
            return None
        counted = steps
        if 0 < self._unroll < steps:
            counted = self._unroll + steps % self._unroll
        return flops * mesh_lib.num_devices(self._mesh) * steps / counted


def cost_flops(compiled):
    """The FLOPs XLA's cost analysis gives a compiled program (per device), or None."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis
        return None
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def call_key(steps, batch):
    """What makes a call's program: its step count, the batch's structure and shapes."""
    leaves = jax.tree.leaves(batch)
    return (steps, jax.tree.structure(batch),
            tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves))


def abstract(array):
    """A `jax.ShapeDtypeStruct` with `array`'s shape, dtype, sharding and weak type."""
    return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding,
                                weak_type=jax.typeof(array).weak_type)


def like_batch(batch, steps, new_steps, rows, mesh):
    """An abstract batch of a call of `new_steps` steps of `rows` rows, like `batch`.

    `batch` is a call of `steps` steps: a `placement.DeviceBatch` (one
    batch, or a stack of `steps`) or a `resident.Rows`.
    """
    if isinstance(batch, resident.Rows):
        start = jax.ShapeDtypeStruct(() if new_steps == 1 else (new_steps,), "int32",
                                     sharding=mesh_lib.replicated(mesh))
        return resident.Rows(batch.order, start, rows)
    padded = rows + -rows % mesh_lib.num_devices(mesh)
    lead = (padded,) if new_steps == 1 else (new_steps, padded)
    sharding = (mesh_lib.batch_sharded(mesh) if new_steps == 1
                else mesh_lib.stacked_batch_sharded(mesh))
    drop = 1 if steps == 1 else 2

    def like(array):
        return jax.ShapeDtypeStruct(lead + tuple(array.shape[drop:]), array.dtype,
                                    sharding=sharding, weak_type=jax.typeof(array).weak_type)

    return placement.DeviceBatch(jax.tree.map(like, batch.data), rows)


def _in_background(compile_fn):
    """A Future of `compile_fn()`, run by a daemon thread (a fit never waits on it to end)."""
    future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(compile_fn())
        except Exception as error:  # noqa: BLE001 - raised where the program is needed
            future.set_exception(error)

    threading.Thread(target=run, name="keras_dp-compile", daemon=True).start()
    return future
