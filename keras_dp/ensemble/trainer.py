"""`EnsembleTrainer`: the members of an ensemble trained together, one step for all."""

import jax
import numpy as np

from keras_dp import options
from keras_dp import sharding
from keras_dp import sources as pipeline
from keras_dp.checks import model as model_checks
from keras_dp.core import feed
from keras_dp.core import state as state_lib
from keras_dp.core.state import TrainState
from keras_dp.diagnostics import compilation_cache as compilation_cache_lib
from keras_dp.ensemble import inference as ensemble_inference
from keras_dp.ensemble import loop as ensemble_loop
from keras_dp.ensemble import members as members_lib
from keras_dp.ensemble import recipe
from keras_dp.ensemble import steps as ensemble_steps
from keras_dp.keras import build as build_lib
from keras_dp.keras import callbacks as callbacks_lib
from keras_dp.multihost import hosts as hosts_lib


class EnsembleTrainer:
    """Trains the `M` members of an ensemble together, on a member axis.

    The state is a `TrainState` whose arrays have a leading member axis of
    size `M`, split over the mesh axis `"batch"` (`PartitionSpec("batch")`);
    batches are replicated. `train_step` is one jitted step with no
    collective in its compiled program (`keras_dp.ensemble.steps`).

    Args:
        build_model, members, seed, mesh, devices: see `fit_ensemble`.
            With fewer members than devices, the first `members` devices
            are used.
        from_logits: whether the members output logits, whose softmax over
            the last axis is then taken before averaging; `None` reads it
            from the compiled loss (`keras_dp.ensemble.members.read_from_logits`).
        steps_per_execution: training steps per compiled call (default:
            the members' `steps_per_execution` from `compile`, else 1), as
            `ShardedTrainer` runs them: K batches of one row count per
            call, the rest one by one.
        compilation_cache: JAX's persistent compilation cache, as for
            `ShardedTrainer` (the directory in use is `compilation_cache_dir`).
        state_sharding: not supported (see `fit_ensemble`): anything but
            None raises a `ValueError` before any member is built.

    Attributes:
        member_history: after `fit`, each member's own logs per epoch,
            those of its `model.fit`: `{name: [[M floats] per epoch]}` for
            every training metric and its `val_` twin, and one float per
            epoch for `val_ensemble_loss` / `val_ensemble_accuracy`.

    Raises:
        TypeError: `build_model` is neither callable nor a `keras.Model`, or
            returned something that is not a `keras.Model`; or `seed` is
            not an integer.
        ValueError: `seed` is negative, the members do not fit the devices,
            `build_model` returned an uncompiled model, one model twice,
            members whose layers, loss, metrics or optimizer settings differ
            (`keras_dp.ensemble.recipe.check_same_recipe`; a float learning
            rate may differ), a keras_hub task with a preprocessor
            (`model_checks.check_no_preprocessor`), or the loss does not tell
            whether the outputs are logits or is a Keras loss that is not a
            multi-class one (`members.check_classifier`).
    """

    def __init__(self, build_model, members=None, *, seed=0, mesh=None,
                 devices=None, from_logits=None, steps_per_execution=None,
                 compilation_cache=True, state_sharding=None):
        refuse_state_sharding(state_sharding)  # a member is whole on its device
        self.compilation_cache_dir = compilation_cache_lib.enable(compilation_cache)
        self.seed = options.check_count("seed", seed, 0)  # before any member is built
        count, self.mesh = members_lib.member_mesh(members, mesh, devices)
        self.hosts = hosts_lib.OneProcess(sharding.Layout(self.mesh))  # an ensemble runs on one
        self.members = members_lib.make_members(build_model, count, self.seed)
        recipe.check_same_recipe(self.members)  # the step is traced from member 0
        model_checks.check_no_preprocessor(self.members[0])
        members_lib.check_classifier(self.members[0])
        self.from_logits = members_lib.read_from_logits(self.members[0], from_logits)
        self.steps_per_execution = options.steps_per_execution(
            self.members[0], steps_per_execution)
        self.member_history = {}
        self._train_steps = {}
        self._predict_step = ensemble_steps.make_predict_step(
            self.members[0], self.mesh, self.from_logits)
        self._test_step = ensemble_steps.make_test_step(
            self.members[0], self.mesh, self.from_logits)
        self._x_example = None
        self._averaging = None

    @property
    def members_per_device(self):
        """How many members each device holds and updates."""
        return len(self.members) // self.mesh.shape[sharding.BATCH_AXIS]

    # -- The parts, for training by hand ------------------------------------

    def build(self, batch):
        """Build every member (layers, loss, metrics, optimizer) from a host batch.

        Raises:
            ValueError: a member cannot be built on `x`, the labels do
                not fit its output, or its output has fewer than 2 classes.
        """
        labelled = pipeline.unpack(batch)[1] is not None
        self._build(batch, for_training=labelled)  # no labels: enough to predict

    def _build(self, batch, for_training, data="the data"):
        """Build every member, for training (labels needed, if a loss reads them) or not."""
        build_lib.check_keras_distribution()  # one set since the trainer was made too
        batch = pipeline.unpack(batch)
        for model in self.members:
            build_lib.build(model, batch, for_training=for_training, data=data)
        members_lib.check_class_output(self.members[0], batch[0])
        self._x_example = batch[0]

    def init_state(self):
        """Return the members' variables as one stacked, member-sharded `TrainState`.

        Raises:
            ValueError: the members are not built yet, or their variables
                differ in number, shape or dtype.
        """
        if self._x_example is None:
            raise ValueError(
                "The members are not built. Call trainer.build(batch) with one "
                "batch of data first (fit, evaluate and predict do this)."
            )
        return members_lib.stack_state(self.members, self.mesh)

    def replicate(self, batch):
        """Put a host batch `(x, y[, sample_weight])` whole on every device."""
        return jax.device_put(pipeline.unpack(batch), sharding.replicated(self.mesh))

    def stack(self, batches):
        """Put one host batch per member on the mesh, each on its member's device."""
        return jax.device_put(_stack(batches), members_lib.member_sharded(self.mesh))

    def train_step(self, state, batch, *, per_member=False):
        """Run one compiled step of every member: `(state, logs)`.

        Args:
            state: from `init_state` or the previous step; it is donated.
            batch: from `replicate` (every member trains on it), or from
                `stack` with `per_member=True` (member `i` on its own).

        Returns:
            The new state, and logs mapping each metric to an `(M,)` array.
            A member whose loss is not finite keeps its previous weights.

        Raises:
            TypeError: `state` is not a `TrainState`, or `batch` is not on
                the devices.
            ValueError: `state` was donated to an earlier step, or a Keras
                distribution other than `DataParallel` is active
                (`keras_dp.sharding.check_keras_distribution`).
        """
        build_lib.check_keras_distribution()  # one set since the trainer was made too
        state_lib.check_usable(state, "trainer.train_step")
        _check_placed(batch)
        state, logs, _ = self._step(per_member, 1)(state, batch)
        return state, logs

    def compiled_train_step(self, state, batch, *, per_member=False):
        """The train step compiled for these arguments (`.as_text()` is HLO)."""
        build_lib.check_keras_distribution()
        return self._step(per_member, 1).lower(state, batch).compile()

    def write_back(self, state):
        """Copy member `i`'s row of the stacked `state` into member `i`'s model."""
        state_lib.check_usable(state, "trainer.write_back")
        members_lib.write_back_members(state, self.members)

    def describe(self):
        """Two lines: how many members on how many devices, and which where."""
        return members_lib.describe_placement(self.mesh, len(self.members))

    # -- Training, scoring, predicting ---------------------------------------

    def fit(self, x=None, y=None, *, batch_size=None, epochs=1, verbose="auto",
            callbacks=None, validation_split=0.0, validation_data=None, shuffle=True,
            member_shuffle=False, class_weight=None, sample_weight=None, initial_epoch=0,
            steps_per_epoch=None, validation_steps=None, validation_batch_size=None,
            validation_freq=1, checkpoint_dir=None):
        """Train every member for `epochs` epochs (see `fit_ensemble`).

        As `model.fit` runs: Keras callbacks (given the averaging model,
        whose weights are the members'; see `keras_dp.ensemble.loop`), a
        progress bar unless `verbose=0`, and `stop_training`. The members'
        Keras models hold the state of their last completed step whenever a
        callback looks, when `fit` returns, and when it stops by an
        exception.

        Returns:
            A `keras.callbacks.History` of floats per epoch: each log of
            the members' `model.fit` (`loss`, `accuracy`, ..., `val_loss`,
            `val_accuracy`, ...) as the members' mean, and
            `val_ensemble_loss`, `val_ensemble_accuracy` of the ensemble.
            Each member's own values are in `member_history`.

        Raises:
            ValueError: `member_shuffle` without shuffled array data, a
                `SwapEMAWeights` callback
                (`keras_dp.ensemble.loop.check_callbacks`), bad
                `validation_split`, `class_weight` or `initial_epoch`, or
                a `checkpoint_dir` (not supported for ensembles: the error
                says what to use instead).
            FloatingPointError: a member's loss became NaN or Inf.
        """
        refuse_checkpoint_dir(checkpoint_dir)
        epochs = options.check_count("epochs", epochs)
        initial_epoch = options.check_count("initial_epoch", initial_epoch, 0)
        options.check_validation_freq(validation_freq)
        ensemble_loop.check_callbacks(callbacks)
        x = pipeline.model_inputs(x, y, self.members[0])
        if validation_split:
            (x, y, sample_weight), validation_data = pipeline.split_validation(
                x, y, sample_weight, validation_split, validation_data)
        sources = self._sources(x, y, sample_weight, batch_size, shuffle, member_shuffle,
                                class_weight)
        if steps_per_epoch is not None:
            sources = [pipeline.StepsPerEpoch(source, steps_per_epoch,
                                              self.steps_per_execution, epochs)
                       for source in sources]
        pipeline.check_ends(sources[0], "x", "steps_per_epoch")
        self._build(sources[0].peek(), True, "the training data")
        ensemble_loop.resolve_monitors(callbacks, self.members[0])
        epoch_range = range(initial_epoch, epochs)
        val = self._validation(validation_data, batch_size, validation_batch_size,
                               validation_steps, validation_freq, epoch_range)
        pipeline.check_one_pass(sources[0], len(epoch_range), "x",
                                f"epochs={epochs}, initial_epoch={initial_epoch}")
        callbacks = callbacks_lib.callback_list(
            callbacks, self.averaging_model(), verbose, epochs=epochs,
            steps=sources[0].steps)
        ensemble_loop.give_learning_rate_callbacks_the_members(callbacks, self.members)
        return ensemble_loop.fit(self, sources, val, callbacks, epochs=epoch_range,
                                 validation_freq=validation_freq)

    def evaluate(self, x=None, y=None, *, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=True):
        """Score each member as `model.evaluate` does, and the ensemble.

        Member `i`'s scores are what `members[i].evaluate(x, y, ...,
        return_dict=True)` returns: its compiled loss (regularization losses
        included) and every compiled metric, by Keras's own test step (or
        the member's `test_step`). The ensemble's are computed from the
        members' mean probabilities (`keras_dp.ensemble.scores`): labels
        are class ids or one-hot rows, and the scores are what Keras's
        `evaluate` gives for the averaging model compiled with a
        cross-entropy loss and `metrics=["accuracy"]`: the loss weighs rows
        by `sample_weight` and divides by their count, the accuracy counts
        every row alike.
        As `model.evaluate`: with `steps`, over the first `steps` batches
        only; `verbose` and `callbacks` (given the averaging model, batch
        logs the members' means); each member keeps the non-trainable
        values its steps leave, and its metrics hold the evaluation's
        results (`member.metrics[i].result()`).

        Args:
            return_dict: True (default, unlike Keras: an ensemble's scores
                are named per member and for the ensemble) returns the dict
                below; False returns its values as a list, as
                `model.evaluate` does: the members' `metrics_names` order,
                then `ensemble_accuracy` and `ensemble_loss`.

        Returns:
            `{"loss": [M floats], <each compiled metric>: [M floats],
            "ensemble_loss": float, "ensemble_accuracy": float}`.
        """
        batches, callbacks = self._inference_input(
            pipeline.model_inputs(x, y, self.members[0]), y, sample_weight, batch_size, steps,
            callbacks, verbose,
            keras_peeks=build_lib.keras_reads_a_batch_to_build(self.members[0]))
        # As model.evaluate: the members keep what the test steps left, given
        # to them before on_test_end, so what a callback changes there stays.
        with callbacks_lib.released_on_error(callbacks):  # on_test_end may not come
            scores = ensemble_inference.evaluate(self, self._weights, batches, callbacks,
                                                 self._keep)
        if return_dict:
            return scores
        return callbacks_lib.in_evaluate_order(scores, self.members[0])

    def _inference_input(self, x, y, sample_weight, batch_size, steps, callbacks, verbose,
                         **keras_reading):
        """`(batches, callbacks)` of an `evaluate` or `predict` call, the members built."""
        # Every member trains on whole batches: no rows are split over devices.
        batches = pipeline.make_batches(x, y, sample_weight, batch_size=batch_size,
                                        seed=self.seed, steps=steps, **keras_reading)
        pipeline.check_ends(batches, "x", "steps")
        self.build(batches.peek())
        return batches, callbacks_lib.callback_list(
            callbacks, self.averaging_model(), verbose, history=False, epochs=1,
            steps=batches.steps)

    def predict_members(self, x, *, batch_size=None, verbose="auto", steps=None,
                        callbacks=None):
        """Return each member's class probabilities, shape `(M, N, classes)`.

        As `model.predict`: with `steps`, for the rows of the first `steps`
        batches only; `verbose` and `callbacks` (given the averaging model;
        a batch's `outputs` are its mean probabilities); and each member
        keeps the non-trainable values its predict steps leave, carried
        from batch to batch: a layer that draws random numbers in inference
        mode draws new ones each batch and each call.
        """
        batches, callbacks = self._inference_input(
            pipeline.predict_inputs(x, self.members[0]), None, None, batch_size, steps,
            callbacks, verbose, keras_resets=False,
            keras_peeks=build_lib.keras_reads_a_batch_to_build(self.members[0],
                                                               for_training=False))
        with callbacks_lib.released_on_error(callbacks):  # on_predict_end may not come
            probabilities, non_trainable = ensemble_inference.predict(
                self, self._weights, batches, callbacks)
        self._keep(non_trainable)
        return probabilities

    def predict(self, x, *, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Return the ensemble's probabilities, the members' mean: `(N, classes)`.

        The arguments are `predict_members`'s.
        """
        return self.predict_members(x, batch_size=batch_size, verbose=verbose, steps=steps,
                                    callbacks=callbacks).mean(axis=0)

    def averaging_model(self):
        """Return one Keras model that outputs the members' mean probabilities.

        A Functional model named `ensemble`: an input declared like member
        0's (like the data's `x` for subclassed members), the members as
        sub-models sharing their weights with `self.members`, a softmax
        after each when they output logits, and an `Average` layer. It is
        not compiled (its `optimizer` is `None`), and saves and loads as a
        `.keras` file. Every call returns the same model.
        """
        if self._x_example is None:
            raise ValueError("Fit or build the ensemble before asking for its model.")
        if self._averaging is None:  # one model: the one fit's callbacks saw
            self._averaging = members_lib.averaging_model(
                self.members, self.from_logits, self._x_example)
            # Keras's callbacks test model.optimizer (TensorBoard); the
            # members own the optimizers, so the averaging model has none.
            self._averaging.optimizer = None
        return self._averaging

    # -- Internals -----------------------------------------------------------

    def _step(self, per_member, steps):
        key = (per_member, steps)
        if key not in self._train_steps:  # member 0 stands for all, to trace
            self._train_steps[key] = ensemble_steps.make_train_step(
                self.members[0], self.mesh, per_member, steps)
        return self._train_steps[key]

    def _calls(self, sources, epoch):
        """Yield `(steps, batch on the mesh, per_member)` for one epoch.

        Batches of one row count go K to a call; the rest one by one
        (`feed.group_steps`). With one source per member, member `i`'s
        batches sit on member `i`'s device (`[M, (K,) rows, ...]`);
        otherwise every device holds them whole (`[(K,) rows, ...]`).
        """
        per_member = len(sources) > 1
        items = zip(*(source.epoch(epoch) for source in sources))
        for group in feed.group_steps(items, self.steps_per_execution):
            # group: K tuples of a batch per source; by source, its K stacked (or the one).
            by_source = [_stack(list(batches)) if len(group) > 1 else batches[0]
                         for batches in zip(*group)]
            if per_member:
                yield len(group), self.stack(by_source), True
            else:
                yield len(group), self.replicate(by_source[0]), False

    def _weights(self):
        """The models' current `(trainable, non_trainable)`, stacked on the mesh."""
        groups = ("trainable", "non_trainable")
        state = members_lib.stack_state(self.members, self.mesh, groups=groups)
        return state.trainable, state.non_trainable

    def _validation(self, validation_data, batch_size, validation_batch_size,
                    validation_steps, validation_freq, epoch_range):
        """The validation batches (`None` without `validation_data`), checked before any step."""
        if validation_data is None:
            return None
        validation_data, val_batch_size = pipeline.validation_source(
            validation_data, batch_size, validation_batch_size, self.members[0])
        val = pipeline.make_batches(validation_data, batch_size=val_batch_size, seed=self.seed,
                                    steps=validation_steps, what=pipeline.VALIDATION,
                                    keras_peeks=False, keras_resets="each pass")
        pipeline.check_ends(val, "validation_data", "validation_steps")
        # Missing or bad validation labels fail now, not after epoch 1.
        ensemble_inference.check_labels(val, "validation_data")
        self._build(val.peek(), True, "the validation data")
        pipeline.check_one_pass(
            val, options.validations(epoch_range, validation_freq), "validation_data",
            f"epochs={epoch_range.stop}, validation_freq={validation_freq!r}")
        return val

    def _sources(self, x, y, sample_weight, batch_size, shuffle, member_shuffle,
                 class_weight=None):
        first = pipeline.make_batches(
            x, y, sample_weight, batch_size=batch_size, shuffle=shuffle, seed=self.seed,
            class_weight=class_weight, what=pipeline.TRAINING,
            keras_peeks=build_lib.keras_reads_a_batch_to_build(self.members[0]))
        if not member_shuffle:
            return [first]
        if not isinstance(first, pipeline.ArrayBatches) or not shuffle:
            raise ValueError(
                "member_shuffle gives each member its own shuffle of array data, "
                f"so it needs arrays and shuffle=True. Received x of type "
                f"{type(x).__name__} and shuffle={shuffle}. Pass numpy arrays, "
                "or set member_shuffle=False."
            )
        return [first] + [
            pipeline.make_batches(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
                                  seed=self.seed + index, class_weight=class_weight)
            for index in range(1, len(self.members))
        ]

    def _keep(self, non_trainable, metrics=None):
        """Write the stacked non-trainable values (and metrics) into the members, as Keras does."""
        members_lib.write_back_members(TrainState(None, non_trainable, None, metrics), self.members)


def _check_placed(batch):
    """Refuse a host batch where a step needs one from `replicate` or `stack`."""
    leaves = jax.tree.leaves(batch)
    if not (isinstance(batch, tuple) and len(batch) == 3 and leaves
            and all(isinstance(leaf, jax.Array) for leaf in leaves)):
        raise TypeError(
            "trainer.train_step takes a batch placed on the devices. Received: batch of "
            f"type {type(batch).__name__}. Place it first: trainer.train_step(state, "
            "trainer.replicate(batch)), or trainer.stack(batches) with per_member=True.")


def _stack(batches):
    """K host batches `(x, y, sample_weight)` as one, stacked on a new axis 0."""
    return jax.tree.map(lambda *arrays: np.stack(arrays), *map(pipeline.unpack, batches))


def refuse_checkpoint_dir(checkpoint_dir):
    """Raise a `ValueError` naming the alternative unless `checkpoint_dir` is None."""
    if checkpoint_dir is not None:
        raise ValueError(
            "checkpoint_dir is not supported for ensembles: keras_dp's "
            "checkpoints (and saving on SIGTERM) hold one model's state. To "
            "resume an ensemble after a crash, pass "
            "keras.callbacks.BackupAndRestore(backup_dir) in callbacks: a "
            "rerun restores every member from the last epoch's backup and "
            "resumes at the epoch after it. Received: "
            f"checkpoint_dir={checkpoint_dir!r}.")


def refuse_state_sharding(state_sharding):
    """Raise a `ValueError` saying why and what to use instead unless `state_sharding` is None.

    `fit_sharded`'s `state_sharding` splits one model's state over the
    devices; an ensemble puts each member whole on a device of its own.
    """
    if state_sharding is not None:
        raise ValueError(
            "state_sharding is not supported for ensembles: fit_ensemble trains "
            "each member whole on a device of its own (M members on M devices, or "
            "M / D on each), so no member's state is split over devices. For one "
            "model too large for a device, train it with keras_dp.fit_sharded(model, "
            "..., state_sharding='full'). Received: "
            f"state_sharding={state_sharding!r}.")
