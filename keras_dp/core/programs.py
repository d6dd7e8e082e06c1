"""A trainer's jitted programs, compiled once per call shape, the rest ahead of use.

`Programs` is the set of jitted programs a `ShardedTrainer` holds
(`trainer.programs`), made by `keras_dp.core.steps`; the loops call them
through it.

An epoch of array data has a plan known before it starts: its calls of K
steps, then the remainder (a partial last batch, or the last steps that do
not fill a call of K), each of its own shape, so each its own program.
Left to `jax.jit`, the remainder's program compiles when it is first
called, at the end of epoch 1, while the devices wait. `CompilingFeed`
wraps a fit's feed (`feed.HostFeed` or `feed.ResidentFeed`) and
compiles every program explicitly with `jitted.lower(...).compile()`,
whose executable `jax.jit` then reuses for the same shapes and shardings
(no second compile; `tests/test_programs.py` counts them): a new shape's
right before its first call, and, once the epoch's first call is
dispatched, the plan's other shapes, in a background thread while the
epoch's steps run (a call that needs one first waits for it). On
accelerators the host is idle while the devices run; on XLA:CPU, where
the devices are the host's own cores, the thread competes with the steps,
and whether it beats compiling in line was not settled by the runs made
(docs/guides/performance.md).

The validation's test programs are planned the same way (`EvalPrograms`:
every call shape of array data, the first batch's calls of a dataset), and
`CompilingFeed` lowers them right after the fit's first train call too;
one background thread compiles them after the epoch's train programs, in
the order they are needed (`compile_ahead`), so that validation at the
end of epoch 1 finds them compiled instead of compiling while the devices
wait. `keras_dp.core.evaluate.evaluate` runs its calls through an `EvalPrograms`
in any case: a plain `evaluate` compiles its other call shapes after its
first call, as an epoch does.

Each compiled program also says what it costs: `Compiled.cost_analysis()`
gives the FLOPs one device runs per call, so the feed counts the FLOPs of
every call of an epoch (`flops`) at no extra compile, for
`keras_dp.diagnostics.timing`.
"""

import concurrent.futures
import threading

import jax

from keras_dp import sharding
from keras_dp.core import feed as feed_lib
from keras_dp.core import steps as steps_lib


class Programs:
    """A trainer's jitted programs, each for one step and for K steps per call.

    Made by `keras_dp.core.steps`'s factories for `model` on `layout`:
    `train_step(state, batch) -> (state, logs)` and `train_steps(state,
    stacked) -> (state, logs, finite)`; `resident_step(state, arrays, rows)`
    and `resident_steps`, the same over data kept on the devices;
    `test_step`/`test_steps` and `predict_step`/`predict_steps`. With
    `micro_batches`, each train step sums its gradient over that many slices
    of its batch (`keras_dp.core.micro`). The train
    programs donate their state or keep it, as `use` chose last (a fit
    chooses: `ShardedTrainer.keeps_last_good`); each choice's programs are
    made once. `train(steps)`, `resident(steps)`, `test(steps)` and
    `predict(steps)` pick the program of a call of `steps` steps.
    """

    def __init__(self, model, layout, *, unroll, donate=True, micro_batches=1):
        self._model, self._layout, self._unroll = model, layout, unroll
        self._micro_batches = micro_batches
        self._train = {}  # donate -> the four train programs, by name
        self.test_step, self.test_steps, self.predict_step, self.predict_steps = (
            make(model, layout, multi=multi, unroll=unroll)
            for make in (steps_lib.make_test_program, steps_lib.make_predict_program)
            for multi in (False, True))
        self.use(donate)  # sets `donates`

    def use(self, donate):
        """Train with the programs that donate their state (`donate`), or keep it."""
        for name, program in self.train_programs(donate).items():
            setattr(self, name, program)
        self.donates = donate

    def train_programs(self, donate):
        """The four train programs that donate their state, or keep it, by name; each made once."""
        if donate not in self._train:
            self._train[donate] = {
                name: steps_lib.make_train_program(
                    self._model, self._layout, multi=multi, unroll=self._unroll,
                    donate=donate, resident=resident, micro_batches=self._micro_batches)
                for name, multi, resident in (("train_step", False, False),
                                              ("train_steps", True, False),
                                              ("resident_step", False, True),
                                              ("resident_steps", True, True))}
        return self._train[donate]

    def train(self, steps):
        """The train program of a call of `steps` steps (one step, or K in one program)."""
        return self.train_step if steps == 1 else self.train_steps

    def resident(self, steps):
        """The train program over resident data of a call of `steps` steps."""
        return self.resident_step if steps == 1 else self.resident_steps

    def test(self, steps):
        """The test program of a call of `steps` steps."""
        return self.test_step if steps == 1 else self.test_steps

    def predict(self, steps):
        """The predict program of a call of `steps` steps."""
        return self.predict_step if steps == 1 else self.predict_steps


def run_call(feed, state, steps, batch):
    """Run one compiled call of `feed`'s program for `steps` steps: `(state, logs, finite)`.

    `finite` counts a K-step call's steps with a finite loss; 0 for one
    step (if its loss is not finite, it is the first bad one).
    """
    jitted, leading = feed.program(steps)
    result = jitted(state, *leading, batch)
    return (*result, 0) if steps == 1 else result


class CompilingFeed:
    """A fit's feed, its programs compiled per call shape and their FLOPs counted.

    `epoch` is the feed's; `call` runs a call (`run_call`), its program
    compiled first if new. `flops` is the FLOPs of the calls since the
    current epoch began (summed over the devices), or None where XLA gives
    no count.

    Args:
        feed: the feed to run (`feed.HostFeed`, `feed.ResidentFeed`);
            its `program(steps)` is `(jitted, leading arguments)`.
        batches: the fit's `Source`, for the epoch's plan
            (`feed.planned_calls`).
        layout: the `keras_dp.sharding.Layout`.
        steps_per_execution, unroll: the trainer's.
        ahead: whether to compile the plan ahead (not across processes).
        validation: the validation's `EvalPrograms`, compiled ahead after
            the fit's first call (after the train programs), or None.
    """

    background = True  # compile ahead in a thread (False: in line); test programs too

    def __init__(self, feed, batches, *, layout, steps_per_execution, unroll, ahead=True,
                 validation=None):
        self._feed, self._batches, self._validation = feed, batches, validation
        self._layout, self._ahead = layout, ahead
        self._steps_per_execution, self._unroll = steps_per_execution, unroll
        self._programs = {}  # call key -> Compiled, or a Future of one
        # What `close` cancels: the compiles ahead of these programs and the validation's.
        self._stores = [self._programs] + ([] if validation is None else [validation.programs])
        self._flops = {}  # call key -> FLOPs of one call (None: unknown), once compiled
        self._plan = None
        self.flops = 0.0

    def close(self):
        """Cancel the compiles ahead not started yet: the fit has ended."""
        for store in self._stores:
            cancel_ahead(store)

    def epoch(self, epoch, skip):
        """The feed's `(steps, batch)` for epoch `epoch`; plans the epoch's programs."""
        self.flops = 0.0
        self._plan = None if not self._ahead else feed_lib.planned_calls(
            self._batches, self._steps_per_execution, skip)
        return self._feed.epoch(epoch, skip)

    def call(self, state, steps, batch):
        """Run one call as the feed does, its program compiled first if new."""
        key = call_key(steps, batch)
        if key not in self._flops:  # cost analysis walks the program: once per program
            self._flops[key] = self._call_flops(self._compiled(state, steps, batch, key), steps)
        flops = self._flops[key]
        self.flops = None if flops is None or self.flops is None else self.flops + flops
        result = run_call(self._feed, state, steps, batch)
        if self._plan is not None or self._validation is not None:  # a first call is on its way
            plan, self._plan = self._plan or [], None
            validation, self._validation = self._validation, None
            try:
                compile_ahead(self._lowered(result[0], steps, batch, plan, validation))
            except Exception:  # noqa: BLE001 - it compiles, or raises, at its first call
                pass  # never lose the state `result` holds to an early compile
        return result

    def _compiled(self, state, steps, batch, key):
        """The program of a call (`key`: its `call_key`), compiled now unless ahead of time."""
        program = finished(self._programs, key)
        if program is None:
            jitted, leading = self._feed.program(steps)
            program = jitted.lower(state, *leading, batch).compile()
        self._programs[key] = program
        return program

    def _lowered(self, state, steps, batch, plan, validation):
        """The plan's programs not compiled yet, for calls like `batch`, then `validation`'s.

        Lowered here (Keras's tracing stays on this thread), for
        `compile_ahead`: a list of `(store, key, lowered)`.
        """
        state = jax.tree.map(abstract, state)
        entries = []
        for plan_steps, rows in plan:
            like = like_batch(self._feed, batch, steps, plan_steps, rows, self._layout)
            key = call_key(plan_steps, like)
            if key not in self._programs:
                jitted, leading = self._feed.program(plan_steps)
                entries.append((self._programs, key, jitted.lower(state, *leading, like)))
        if validation is not None:  # its first call's arguments: the state's weights
            entries += validation.lowered(state.weights, state.metrics)
        return entries

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
        return flops * len(self._layout.devices) * steps / counted


class EvalPrograms:
    """The test programs of one evaluation's data, the planned ones compiled ahead.

    `call` runs a test call as `keras_dp.core.evaluate.evaluate` does, once its
    program is ready if it is being compiled ahead (then `jax.jit` finds
    it compiled: no second compile). The plan's programs are compiled
    ahead once (`lowered`, then `compile_ahead`): during a fit's first
    epoch for its validation (`CompilingFeed`), else after the first call.

    Args:
        programs: the trainer's `Programs` (its test programs).
        batches: the evaluation's `Source`, for the plan (`eval_plan`).
        layout: the `keras_dp.sharding.Layout`.
        steps_per_execution: the trainer's K.
        ahead: whether to compile the plan ahead (not across processes).
    """

    ahead = True  # False: each program compiles at its first call (`jax.jit`'s own way)

    def __init__(self, programs, batches, *, layout, steps_per_execution, ahead=True):
        self._programs, self._layout, self._template = programs, layout, batches.peek()
        self._plan = None if not ahead or not self.ahead else eval_plan(
            batches, steps_per_execution)
        self.programs = {}  # call key -> Compiled, a Future of one, or None (jax.jit's)

    def close(self):
        """Cancel the compiles ahead not started yet: the evaluation has ended."""
        cancel_ahead(self.programs)

    def call(self, weights, metrics, steps, batch):
        """One test call: `(non_trainable, metrics, logs)`, as the trainer's test step gives."""
        key = call_key(steps, batch)
        finished(self.programs, key)  # compiling ahead: wait for it
        self.programs.setdefault(key, None)
        result = self._programs.test(steps)(weights, metrics, batch)
        if self._plan is not None:  # the first call: compile the rest ahead
            like = jax.tree.map(abstract, ((weights[0], result[0]), result[1]))
            try:
                compile_ahead(self.lowered(*like))
            except Exception:  # noqa: BLE001 - it compiles, or raises, at its first call
                pass
        return result

    def lowered(self, weights, metrics):
        """The plan's programs not compiled yet, lowered for `compile_ahead`, once.

        `weights` and `metrics` are like (`abstract`) those of the calls.
        Lowered here: call it on the thread that traces Keras.
        """
        plan, self._plan = self._plan or [], None
        entries = []
        for steps, rows in plan:
            like = sharding.abstract_batch(self._template, rows, self._layout, steps)
            key = call_key(steps, like)
            if key not in self.programs:
                entries.append((self.programs, key,
                                self._programs.test(steps).lower(
                                    weights, metrics, like)))
        return entries


def eval_plan(batches, steps_per_execution):
    """The distinct `(steps, rows)` of an evaluation's calls, as far as known before it.

    Arrays: all of them (`feed.planned_calls`). A dataset: the calls
    of its first batch's rows, K at a time (one at a time where K is 1 or
    the dataset has fewer batches); its other shapes (a partial last
    batch) are seen only when they come, and compile then.
    """
    plan = feed_lib.planned_calls(batches, steps_per_execution)
    if plan is not None:
        return plan
    steps = steps_per_execution
    if batches.steps is not None and batches.steps < steps:
        steps = 1
    return [(steps, sharding.batch_rows(batches.peek()))]


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


def like_batch(feed, batch, steps, new_steps, rows, layout):
    """An abstract argument of a call of `new_steps` steps of `rows` rows, like `batch`.

    `batch` is a call of `steps` steps of `feed` (a `DeviceBatch`, one
    batch or a stack of `steps`, or a resident `feed.Rows`); the feed
    knows its shape (`like`).
    """
    return feed.like(batch, steps, new_steps, rows, layout)


def compile_ahead(entries):
    """Compile `entries`, `(store, key, lowered)`, in order; `store[key]` gets each.

    In one thread (a fit never waits on it to end), each `store[key]` a
    Future of its program, when `CompilingFeed.background`; else here.
    Where compiling fails, or was cancelled (`cancel_ahead`), `finished`
    gives None and the call compiles, and raises, itself. The thread is
    not a daemon: a daemon killed mid-compile when Python exits (after
    Ctrl-C in a fit) aborts the process ("terminate called after
    throwing ..."), so Python waits for the compile running, and the
    ones not started are cancelled when their fit or evaluation ends.
    """
    if not CompilingFeed.background:
        for store, key, lowered in entries:
            store[key] = lowered.compile()
        return
    futures = [concurrent.futures.Future() for _ in entries]
    for (store, key, _), future in zip(entries, futures):
        store[key] = future

    def run():
        for (_, _, lowered), future in zip(entries, futures):
            if not future.set_running_or_notify_cancel():
                continue  # its fit or evaluation has ended
            try:
                future.set_result(lowered.compile())
            except Exception as error:  # noqa: BLE001 - raised where the program is needed
                future.set_exception(error)

    if entries:
        threading.Thread(target=run, name="keras_dp-compile", daemon=False).start()


def cancel_ahead(store):
    """Cancel the compiles ahead of `store` that have not started (the running one ends)."""
    for program in list(store.values()):
        if isinstance(program, concurrent.futures.Future):
            program.cancel()


def finished(store, key):
    """`store[key]`'s compiled program once ready (waiting for a Future), or None."""
    program = store.get(key)
    if isinstance(program, concurrent.futures.Future):
        try:
            program = program.result()
        except Exception:  # noqa: BLE001 - the call compiles again, where it raises
            program = None
    return program
