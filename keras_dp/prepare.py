"""Preparing a call: the user's data read as sources and checked, the model built from them.

What `fit`, `evaluate` and `predict` do before anything runs, in the order
`model.fit` meets it, so that a mistake fails at second 0 with the fix;
across processes, inside the hosts' `preparing` round, so that every
process learns of any process's mistake (`keras_dp.multihost.agreement`).
"""

import keras

from keras_dp import _messages
from keras_dp import options
from keras_dp import sharding
from keras_dp import sources
from keras_dp.core import feed
from keras_dp.diagnostics import memory
from keras_dp.keras import build
from keras_dp.keras import layouts


def layout_of(model, *, distribution, mesh, devices, state_sharding):
    """Where a trainer's arrays will live: its `sharding.Layout`.

    Under a Keras distribution (`distribution`, or the one active now:
    `keras_dp.keras.layouts.distribution_of`), its mesh, batch axis and
    variable layouts (`layouts.layout_of`); else keras_dp's 1-D mesh of
    `devices` or `mesh` (`sharding.make_mesh`).
    """
    sharding.check_mode(state_sharding)
    distribution = layouts.distribution_of(distribution, mesh, devices)
    if distribution is None:
        return sharding.Layout(sharding.make_mesh(devices, mesh), state_sharding)
    return layouts.layout_of(model, distribution, state_sharding)


def check_distribution(trainer):
    """Refuse a Keras distribution active now that `trainer` was not made with (`layouts.check_current`)."""
    layouts.check_current(getattr(trainer.layout.bases, "distribution", None))


def report_layout(trainer):
    """Warn of a layout that may not do what was meant, the model built (`layouts.report`)."""
    layouts.report(trainer.layout, trainer.model)


def keras_limits(epochs=None, **steps):
    """`epochs` and each of `steps` capped by Keras's debugging limits, where they are set.

    `keras.config.set_max_epochs(n)` caps every fit's `epochs`, and
    `keras.config.set_max_steps_per_epoch(n)` the steps of each fit epoch,
    each validation, `evaluate` and `predict` (a count of None, the whole
    data, included), with Keras's own warnings ("Limiting epochs to n",
    "Limiting steps_per_epoch to n"). Returns `epochs` (if given) and the
    counts, in order, as a tuple, or the one value alone.
    """
    limited = []
    cap = keras.config.max_epochs()
    if epochs is not None:
        if cap and cap < epochs:
            _messages.warn(f"Limiting epochs to {cap}")
            epochs = cap
        limited.append(epochs)
    cap = keras.config.max_steps_per_epoch()
    for count in steps.values():
        if cap and (not count or cap < count):
            _messages.warn(f"Limiting steps_per_epoch to {cap}")
            count = cap
        limited.append(count)
    return tuple(limited) if len(limited) > 1 else limited[0]


def fit_data(trainer, x, y, sample_weight, *, batch_size, shuffle, class_weight,
              validation_split, validation_data, validation_batch_size,
              validation_steps, validation_freq, steps_per_epoch, epochs, initial_epoch):
    """A fit's sources, checked, and `trainer`'s model built from them: `(batches, val, plan)`.

    The training source, the validation source (or None), and the memory
    plan of the train step (None off accelerators).

    In the order `model.fit` meets them: the training data (split off
    its validation rows), the model built on its first batch, the
    memory plan of the step on accelerators, the validation data and
    its labels, the passes each source is read for, the labels.
    """
    x = sources.model_inputs(x, y, trainer.model)
    if validation_split:
        (x, y, sample_weight), validation_data = sources.split_validation(
            x, y, sample_weight, validation_split, validation_data)
    trainer.builder.require_compiled("fit")
    batches = trainer.batches_of(x, y, sample_weight, batch_size, shuffle, class_weight,
                                 keras_peeks=build.keras_reads_a_batch_to_build(trainer.model),
                                 what=sources.TRAINING)
    if steps_per_epoch is not None:
        batches = sources.StepsPerEpoch(batches, steps_per_epoch,
                                         trainer.steps_per_execution, epochs)
    sources.check_ends(batches, "x", "steps_per_epoch")
    with sources.naming_list_reading(x, y):
        trainer.build(batches.peek())
    trainer.builder.check_trainable_unchanged()
    trainer.programs.use(donate=trainer.keep_last_good is not True)
    plan = None
    if memory.device_capacity(trainer.layout.devices[0]) is not None:  # GPUs, TPUs
        plan = memory.plan_of_step(trainer, batches.peek(), trainer.programs.train_step)
        memory.check_fits(memory.with_remedies(trainer, batches.peek(), plan))
    val = None
    if validation_data is not None:
        validation_data, val_batch_size = sources.validation_source(
            validation_data, batch_size, validation_batch_size, trainer.model)
        val = trainer.batches_of(validation_data, None, None, val_batch_size, False,
                                 steps=validation_steps, keras_peeks=False,
                                 keras_resets="each pass", what=sources.VALIDATION)
        sources.check_ends(val, "validation_data", "validation_steps")
        # Bad validation labels fail now, not after epoch 1.
        trainer.builder.build(sources.unpack(val.peek()), data="the validation data")
    options.check_validation_freq(validation_freq)
    sources.check_one_pass(batches, epochs - initial_epoch, "x",
                           f"epochs={epochs}, initial_epoch={initial_epoch}")
    if val is not None:
        validations = options.validations(range(initial_epoch, epochs), validation_freq)
        sources.check_one_pass(val, validations, "validation_data",
                               f"epochs={epochs}, validation_freq={validation_freq!r}")
    trainer.builder.check_labels((batches, "the training data"), (val, "the validation data"))
    return batches, val, plan


def inference_data(trainer, x, y, sample_weight, *, batch_size, steps, call):
    """`evaluate`'s or `predict`'s (`call`) data as a `Source`, and the model built from it.

    Read as `model.evaluate` and `model.predict` read it
    (`sources.model_inputs`, `sources.predict_inputs`), cut to `steps`;
    evaluating needs a compiled model and builds its loss and metrics too,
    predicting builds the layers only. All in the hosts' `preparing` round
    of `call`, with the settings every process must share.
    """
    training = call == "evaluate"
    with trainer.hosts.preparing(call) as settings:
        limited = keras_limits(steps=steps)
        if training:
            trainer.builder.require_compiled("evaluate")
            x = sources.model_inputs(x, y, trainer.model)
        else:
            x = sources.predict_inputs(x, trainer.model)
        batches = trainer.batches_of(
            x, y, sample_weight, batch_size, False, steps=limited, keras_resets=training,
            keras_peeks=build.keras_reads_a_batch_to_build(trainer.model, for_training=training))
        sources.check_ends(batches, "x", "steps")
        with sources.naming_list_reading(x, y):
            trainer.build(batches.peek(), for_training=training)
        settings += trainer.hosts.inference_settings(trainer, batches, batch_size=batch_size,
                                                     steps=steps)
    return batches


def feed_of(trainer, batches, plan=None):
    """The feed of `trainer`'s fit on `batches`, and its train programs' donation chosen.

    The feed first (`feed.make_feed`): its data takes memory, which the
    choice of `keep_last_good` then sees (`memory.keep_last_good_of`).
    `plan`: the fit's `MemoryPlan` of its step, where it made one.
    """
    chosen = feed.make_feed(batches, choice=trainer.data_on_device, layout=trainer.layout,
                            hosts=trainer.hosts, programs=trainer.programs,
                            steps_per_execution=trainer.steps_per_execution, plan=plan)
    trainer.programs.use(donate=not memory.keep_last_good_of(trainer, plan))
    return chosen
