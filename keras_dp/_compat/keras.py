"""Keras's private hooks: its trainer, layers, callbacks, distribution and variables."""

import contextlib
import inspect

import jax
import keras
import numpy as np
from keras.src import backend as _keras_backend


def compute_output_spec(fn, *args, **kwargs):
    """Trace `fn` on `keras.KerasTensor`s and return its output spec.

    Keras's own symbolic tracing (`keras.src.backend.compute_output_spec`),
    the one `model.fit` builds with; it builds every layer it calls.
    """
    return _keras_backend.compute_output_spec(fn, *args, **kwargs)


def symbolic_build(model, batch):
    """Build the loss, metrics and optimizer from a host batch, as `model.fit` does.

    `Trainer._symbolic_build(data_batch=...)`.
    """
    model._symbolic_build(data_batch=batch)


def compile_arguments(model):
    """The keyword arguments of the model's last `compile()`, as the objects given.

    `model._compile_config.config`; the public `get_compile_config()` returns
    them serialised, and compiling from that would make new objects.
    """
    return dict(model._compile_config.config)


def compiled_loss(model):
    """The model's `CompileLoss`, or None when compiled without a loss (`_compile_loss`)."""
    return getattr(model, "_compile_loss", None)


def compiled_metrics(model):
    """The model's `CompileMetrics`, or None (`_compile_metrics`)."""
    return getattr(model, "_compile_metrics", None)


def all_layers(model):
    """Every layer of `model`, nested ones included (`_flatten_layers`)."""
    return model._flatten_layers()


def loss_tracker(model):
    """The `Mean` that holds `logs["loss"]` under `model.fit` (`_loss_tracker`)."""
    return model._loss_tracker


def metric_names(model):
    """The names of `model`'s metrics in Keras's order for logs and `evaluate`.

    `model.metrics` in order (the loss tracker, compiled metrics, per-output
    losses, the model's own metrics), with Keras's private `CompileMetrics`
    container expanded into its metrics, as `Trainer._flatten_metrics_in_order`
    does.
    """
    from keras.src.trainers.compile_utils import CompileMetrics

    names = []
    for metric in model.metrics:
        if isinstance(metric, CompileMetrics):
            names += [sub_metric.name for sub_metric in metric.metrics]
        else:
            names.append(metric.name)
    return names


def take_initial_epoch(model):
    """The epoch `BackupAndRestore` asks `fit` to resume at, cleared once read.

    Keras's `BackupAndRestore` sets `model._initial_epoch`; Keras's own fit
    leaves it set, keras_dp consumes it so a later fit starts where asked.
    """
    epoch = getattr(model, "_initial_epoch", None)
    model._initial_epoch = None
    return epoch


def shadow_state_sync(model, sync):
    """Make Keras's `Callback.model` call `sync` before handing out `model`.

    On the JAX backend, `Callback.model` calls `model.jax_state_sync()`; an
    instance attribute shadows the method for one fit. Keras's own sync
    still runs first: `model.evaluate` and `model.predict` (called by a
    callback mid-fit) empty the model's variables while they run and refill
    them through `jax_state_sync` at their end. Undo with
    `unshadow_state_sync`.
    """
    keras_sync = type(model).jax_state_sync

    def both():
        keras_sync(model)
        sync()

    model.jax_state_sync = both


def unshadow_state_sync(model):
    """Give `model` back Keras's own `jax_state_sync`."""
    del model.jax_state_sync


def state_sync_shadowed(model):
    """Whether a fit has shadowed `model`'s `jax_state_sync` (`shadow_state_sync`): a fit is running."""
    return "jax_state_sync" in vars(model)


def optimizer_trainable_variables(optimizer):
    """The variables `optimizer` was built for, in its slots' order (`_trainable_variables`)."""
    return optimizer._trainable_variables


def is_jax_trainer(model):
    """Whether `model` has Keras's JAX trainer API: `keras.Model`'s on the JAX backend.

    Keras's models get `compile`, `fit`, `train_step`, `stateless_call`,
    `compute_loss`, the optimizer and metrics from the JAX trainer mixin
    (`keras.src.backend.jax.trainer.JAXTrainer`); a `keras.layers.Layer`
    with it mixed in is a model to Keras (its own tests write
    `class ExampleModel(JAXTrainer, layers.Dense)`), without being a
    `keras.Model`.
    """
    from keras.src.backend.jax.trainer import JAXTrainer

    return isinstance(model, JAXTrainer)


def slot_prefix(weight):
    """How the name of an optimizer slot made for `weight` begins: `<weight path>_`.

    `BaseOptimizer.add_variable_from_reference` names each slot
    `f"{weight.path.replace('/', '_')}_{slot}"` ("dense_kernel_momentum").
    """
    return weight.path.replace("/", "_") + "_"


def variable_layout(variable):
    """The `TensorLayout` Keras gave `variable` when a distribution was active, or None (`_layout`)."""
    return getattr(variable, "_layout", None)


def layout_map(distribution):
    """A `keras.distribution.ModelParallel`'s `LayoutMap` (`_layout_map`)."""
    return distribution._layout_map


def has_call(model):
    """Whether `model` defines `call()` (Keras's `Model.call` only raises)."""
    return type(model).call is not keras.Model.call


def input_structure(model):
    """The nesting of a Functional model's inputs (`_inputs_struct`), or None.

    `model.inputs` is flat; only this keeps `keras.Model([[a, b], c], ...)`'s
    `[[a, b], c]` (or a dict, a tuple), which `model.fit` matches its `x`
    against. A Sequential or subclassed model has none: None.
    """
    if isinstance(model, keras.Sequential):
        return None
    return getattr(model, "_inputs_struct", None)


def custom_step(model, name):
    """Whether `model` overrides the JAX trainer's `name` ("train_step", ...).

    Compares the method `model.fit` would call with Keras's JAX trainer's
    own (`keras.src.backend.jax.trainer.JAXTrainer`): a subclass's override
    and a function set on the instance both count.

    Raises:
        TypeError: an override that takes only `data`, the TensorFlow form,
            which keras_dp (like Keras on JAX) cannot call.
    """
    from keras.src.backend.jax.trainer import JAXTrainer

    method = getattr(model, name)
    if getattr(method, "__func__", method) is getattr(JAXTrainer, name):
        return False
    parameters = inspect.signature(method).parameters.values()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) == 1 and not any(p.kind is p.VAR_POSITIONAL for p in parameters):
        raise TypeError(
            f"{type(model).__name__}.{name}({positional[0].name}) takes only the data: "
            "that is the TensorFlow form, and keras_dp runs Keras's JAX backend, "
            f"whose {name} is stateless: `def {name}(self, state, data)` returning "
            "`(logs, state)` (see keras.io, 'Customizing what happens in fit() "
            "with JAX')."
        )
    return True


def shut_down_callback_pool(callbacks):
    """Stop a `CallbackList`'s thread pool and reset it as `on_*_end` would.

    `CallbackList._executor` (a `ThreadPoolExecutor` started in `on_*_begin`
    when every callback may run asynchronously), `_futures` and
    `_in_begin_end_block_count`: Keras shuts the pool down only in
    `on_*_end`, and has no public call for a pass that an exception ended.
    """
    executor = getattr(callbacks, "_executor", None)
    if executor is not None:
        executor.shutdown(cancel_futures=True)
        callbacks._executor, callbacks._futures = None, []
        callbacks._in_begin_end_block_count = 0


def unsettled_monitor(callback):
    """Whether `callback` is a Keras monitoring callback whose direction is not set yet.

    Keras's private `MonitorCallback` (`EarlyStopping`, `ModelCheckpoint`,
    `ReduceLROnPlateau`, ...) leaves `monitor_op` None under `mode="auto"`
    until its first `on_epoch_end`; `settle_monitor` sets it.
    """
    return (hasattr(callback, "_set_monitor_op") and callback.monitor_op is None
            and callback.mode == "auto")


def settle_monitor(callback, model):
    """Set `callback.monitor_op` from `model`'s compiled metrics (`_set_monitor_op`).

    Keras infers whether the monitored log should fall or rise from the
    metrics of the model the callback holds; `callback.set_model(model)` first.
    """
    callback.set_model(model)
    callback._set_monitor_op()


def set_random_seed(seed):
    """`keras.utils.set_random_seed(seed)`, without importing TensorFlow to seed it.

    Keras's function imports TensorFlow whenever it is installed, only to
    seed it: 2-4 s on a CPU machine, and keras_dp's array input never uses
    it. Where TensorFlow is imported already (a `tf.data` pipeline exists),
    this is Keras's own function, which seeds it too. Otherwise it does the
    rest of what Keras's does: the global seed Keras's layers and
    initializers draw from (`rng_utils.GLOBAL_RANDOM_SEED` in Keras's
    `global_state`, and its global `SeedGenerator` dropped so that it is
    remade from that seed), and Python's and numpy's global generators.
    """
    import random
    import sys

    # Keras's own function where TensorFlow is imported; for a seed that is
    # not an int, it raises Keras's own message (ValueError).
    if "tensorflow" in sys.modules or not isinstance(seed, int):
        keras.utils.set_random_seed(seed)
        return
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
    random.seed(seed)
    np.random.seed(seed)


def loss_function(loss):
    """The function a Keras `Loss` object wraps (`LossFunctionWrapper.fn`), else `loss` itself.

    `keras.losses.SparseCategoricalCrossentropy()` wraps
    `keras.losses.sparse_categorical_crossentropy`: how keras_dp tells
    which loss a model trains with, to check its labels and to know a
    classification loss.
    """
    return getattr(loss, "fn", loss)


@contextlib.contextmanager
def sharded_birth():
    """While active, each Keras variable whose layout splits it gets its value part by part.

    Keras's JAX variables (`keras.src.backend.jax.core.JaxVariable`) take
    the layout of the distribution active when they are created, and two
    of their paths put the whole value on the default device first:
    `_initialize_with_initializer` runs the initializer whole and then
    splits the result, unless `should_shard_at_init` says the variable is
    large (4 bytes an element times the mesh's devices >= 250 MiB), when
    it runs the initializer jitted with the layout as its output sharding;
    and `assign` turns a value from the host (a numpy array; Keras reads
    each array of a `.weights.h5` file whole) into a `jax.Array` whole on the
    default device (`_convert_to_tensor`, `jnp.asarray`), which
    `_direct_assign` then splits. Inside this context,
    `should_shard_at_init` is true for every layout that splits its
    variable, so Keras's own jitted creation makes each device's part on
    that device; and a host value assigned to a split variable is read
    slice by slice into its layout (`jax.make_array_from_callback`; an
    array-like with `shape` and slicing, such as an h5py dataset, is sliced
    as it is). A variable left whole by its layout,
    one without a layout, an initializer drawing from a
    `keras.random.SeedGenerator` (which jit cannot advance), and a value
    already on a device keep Keras's paths. Values are Keras's: assigned
    ones bitwise; created ones bitwise for Keras's initializers, but
    `RandomNormal` within an ulp, XLA fusing its `mean + stddev * normal`
    in one program (as for Keras's own large variables). Entered again
    while active, it does nothing; the patches are undone when the
    outermost context exits.
    """
    from keras.src.backend.jax import core
    from keras.src.random import SeedGenerator

    variable_class = core.JaxVariable
    if getattr(variable_class._convert_to_tensor, "_sharded_birth", False):
        yield  # already active (keras_dp's build inside the user's context)
        return
    should_shard = core.should_shard_at_init
    initialize, convert = (variable_class._initialize_with_initializer,
                           variable_class._convert_to_tensor)

    def every_split(layout, shape):
        return not layout.is_fully_replicated or should_shard(layout, shape)

    def create(variable, initializer):
        if not isinstance(getattr(initializer, "seed", None), SeedGenerator):
            return initialize(variable, initializer)
        core.should_shard_at_init = should_shard  # Keras's rule for this one
        try:
            return initialize(variable, initializer)
        finally:
            core.should_shard_at_init = every_split

    def by_slices(variable, value, dtype=None):
        target = _split_sharding(variable)
        if (target is None or dtype is None or isinstance(value, (jax.Array, core.KerasVariable))
                or tuple(np.shape(value)) != tuple(variable.shape)):
            return convert(variable, value, dtype=dtype)
        source = value if hasattr(value, "__getitem__") and hasattr(value, "shape") else (
            np.asarray(value))
        dtype = jax.numpy.dtype(dtype)
        return jax.make_array_from_callback(
            tuple(variable.shape), target,
            lambda index: np.asarray(source[index]).astype(dtype, copy=False))

    by_slices._sharded_birth = True
    core.should_shard_at_init = every_split
    variable_class._initialize_with_initializer, variable_class._convert_to_tensor = (
        create, by_slices)
    try:
        yield
    finally:
        core.should_shard_at_init = should_shard
        variable_class._initialize_with_initializer, variable_class._convert_to_tensor = (
            initialize, convert)


def _split_sharding(variable):
    """The `jax.sharding.Sharding` a variable's layout splits it by, or None (`_layout`, `_shape`)."""
    from keras.src.distribution import TensorLayout

    layout = variable._layout
    if isinstance(layout, TensorLayout):
        layout = layout.backend_layout
    if (not isinstance(layout, jax.sharding.Sharding) or variable._shape is None
            or layout.is_fully_replicated):
        return None
    return layout
