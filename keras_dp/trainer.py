"""`ShardedTrainer`: one Keras model, one mesh, compiled steps; the composition root.

Its parts are public so a user can run training by hand (`build`,
`init_state`, `shard`, `train_step`, `write_back`), and `fit`, `evaluate`
and `predict` run them the way `model.fit`, `model.evaluate` and
`model.predict` do, with Keras's callbacks and progress bar. The trainer
wires the layers together and does little itself: `keras_dp.options`
checks the arguments, `keras_dp.sharding` says where every array lives,
`keras_dp.sources` reads the user's data as host batches,
`keras_dp.keras.build` builds the model from them, `keras_dp.core` feeds
them to the compiled programs and runs the loops, `keras_dp.checkpoint`
saves and resumes, `keras_dp.diagnostics` plans and describes, and
`keras_dp.multihost` holds what differs when the mesh spans processes.

The route of a batch of arrays: `fit` (here) -> `keras_dp.core.loop.fit`
-> its feed (`keras_dp.core.feed`: the source's rows, on the devices) ->
`keras_dp.core.programs` -> the compiled step (`keras_dp.core.steps`, the
batch cut by `keras_dp.sharding`), the state held between calls by
`keras_dp.core.live`.

The Keras model is the record of truth between calls; during `fit`, the
device state is, and the model is updated from it whenever a callback looks,
at the end of fit, and whenever `fit` exits by an exception or an interrupt.
"""

from keras_dp import diagnostics
from keras_dp import options
from keras_dp import prepare
from keras_dp import sharding
from keras_dp import sources
from keras_dp.checkpoint import store as checkpoint
from keras_dp.core import evaluate as evaluate_lib
from keras_dp.core import loop
from keras_dp.core import programs as programs_lib
from keras_dp.core import state as state_lib
from keras_dp.keras import build as build_lib
from keras_dp.multihost import hosts as hosts_lib


class ShardedTrainer:
    """Synchronous data-parallel training of a Keras model over a JAX mesh.

    Args:
        model: a `keras.Model` (Sequential, Functional or subclassed), or
            any Keras layer with Keras's JAX trainer mixed in, as Keras's
            own tests write models. It may be unbuilt; it is built from the
            first batch, as in `model.fit`.
        optimizer, loss, metrics: as in `model.compile`; each one given
            overrides what the model was compiled with. To train, an
            uncompiled model needs at least `optimizer` (and `loss`, unless
            its losses come from `add_loss`); to predict, neither.
        mesh: a 1-D `jax.sharding.Mesh` or `keras.distribution.DeviceMesh`;
            its one axis, whatever its name, splits the batch (see
            `keras_dp.make_mesh`; `trainer.mesh` names it `"batch"`, and
            `trainer.layout` says where every array lives on it).
        devices: the devices to train on (default: all of JAX's devices).
            Use either `mesh` or `devices`.
        distribution: a `keras.distribution.ModelParallel` (or
            `DataParallel`) to train under, as Keras's `fit` would: on its
            device mesh of any number of axes, each batch split over its
            `batch_dim_name` axis (unevenly where it must) and replicated
            over the others, each variable laid out as its layout map says
            (`state_sharding` splits what it leaves whole over the batch
            axis). Default: the distribution active when the trainer is
            made (`keras.distribution.set_distribution`, or inside
            `distribution.scope()`), else keras_dp's 1-D mesh. Not with
            `mesh` or `devices`. See docs/guides/model-axis.md.
        seed: seed of the per-epoch shuffle of array data.
        steps_per_execution: steps per compiled call (default: the model's,
            from `compile`, else 1), in `fit`, validation, `evaluate` and
            `predict`: one program runs K stacked batches, each step exactly
            a single step (a group that cannot be stacked runs one by one);
            callbacks are called once per K batches, as in `model.fit`.
        unroll: steps unrolled per iteration of the compiled scan, as in
            `jax.lax.scan` (default: all K on CPU, where XLA runs a rolled
            loop slower; 1 elsewhere).
        prefetch: how many batches (or stacks of K) a background thread
            prepares and copies to the devices ahead of the step that needs
            them; 0 prepares each in line.
        steps_in_flight: at most this many dispatched calls are unfinished,
            the newest included: with 1 each call finishes before the next
            is dispatched, with 2 one runs while the next is queued.
            Defaults to 1 on CPU (several queued cross-device all-reduces
            can deadlock XLA:CPU's thread pool) and 2 elsewhere.
        state_sharding: where the training state lives (`keras_dp.sharding`):
            `"replicated"` (default; a full copy on every device),
            `"optimizer"` (optimizer slots and metrics split over the
            devices, each device updating its slice, ZeRO-1/2) or `"full"`
            (weights split too, gathered where a layer needs them, FSDP).
            Every mode computes the same steps.
        data_on_device: keep array training data on the devices during
            `fit` and gather each step's rows there, bitwise the same
            training without a host-to-device copy per batch (see
            `keras_dp.core.feed`): `"auto"` (default; `None` too) when the
            data is arrays on one process and fits, with a warning when it
            does not fit; `True` or raise; `False` never.
        keep_last_good: keep the last completed step's state while the next
            runs, so a step failing at run time loses no completed step, at
            `steps_in_flight` more states per device (no donation): `"auto"`
            (default; `None` too) when that fits comfortably
            (`keras_dp.diagnostics.memory.keeps_fit`), `True`, or `False`.
        compilation_cache: JAX's persistent compilation cache, so that a
            rerun loads its compiled steps from disk: `True` (default) sets
            a per-user directory unless `KERAS_DP_COMPILATION_CACHE=0` or
            JAX has one already; a path uses that; `False` leaves JAX's
            setting alone (`keras_dp.diagnostics.compilation_cache`).
        micro_batches: run each global batch as M slices in turn inside the
            step, their gradients summed into one update (`keras_dp.core.micro`):
            the same step up to float summation order, activations about 1/M.
            Not with BatchNormalization or a model's own `train_step`.

    Attributes:
        timings: after `fit`, one dict per epoch of where its time went:
            seconds waiting for input, in compiled steps, in callbacks and
            in validation, samples and FLOPs per second, and the fraction
            of the devices' peak where known (`keras_dp.diagnostics.timing`).
        programs: the jitted programs the loops call, for one step and for
            K steps of each kind (`keras_dp.core.programs.Programs`).
        layout: where every array lives (`keras_dp.sharding.Layout`).
        hosts: what differs across processes (`keras_dp.multihost.hosts`).

    Raises:
        TypeError: `model` is not a Keras model (see `model`).
        TypeError: `seed`, `prefetch` or `unroll` is not an integer.
        ValueError: `steps_per_execution` or `steps_in_flight` is not an
            int of at least 1 (their messages say what each counts), the
            mesh is not 1-D, or an argument is out of range.
        ValueError: `optimizer`, `loss` or `metrics` is given for a model
            whose own `compile` takes arguments Keras's does not (a
            `Distiller`'s `alpha`): compile it yourself instead.
    """

    def __init__(self, model, optimizer=None, loss=None, metrics=None, mesh=None,
                 devices=None, seed=0, steps_per_execution=None, unroll=None,
                 prefetch=2, steps_in_flight=None, state_sharding="replicated",
                 data_on_device="auto", keep_last_good="auto", compilation_cache=True,
                 micro_batches=1, distribution=None):
        self.builder = build_lib.Builder(model)  # refuses what keras_dp cannot train
        self.layout = prepare.layout_of(model, distribution=distribution, mesh=mesh,
                                        devices=devices, state_sharding=state_sharding)
        self.compilation_cache_dir = diagnostics.compilation_cache.enable(compilation_cache)
        build_lib.compile_model(model, optimizer, loss, metrics)
        self.model, self.mesh = model, self.layout.mesh
        self.state_sharding = self.layout.state_sharding
        self._layout_reported = False
        self.seed = options.check_count("seed", seed, 0)
        prefetch = options.check_count("prefetch", prefetch, 0)
        self.timings = []
        self.steps_in_flight = options.steps_in_flight(steps_in_flight, self.layout.on_cpu)
        self.steps_per_execution = options.steps_per_execution(model, steps_per_execution)
        self.hosts = hosts_lib.hosts_for(self.layout, prefetch)
        self.data_on_device = options.data_on_device(data_on_device, self.hosts.whole_data)
        self.keep_last_good = options.check_auto("keep_last_good", keep_last_good)
        self.unroll = options.unroll(unroll, self.steps_per_execution, self.layout.on_cpu)
        self.micro_batches = options.check_count("micro_batches", micro_batches, 1)
        self.programs = programs_lib.Programs(model, self.layout, unroll=self.unroll,
                                              donate=self.keep_last_good is not True,
                                              micro_batches=self.micro_batches)

    @property
    def keeps_last_good(self):
        """Whether the train programs keep their input state (chosen by each fit)."""
        return not self.programs.donates

    @property
    def num_devices(self):
        """The number of parts each global batch is split into (the batch axis's devices)."""
        return self.layout.batch_shards

    @property
    def multiprocess(self):
        """Whether the mesh spans several processes."""
        return self.layout.spans_processes

    # -- The parts, for training by hand ------------------------------------

    def build(self, batch, for_training=True):
        """Build the model, its loss, metrics and optimizer from a host batch.

        As `model.fit` builds it (`keras_dp.keras.build.build`), with or
        without labels; `for_training=False` builds the layers only (enough
        to predict, for an uncompiled model too).

        Also checks, before anything is compiled, that the labels fit the
        model's output under its loss.

        Raises:
            ValueError: the model cannot be built on `x`, or the labels do
                not fit its output; a layout that does not divide its
                variable; or a Keras distribution other than the trainer's
                was set since the trainer was made
                (`keras_dp.keras.layouts.check_current`; `fit`, `evaluate`
                and `predict` build first, so they refuse it too).
        """
        prepare.check_distribution(self)
        with self.layout.tracing():  # variables created in the distribution's layouts
            self.builder.build(sources.unpack(batch), for_training)
        if for_training:  # the model built: its layers are known now
            self.builder.check_micro_batches(self.micro_batches)
        if not self._layout_reported:
            self._layout_reported = True
            prepare.report_layout(self)

    def init_state(self):
        """Return the model's current variables as a `TrainState` on the mesh.

        Laid out as `state_sharding` says: each array replicated, or split
        over the batch axis (`keras_dp.sharding`; `describe()` shows which).

        Raises:
            ValueError: the model, its metrics or optimizer are not built,
                or a layer's `trainable` changed since the optimizer was
                built (`keras_dp.checks.model.check_trainable_unchanged`).
        """
        self.builder.require_built("The training state")
        self.builder.check_trainable_unchanged()
        return state_lib.TrainState.from_model(self.model, self.mesh, self.state_layout())

    def state_layout(self):
        """The sharding of every state variable, as a `TrainState` of lists.

        Raises:
            ValueError: the model, its metrics or optimizer are not built
                (their variables do not exist yet; call `build` first).
        """
        self.builder.require_built("The state layout")
        return self.layout.state_shardings(state_lib.TrainState.variables_of(self.model))

    def shard(self, batch):
        """Put a host batch `(x, y[, sample_weight])` on the mesh, split by rows.

        Returns a `sharding.DeviceBatch`. Across processes, `batch` is this
        process's part of the global batch, and every process must call
        `shard` for the same step (it exchanges the row counts: one host
        round trip; `fit` agrees on a whole epoch's counts at once).
        """
        return self.hosts.shard(sources.unpack(batch))

    def train_step(self, state, batch):
        """Run one compiled step on a sharded batch: `(state, logs)`.

        `state` is donated unless the trainer keeps the last good state
        (`keeps_last_good`): use the returned state, never the old one.
        `logs` hold the metrics' running values since they were last reset
        (`reset_metrics`), as Keras's logs within an epoch do.

        Raises:
            TypeError: `state` is not a `TrainState`, or `batch` was not
                placed with `shard`.
            ValueError: `state` was donated to an earlier step, the
                batch has no labels and the model's loss needs them, or a
                Keras distribution other than the trainer's is active.
        """
        prepare.check_distribution(self)
        state_lib.check_usable(state, "trainer.train_step")
        sharding.check_device_batch(batch)
        if batch.data[1] is None:  # no labels: refused as `build` refuses them, if needed
            self.builder.build(batch.data)
        return self.programs.train_step(state, batch)

    def reset_metrics(self, state):
        """Return `state` with its metrics reset, as `model.fit` does at each epoch's start.

        The model's own metric variables are reset too.
        """
        state_lib.check_usable(state, "trainer.reset_metrics")
        metrics = state_lib.fresh_metrics(self.model, self.mesh, self.state_layout().metrics)
        return state._replace(metrics=metrics)

    def write_back(self, state):
        """Copy `state` into the Keras model's variables.

        Raises:
            TypeError, ValueError: as `train_step`, for `state`.
        """
        state_lib.check_usable(state, "trainer.write_back")
        state_lib.write_back(state, self.model)

    def memory_plan(self, x, y=None, *, batch_size=32, sample_weight=None,
                    data_on_device=False, capacity=None):
        """Bytes per device of the state and of one train step, before running.

        As `keras_dp.memory_plan` (which says what each argument means), for
        this trainer's model, mesh and settings: a
        `keras_dp.diagnostics.memory.MemoryPlan` of the step a fit on this
        data would run.

        Raises:
            ValueError: as `keras_dp.memory_plan`.
        """
        return diagnostics.memory.plan_of_fit(self, x, y, batch_size=batch_size,
                                              sample_weight=sample_weight,
                                              data_on_device=data_on_device, capacity=capacity)

    def compiled_train_step(self, state, batch):
        """The train step compiled for these arguments (`.as_text()` is HLO)."""
        prepare.check_distribution(self)
        sharding.check_device_batch(batch, "trainer.compiled_train_step")
        return self.programs.train_step.lower(state, batch).compile()

    def describe(self, batch=None, x=None, y=None, sample_weight=None):
        """Describe the mesh, each state group's sharding and a batch's.

        The state is described from its variables' shapes and layout
        (`TrainState.abstract_of`): nothing of it is copied to the devices.
        Across processes it shows the whole mesh, process by process, with
        each process's host, and the batch rows of this process's devices.
        Without `batch`, one process alone may call it (`if
        keras_dp.distributed.is_primary(): print(trainer.describe())`);
        with a `batch`, every process must, each with its own rows, as the
        batch is placed across them.

        Args:
            batch: an optional host batch; its placement is shown per device.
            x, y, sample_weight: optionally, the training data of a coming
                `fit`: a line says whether it will be kept on the devices
                (`data_on_device`) and its size.

        Returns:
            A multi-line string.
        """
        return diagnostics.describe.describe_trainer(self, batch, x, y, sample_weight)

    # -- The Keras-shaped loops ----------------------------------------------

    def fit(self, x=None, y=None, *, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, validation_split=0.0, validation_data=None,
            shuffle=True, class_weight=None, sample_weight=None,
            initial_epoch=0, steps_per_epoch=None, validation_steps=None,
            validation_batch_size=None, validation_freq=1, checkpoint_dir=None,
            checkpoints_to_keep=2, profile_dir=None):
        """Train for `epochs` epochs, as `model.fit` does, on every device.

        Every row is used exactly once per epoch, whatever `batch_size` and
        the device count; each step equals one single-device step on the
        same rows.

        Args:
            x, y, sample_weight, batch_size: the training data (see
                `keras_dp.sources.make_batches`); `batch_size` is global and
                need not divide by the device count.
            epochs: the index of the last epoch, as in `model.fit`: training
                runs epochs `initial_epoch` to `epochs - 1`.
            verbose: 0 silent, 1 progress bar, 2 one line per epoch.
            callbacks: Keras callbacks; they see the same hooks and logs as
                under `model.fit`. A callback that reads `self.model` in the
                middle of an epoch sees the current weights, and what it
                changes there (weights, learning rate) is trained on from the
                next step, without a recompile.
            validation_split: hold out this last fraction of array data
                (taken before shuffling) and score it after each epoch.
            validation_data: `(x, y[, sample_weight])` (or that list, as in
                Keras) or a dataset, scored after every epoch as `val_*` logs.
            shuffle: reshuffle array data every epoch, in an order fixed by
                the trainer's `seed` and the epoch index; `"batch"`, as in
                `model.fit`: keep each batch's rows, permuted within it.
            class_weight: `{class_id: weight}`, applied as sample weights.
            initial_epoch: the epoch to start at (to resume a run); the
                shuffle order of epoch e is the same as in an unbroken run.
            steps_per_epoch: run this many steps per epoch (rounded up to
                whole calls of `steps_per_execution`), reading on from one
                iterator across epochs, as `model.fit` does: an epoch ends
                early where the data ends, and the next starts a new pass;
                a one-shot iterator that runs out stops training with a
                warning.
            validation_steps: score the first this many validation batches
                each time, as `model.fit` does (needed for an endless
                validation dataset). None: the whole validation data.
            validation_batch_size: the global batch size of validation
                arrays (default: `batch_size`), as in `model.fit`.
            validation_freq: validate every this many epochs (an int), or
                after the listed epochs (1-based, as in Keras).
            checkpoint_dir: save the whole training state there (see
                `keras_dp.checkpoint`) after every epoch, and when SIGTERM
                arrives: then at the next step boundary, after which the
                process exits with status 143. If the directory holds a
                checkpoint, training resumes from it (its epoch and step
                replace `initial_epoch`) and ends as an unbroken run would;
                one taken mid-epoch resumes only with the same `batch_size`,
                training rows and `shuffle` (else a `ValueError` says which
                changed). `~` is expanded. Not with a
                `keras.callbacks.BackupAndRestore`, which restores from a
                point of its own (a `ValueError` before any step).
            checkpoints_to_keep: how many of the newest checkpoints stay in
                `checkpoint_dir` (orbax's `max_to_keep`); the older are deleted.
            profile_dir: write a `jax.profiler` trace of 5 calls of the
                first epoch there, after its first call (which compiles);
                TensorBoard's profile plugin reads it.

        Returns:
            The `keras.callbacks.History` of the run.

        Raises:
            FloatingPointError: the loss became NaN or Inf; the message names
                the epoch and batch, and the model keeps the weights from
                before that step. Not raised when a callback such as
                `keras.callbacks.TerminateOnNaN` stops training instead.
        """
        # Across processes, every process's preparation and settings are
        # checked against the others' before anything waits on them.
        with self.hosts.preparing() as settings:
            # A bad path fails first. Processes agree on the absolute path:
            # a relative one names another directory in another working directory.
            checkpoint_dir = options.check_dir(checkpoint_dir, "checkpoint_dir")
            options.check_dir(profile_dir, "profile_dir")
            options.check_one_restore(callbacks, checkpoint_dir)
            epochs = options.check_count("epochs", epochs)
            initial_epoch = options.check_count("initial_epoch", initial_epoch, 0)
            checkpoints_to_keep = options.check_count(
                "checkpoints_to_keep", checkpoints_to_keep, 1)
            epochs, steps_per_epoch, validation_steps = prepare.keras_limits(
                epochs, steps_per_epoch=steps_per_epoch, validation_steps=validation_steps)
            plan = dict(batch_size=batch_size, shuffle=shuffle, epochs=epochs,
                        initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
                        validation_batch_size=validation_batch_size,
                        validation_steps=validation_steps, validation_freq=validation_freq)
            batches, val, step_plan = prepare.fit_data(
                self, x, y, sample_weight, class_weight=class_weight,
                validation_split=validation_split, validation_data=validation_data, **plan)
            settings += self.hosts.fit_settings(
                self, batches, validation=val, checkpoint_dir=checkpoint_dir,
                checkpoints_to_keep=checkpoints_to_keep, **plan)
        # An error on one process stops all, opening the checkpoints included
        # (only process 0 takes the directory's lock, say).
        with self.hosts.watch():
            checkpoints, resume = checkpoint.open_for_fit(
                checkpoint_dir, self.model, self.seed, initial_epoch, steps_per_epoch,
                source=batches.resumable,
                plan=checkpoint.plan_lib.plan_of(batches, shuffle,
                                                 shares=not self.hosts.whole_data),
                max_to_keep=checkpoints_to_keep,
                topology=checkpoint.plan_lib.topology_of(self.mesh, batches))
            with checkpoint.closing(checkpoints):  # its lock goes, whatever fails
                note = checkpoints and checkpoints.resume_note(epochs)
                if note and verbose != 0 and self.hosts.primary:
                    print(note, flush=True)
                return loop.fit(
                    self, batches, val, callbacks, verbose=verbose,
                    epochs=epochs, resume=resume, validation_freq=validation_freq,
                    checkpoints=checkpoints, plan=step_plan, profile_dir=profile_dir,
                    peak_flops_per_s=diagnostics.timing.peak_flops_per_s(self.mesh, self.model),
                )

    def use_feed(self, batches, plan=None):
        """The feed of a fit on `batches`, its programs' donation chosen (`prepare.feed_of`)."""
        return prepare.feed_of(self, batches, plan)

    def evaluate(self, x=None, y=None, *, batch_size=None, verbose="auto",
                 sample_weight=None, steps=None, callbacks=None, return_dict=False):
        """Return the loss and metrics over all rows, as `model.evaluate` does.

        With `steps`, over the first `steps` batches only (needed for an
        endless dataset).

        Returns:
            The loss alone when there are no metrics, else a list in the
            order of `model.metrics_names`, or with `return_dict` a dict
            by name in sorted order (as Keras's logs are).
        """
        batches = prepare.inference_data(self, x, y, sample_weight, batch_size=batch_size,
                                         steps=steps, call="evaluate")
        return evaluate_lib.evaluate_call(self, batches, callbacks, verbose, return_dict)

    def predict(self, x, *, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Return the model's outputs for every row of `x`, in order.

        With `steps`, for the rows of the first `steps` batches only (needed
        for an endless dataset). As under `model.predict`, the model keeps
        the non-trainable values the predict steps leave: a layer that draws
        random numbers in inference mode draws new ones each batch and call.

        Returns:
            Numpy arrays with the structure of the model's outputs and
            exactly one row per input row.
        """
        batches = prepare.inference_data(self, x, None, None, batch_size=batch_size,
                                         steps=steps, call="predict")
        return evaluate_lib.predict_call(self, batches, callbacks, verbose)

    def batches_of(self, x, y, sample_weight, batch_size, shuffle, class_weight=None,
                 steps=None, keras_peeks=True, keras_resets=True, what="The data"):
        """`x` as a `Source` (`sources.make_batches`), cut to `steps`.

        `keras_peeks`, `keras_resets` and `what` are `make_batches`'s;
        `batch_size` is global: each process reads its share of it.
        """
        if batch_size is not None:
            # `batch_size` is global; each process slices its part of it.
            batch_size = options.check_count("batch_size", batch_size, 1)
            batch_size = self.hosts.local_batch_size(batch_size)
        return sources.make_batches(
            x, y, sample_weight, batch_size=batch_size, shuffle=shuffle, seed=self.seed,
            class_weight=class_weight, what=what, keras_peeks=keras_peeks,
            keras_resets=keras_resets, steps=steps)
