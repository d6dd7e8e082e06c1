"""`ShardedTrainer`: one Keras model, one `"batch"` mesh, compiled steps.

Its parts are public so a user can run training by hand (`build`,
`init_state`, `shard`, `train_step`, `write_back`), and `fit`, `evaluate`
and `predict` run them the way `model.fit`, `model.evaluate` and
`model.predict` do, with Keras's callbacks and progress bar. The route of a
batch: `keras_dp.sources` makes host batches of the user's data,
`keras_dp.core.placement` puts them on the mesh, `keras_dp.core.loop` runs the epochs,
and `keras_dp.core.steps` holds the compiled programs.

The Keras model is the record of truth between calls; during `fit`, the
device state is, and the model is updated from it whenever a callback looks,
at the end of fit, and whenever `fit` exits by an exception or an interrupt.
"""


from keras_dp import _compat
from keras_dp.multihost import agreement
from keras_dp.keras import build as build_lib
from keras_dp.keras import callbacks as callbacks_lib
from keras_dp.checkpoint import store as checkpoint_lib
from keras_dp.diagnostics import compilation_cache as compilation_cache_lib
from keras_dp.diagnostics import describe as describe_lib
from keras_dp import distributed
from keras_dp.core import inflight
from keras_dp import layout
from keras_dp.core import evaluate as inference
from keras_dp.checks import labels as labels_lib
from keras_dp.core import loop
from keras_dp.diagnostics import memory as memory_lib
from keras_dp import sharding as mesh_lib
from keras_dp.checks import model as model_checks
from keras_dp.multihost import peers
from keras_dp import sources as pipeline
from keras_dp.core import placement as placement_lib
from keras_dp.core import programs as programs_lib
from keras_dp.core import feed as resident
from keras_dp.core import state as state_lib
from keras_dp.core import steps as steps_lib
from keras_dp.core.state import TrainState
from keras_dp.core.state import model_weights
from keras_dp.core.state import write_back


class ShardedTrainer:
    """Synchronous data-parallel training of a Keras model over a JAX mesh.

    Args:
        model: a `keras.Model` (Sequential, Functional or subclassed). It
            may be unbuilt; it is built from the first batch, as in
            `model.fit`.
        optimizer, loss, metrics: as in `model.compile`; each one given
            overrides what the model was compiled with. To train, an
            uncompiled model needs at least `optimizer` (and `loss`, unless
            its losses come from `add_loss`); to predict, neither.
        mesh: a 1-D `jax.sharding.Mesh` or `keras.distribution.DeviceMesh`;
            its one axis, whatever its name, splits the batch (see
            `keras_dp.make_mesh`; `trainer.mesh` names it `"batch"`).
        devices: the devices to train on (default: all of JAX's devices).
            Use either `mesh` or `devices`.
        seed: seed of the per-epoch shuffle of array data.
        steps_per_execution: steps per compiled call (default: the
            model's `steps_per_execution` from `compile`, else 1), in
            `fit`, its validation, `evaluate` and `predict`. K batches of
            equal size are stacked and sent at once, and one program runs K
            steps, each exactly a single step; batches left over at an
            epoch's end run one by one. Callbacks and the progress bar are
            called once per call, as in `model.fit`.
        unroll: how many of the K steps to unroll per loop iteration of
            the compiled scan (default: all of them on CPU, where XLA runs
            a rolled loop of this kind slower; 1 elsewhere). True unrolls
            all K and False none, as in `jax.lax.scan`.
        prefetch: how many batches (or stacks of K) a background thread
            prepares and copies to the devices ahead of the step that needs
            them; 0 prepares each in line.
        steps_in_flight: at most this many dispatched calls are unfinished,
            the newest included: with 1 each call finishes before the next
            is dispatched, with 2 one runs while the next is queued.
            Defaults to 1 on CPU (several queued cross-device all-reduces
            can deadlock XLA:CPU's thread pool) and 2 elsewhere.
        state_sharding: where the training state lives (`keras_dp.layout`):
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
            runs, so that a step failing at run time (a device error, a host
            callback that raises) loses no completed step. It costs
            `steps_in_flight` more states per device (the steps no longer
            donate their input): `"auto"` (default; `None` too) when that
            fits comfortably (`keras_dp.diagnostics.memory.keeps_fit`), `True`, or
            `False` (donated: a failure loses the steps since the model last
            received the state). `keeps_last_good` says what fit chose.
        compilation_cache: JAX's persistent compilation cache, so that a
            rerun loads its compiled steps from disk: `True` (default) sets
            a per-user directory unless `KERAS_DP_COMPILATION_CACHE=0` or
            JAX has one already; a path uses that; `False` leaves JAX's
            setting alone (see `keras_dp.diagnostics.compilation_cache`). The directory
            in use is `compilation_cache_dir`.

    Attributes:
        timings: after `fit`, one dict per epoch of where its time went:
            seconds waiting for input, in compiled steps, in callbacks and
            in validation, samples and FLOPs per second, and the fraction
            of the devices' peak where known (`keras_dp.diagnostics.timing`).
        keeps_last_good: whether the train programs keep their input state
            (chosen by each fit, from `keep_last_good`).
        programs: the jitted programs the loops call, for one step and for
            K steps of each kind (`keras_dp.core.programs.Programs`).

    Raises:
        TypeError: `model` is not a `keras.Model`.
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
                 data_on_device="auto", keep_last_good="auto", compilation_cache=True):
        model_checks.check_model(model)
        mesh_lib.check_keras_distribution()
        self.compilation_cache_dir = compilation_cache_lib.enable(compilation_cache)
        build_lib.compile_model(model, optimizer, loss, metrics)
        self.model = model
        self._builder = build_lib.Builder(model)
        self.mesh = mesh_lib.make_mesh(devices, mesh)
        self.state_sharding = layout.check_mode(state_sharding)
        self.seed = pipeline.check_count("seed", seed, 0)
        prefetch = pipeline.check_count("prefetch", prefetch, 0)
        self.timings = []
        self.steps_in_flight = inflight.bound(steps_in_flight, mesh_lib.on_cpu(self.mesh))
        self.steps_per_execution = pipeline.steps_per_execution(model, steps_per_execution)
        self.placement = placement_lib.make_placement(self.mesh, prefetch)
        self.data_on_device = resident.check_option(data_on_device, self.placement.multiprocess)
        self.keep_last_good = pipeline.check_auto("keep_last_good", keep_last_good)
        if unroll is None:
            unroll = self.steps_per_execution if mesh_lib.on_cpu(self.mesh) else 1
        elif isinstance(unroll, bool):  # as in jax.lax.scan: all K steps, or one
            unroll = self.steps_per_execution if unroll else 1
        self.unroll = pipeline.check_count("unroll", unroll, 0)
        mode = self.state_sharding
        self._train_programs = {}  # donate -> the four train programs
        self.programs = programs_lib.Programs(
            *[None] * len(programs_lib.TRAIN_PROGRAMS),  # set just below
            steps_lib.make_test_step(model, self.mesh, state_sharding=mode),
            steps_lib.make_multi_test_step(model, self.mesh, unroll=self.unroll,
                                           state_sharding=mode),
            steps_lib.make_predict_step(model, self.mesh, state_sharding=mode),
            steps_lib.make_multi_predict_step(model, self.mesh, unroll=self.unroll,
                                              state_sharding=mode))
        self._use_train_programs(donate=self.keep_last_good is not True)

    def _use_train_programs(self, donate):
        """Train with the programs that donate their state, or keep it."""
        self.programs = self.programs._replace(**self._train_programs_for(donate))
        self.keeps_last_good = not donate

    def _train_programs_for(self, donate):
        """The four train programs that donate their state, or keep it, by name; each made once."""
        if donate not in self._train_programs:
            model, mesh, unroll, mode = self.model, self.mesh, self.unroll, self.state_sharding
            self._train_programs[donate] = dict(zip(programs_lib.TRAIN_PROGRAMS, (
                steps_lib.make_train_step(model, mesh, state_sharding=mode, donate=donate),
                steps_lib.make_multi_train_step(model, mesh, unroll=unroll, state_sharding=mode,
                                                donate=donate),
                *resident.make_steps(model, mesh, unroll=unroll, state_sharding=mode,
                                     donate=donate)), strict=True))
        return self._train_programs[donate]

    @property
    def num_devices(self):
        """The number of devices each global batch is split over."""
        return mesh_lib.num_devices(self.mesh)

    @property
    def multiprocess(self):
        """Whether the mesh spans several processes."""
        return self.placement.multiprocess

    @property
    def reads_collectively(self):
        """Whether reading the state into the model gathers it from every process.

        True when the state is split (`state_sharding` other than
        "replicated") across processes: every process must then take part
        in each read.
        """
        return self.multiprocess and self.state_sharding != "replicated"

    # -- The parts, for training by hand ------------------------------------

    def build(self, batch, for_training=True):
        """Build the model, its loss, metrics and optimizer from a host batch.

        As `model.fit` builds it (`keras_dp.keras.build.build`), with or without
        labels; `for_training=False` builds the layers only (enough to
        predict, for an uncompiled model too).

        Also checks, before anything is compiled, that the labels fit the
        model's output under its loss.

        Raises:
            ValueError: the model cannot be built on `x`, or the labels do
                not fit its output; or a Keras distribution other than
                `DataParallel` was set since the trainer was made
                (`keras_dp.sharding.check_keras_distribution`; `fit`, `evaluate`
                and `predict` build first, so they refuse it too).
        """
        mesh_lib.check_keras_distribution()
        self._builder.build(pipeline.unpack(batch), for_training)

    def init_state(self):
        """Return the model's current variables as a `TrainState` on the mesh.

        Laid out as `state_sharding` says: each array replicated, or split
        over `"batch"` (`keras_dp.layout`; `describe()` shows which).

        Raises:
            ValueError: the model, its metrics or optimizer are not built,
                or a layer's `trainable` changed since the optimizer was
                built (`keras_dp.checks.model.check_trainable_unchanged`).
        """
        self._require_built("The training state")
        model_checks.check_trainable_unchanged(self.model)
        return TrainState.from_model(self.model, self.mesh, self.state_layout())

    def state_layout(self):
        """The sharding of every state variable, as a `TrainState` of lists.

        Raises:
            ValueError: the model, its metrics or optimizer are not built
                (their variables do not exist yet; call `build` first).
        """
        self._require_built("The state layout")
        return layout.state_shardings(
            TrainState.variables_of(self.model), self.mesh, self.state_sharding)

    def _require_built(self, what):
        """Refuse to read the state of a model not built for training, naming the fix."""
        if not build_lib.is_built(self.model) and _compat.state_sync_shadowed(self.model):
            raise ValueError(
                "The model was compiled again during fit (a callback called "
                "model.compile): its new optimizer, loss and metrics are not built, "
                "and the fit's compiled step holds the old ones. Keras's model.fit "
                "fails on this too (\"'NoneType' object is not callable\"). Compile "
                "between fits instead: fit(..., epochs=k), then model.compile(...), "
                "then fit(..., initial_epoch=k, epochs=n)."
            )
        if not build_lib.is_built(self.model):
            missing = ("its optimizer, loss or metrics are" if self.model.built
                       else "the model is")
            raise ValueError(
                f"{what} cannot be read yet: {missing} not built. Call "
                "trainer.build(batch) with one batch of data first (fit does this "
                "for you); it builds the layers, loss, metrics and optimizer, as "
                "model.fit does (model.build(input_shape) builds the layers only)."
            )

    def shard(self, batch):
        """Put a host batch `(x, y[, sample_weight])` on the mesh, split by rows.

        Returns a `placement.DeviceBatch`. Across processes, `batch` is this
        process's part of the global batch, and every process must call
        `shard` for the same step (it exchanges the row counts: one host
        round trip; `fit` agrees on a whole epoch's counts at once).
        """
        return self.placement.shard(pipeline.unpack(batch))

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
                Keras distribution other than `DataParallel` is active.
        """
        mesh_lib.check_keras_distribution()
        state_lib.check_usable(state, "trainer.train_step")
        steps_lib.check_device_batch(batch)
        if batch.data[1] is None:  # no labels: refused as `build` refuses them, if needed
            self._builder.build(batch.data)
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
        write_back(state, self.model)

    def memory_plan(self, x, y=None, *, batch_size=32, sample_weight=None,
                    data_on_device=False):
        """Bytes per device of the state and of one train step, before running.

        Args:
            x, y, sample_weight: a few rows of the training data as arrays
                (any number: they are repeated or cut to `batch_size`), for
                their shapes; or, with `data_on_device`, all of it. Read as
                `fit` reads them: a tuple `x` without `y` is `(x, y[,
                sample_weight])` unless it is the model's inputs
                (`keras_dp.sources.model_inputs`).
            batch_size: the global batch to plan for.
            data_on_device: False (the default): plan the step fed from
                the host. True or "auto" (as `ShardedTrainer`'s): `x`, `y`
                and `sample_weight` are the whole training data, and when
                a fit with that setting keeps them on the devices, the plan
                is of its step over the resident data (whose arguments then
                include the data, every device holding all of it).

        Returns:
            A `keras_dp.diagnostics.memory.MemoryPlan` (print it for a summary), of the
            step a fit would run. On XLA:CPU that is the one
            `keep_last_good` picks, and a fit on batches of this size
            finds it compiled; on accelerators it is the step that donates
            its state, whose plan a fit reads to choose.

        Raises:
            ValueError: `data_on_device=True` and data a fit could not
                keep on the devices (see `keras_dp.core.feed`); data that
                is not arrays (a dataset, a list of batches).
        """
        data_on_device = resident.check_option(data_on_device, self.multiprocess)
        x = pipeline.model_inputs(x, y, self.model)  # read as fit reads it
        memory_lib.check_arrays(x, y)
        batch = memory_lib.batch_of(pipeline.checked_arrays(x, y, sample_weight), batch_size)
        self.build(batch)
        on_cpu = mesh_lib.on_cpu(self.mesh)  # the choice needs no plan there
        host_plan = None if on_cpu else memory_lib.plan(self, batch)
        programs = self._train_programs_for(
            not on_cpu or not memory_lib.keep_last_good(self, host_plan))
        if data_on_device is not False:
            batches = self._batches(x, y, sample_weight, batch_size, False)
            keep, why_not = resident.decide(self, batches, host_plan, data_on_device)
            if keep:
                return memory_lib.plan(self, batch, programs["resident_step"],
                                       resident.abstract_arguments(batches, self.mesh))
            if data_on_device is True:
                raise resident.refusal(why_not)
        return host_plan or memory_lib.plan(self, batch, programs["train_step"])

    def compiled_train_step(self, state, batch):
        """The train step compiled for these arguments (`.as_text()` is HLO)."""
        mesh_lib.check_keras_distribution()
        steps_lib.check_device_batch(batch, "trainer.compiled_train_step")
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
        state = (TrainState.abstract_of(self.model, self.state_layout())
                 if build_lib.is_built(self.model) else None)
        device_batch = None if batch is None else self.shard(batch)
        hosts = distributed.host_names() if self.multiprocess else None
        text = describe_lib.describe(self.mesh, state, device_batch, hosts,
                                     self.steps_per_execution)
        if x is None:
            return text
        batches = self._batches(pipeline.model_inputs(x, y, self.model), y, sample_weight,
                                None, False)
        keep, why_not = resident.decide(self, batches)
        rows = getattr(batches, "num_samples", None)
        nbytes = resident.data_bytes(batches.arrays) if hasattr(batches, "arrays") else 0
        return text + "\n" + describe_lib.data_line(rows, nbytes, self.num_devices, keep,
                                                     why_not)

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
            steps_per_epoch: run this many steps per epoch, drawing batches
                from one continuing stream (for endless datasets). A
                re-iterable source restarts when it ends; a one-shot
                iterator that runs out stops training with a warning.
            validation_steps: score the first this many validation batches
                each time, as `model.fit` does (needed for an endless
                validation dataset). None: the whole validation data.
            validation_batch_size: the global batch size of validation
                arrays (default: `batch_size`), as in `model.fit`.
            validation_freq: validate every this many epochs (an int), or
                after the listed epochs (1-based, as in Keras).
            checkpoint_dir: save the whole training state there (see
                `keras_dp.checkpoint.store`) after every epoch, and when SIGTERM
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
        with agreement.preparing(self.placement) as settings:
            # A bad path fails first. Processes agree on the absolute path:
            # a relative one names another directory in another working directory.
            checkpoint_dir = checkpoint_lib.check_dir(checkpoint_dir, "checkpoint_dir")
            checkpoint_lib.check_dir(profile_dir, "profile_dir")
            callbacks_lib.check_one_restore(callbacks, checkpoint_dir)
            epochs = pipeline.check_count("epochs", epochs)
            initial_epoch = pipeline.check_count("initial_epoch", initial_epoch, 0)
            checkpoints_to_keep = pipeline.check_count(
                "checkpoints_to_keep", checkpoints_to_keep, 1)
            x = pipeline.model_inputs(x, y, self.model)
            if validation_split:
                (x, y, sample_weight), validation_data = pipeline.split_validation(
                    x, y, sample_weight, validation_split, validation_data)
            model_checks.require_compiled(self.model, "fit")
            batches = self._batches(x, y, sample_weight, batch_size, shuffle, class_weight,
                                    keras_peeks=build_lib.keras_reads_a_batch_to_build(self.model),
                                    what=pipeline.TRAINING)
            if steps_per_epoch is not None:
                batches = pipeline.StepsPerEpoch(batches, steps_per_epoch,
                                                 epochs - initial_epoch)
            pipeline.check_ends(batches, "x", "steps_per_epoch")
            with pipeline.naming_list_reading(x, y):
                self.build(batches.peek())
            model_checks.check_trainable_unchanged(self.model)
            self._use_train_programs(donate=self.keep_last_good is not True)
            plan = None
            if not mesh_lib.on_cpu(self.mesh):  # accelerators report capacity
                plan = memory_lib.plan(self, batches.peek())
                memory_lib.check_fits(plan)
            val = None
            if validation_data is not None:
                validation_data, val_batch_size = pipeline.validation_source(
                    validation_data, batch_size, validation_batch_size, self.model)
                val = self._batches(validation_data, None, None, val_batch_size, False,
                                    steps=validation_steps, keras_peeks=False,
                                    keras_resets="each pass",
                                    what=pipeline.VALIDATION)
                pipeline.check_ends(val, "validation_data", "validation_steps")
                # Bad validation labels fail now, not after epoch 1.
                self._builder.build(pipeline.unpack(val.peek()), data="the validation data")
            callbacks_lib.check_validation_freq(validation_freq)
            pipeline.check_one_pass(batches, epochs - initial_epoch, "x",
                                    f"epochs={epochs}, initial_epoch={initial_epoch}")
            if val is not None:
                validations = callbacks_lib.validations(range(initial_epoch, epochs),
                                                        validation_freq)
                pipeline.check_one_pass(val, validations, "validation_data",
                                        f"epochs={epochs}, validation_freq={validation_freq!r}")
            labels_lib.check_data(self.model, (batches, "the training data"),
                                  (val, "the validation data"))
            settings += agreement.settings(
                self, batches, batch_size=batch_size, epochs=epochs,
                initial_epoch=initial_epoch, shuffle=shuffle, validation=val,
                validation_batch_size=validation_batch_size,
                validation_steps=validation_steps, validation_freq=validation_freq,
                steps_per_epoch=steps_per_epoch, checkpoint_dir=checkpoint_dir,
                checkpoints_to_keep=checkpoints_to_keep)
        # An error on one process stops all, opening the checkpoints included
        # (only process 0 takes the directory's lock, say).
        with peers.watch(self.placement):
            checkpoints, resume = checkpoint_lib.open_for_fit(
                checkpoint_dir, self.model, self.seed, self.multiprocess, initial_epoch,
                steps_per_epoch, source=getattr(batches, "resumable", None),
                plan=checkpoint_lib.plan_of(batches, shuffle, self.multiprocess),
                max_to_keep=checkpoints_to_keep,
                topology=checkpoint_lib.topology_of(self.mesh, batches))
            with checkpoint_lib.closing(checkpoints):  # its lock goes, whatever fails
                note = checkpoints and checkpoints.resume_note(epochs)
                if note and verbose != 0 and distributed.is_primary():
                    print(note, flush=True)
                # Process 0 writes the callbacks' files; with a state split across
                # processes, every process takes part in their reads of the model.
                callbacks = callbacks_lib.callback_list(
                    callbacks, self.model, verbose, epochs=epochs, steps=batches.steps,
                    collective_reads=self.reads_collectively,
                )
                feed = resident.make_feed(self, batches, plan)  # first: its data takes memory
                self._use_train_programs(donate=not memory_lib.keep_last_good(self, plan))
                with callbacks_lib.announced_on_process_0(callbacks):
                    return loop.fit(
                        self, batches, val, callbacks, epochs=epochs, resume=resume,
                        validation_freq=validation_freq, checkpoints=checkpoints,
                        feed=feed, profile_dir=profile_dir,
                    )

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
        with agreement.preparing(self.placement, "evaluate") as settings:
            model_checks.require_compiled(self.model, "evaluate")
            x = pipeline.model_inputs(x, y, self.model)
            batches = self._batches(
                x, y, sample_weight, batch_size, False, steps=steps,
                keras_peeks=build_lib.keras_reads_a_batch_to_build(self.model))
            pipeline.check_ends(batches, "x", "steps")
            with pipeline.naming_list_reading(x, y):
                self.build(batches.peek())
            settings += agreement.inference_settings(self, batches, batch_size=batch_size,
                                                     steps=steps)
        callbacks = callbacks_lib.callback_list(callbacks, self.model, verbose, history=False,
                                               epochs=1, steps=batches.steps)
        # As model.evaluate does: the model keeps what the test steps left,
        # given to it before on_test_end, so what a callback changes there stays.
        keep = lambda non_trainable, metrics: write_back(  # noqa: E731
            TrainState(None, non_trainable, None, metrics), self.model)
        with peers.watch(self.placement, "evaluate"):
            logs = inference.evaluate(  # read after on_test_begin
                self, lambda: model_weights(self.model, self.mesh, self.state_layout()),
                batches, callbacks, keep)
        if return_dict:
            return dict(sorted(logs.items()))
        return callbacks_lib.in_evaluate_order(logs, self.model)

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
        with agreement.preparing(self.placement, "predict") as settings:
            x = pipeline.predict_inputs(x, self.model)
            batches = self._batches(
                x, None, None, batch_size, False, steps=steps, keras_resets=False,
                keras_peeks=build_lib.keras_reads_a_batch_to_build(self.model, for_training=False))
            pipeline.check_ends(batches, "x", "steps")
            with pipeline.naming_list_reading(x):
                self.build(batches.peek(), for_training=False)
            settings += agreement.inference_settings(self, batches, batch_size=batch_size,
                                                     steps=steps)
        callbacks = callbacks_lib.callback_list(callbacks, self.model, verbose, history=False,
                                               epochs=1, steps=batches.steps)
        shardings = layout.state_shardings(TrainState(
            self.model.trainable_variables, self.model.non_trainable_variables, None, None,
        ), self.mesh, self.state_sharding)
        with peers.watch(self.placement, "predict"):
            outputs, non_trainable = inference.predict(  # read after on_predict_begin
                self, lambda: model_weights(self.model, self.mesh, shardings), batches,
                callbacks)
        # As model.predict does: the model keeps what the predict steps left
        # (a SeedGenerator's state). The model may have no optimizer here.
        write_back(TrainState(None, non_trainable, None, None), self.model,
                   TrainState(None, self.model.non_trainable_variables, None, None))
        return outputs

    def _batches(self, x, y, sample_weight, batch_size, shuffle, class_weight=None,
                 steps=None, keras_peeks=True, keras_resets=True, what="The data"):
        """`x` as `Batches` (`pipeline.make_batches`), cut to `steps`.

        `keras_peeks`, `keras_resets` and `what` are `make_batches`'s;
        `batch_size` is global: each process reads its share of it.
        """
        if batch_size is not None:
            # `batch_size` is global; each process slices its part of it.
            batch_size = pipeline.check_count("batch_size", batch_size, 1)
            batch_size = self.placement.local_batch_size(batch_size)
        batches = pipeline.make_batches(
            x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
            seed=self.seed, class_weight=class_weight, what=what, keras_peeks=keras_peeks,
            keras_resets=keras_resets,
        )
        return batches if steps is None else pipeline.FirstSteps(batches, steps)

