"""Every private Keras, JAX and Grain hook keras_dp uses, one small function each.

keras_dp uses public APIs wherever one exists. What is left here has no
public equivalent; each function names the private attribute it reads, and
`tests/test_compat.py` checks each one against the installed Keras, JAX
and Grain, so that a release that changes one fails there, loudly, not
deep in a run.
"""

import contextlib
import inspect

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
    import keras

    return type(model).call is not keras.Model.call


def input_structure(model):
    """The nesting of a Functional model's inputs (`_inputs_struct`), or None.

    `model.inputs` is flat; only this keeps `keras.Model([[a, b], c], ...)`'s
    `[[a, b], c]` (or a dict, a tuple), which `model.fit` matches its `x`
    against. A Sequential or subclassed model has none: None.
    """
    import keras

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

    import keras
    import numpy as np

    if "tensorflow" in sys.modules:
        keras.utils.set_random_seed(seed)
        return
    if not isinstance(seed, int):
        keras.utils.set_random_seed(seed)  # Keras's own message for a bad seed
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
    random.seed(seed)
    np.random.seed(seed)


def jax_backend_started():
    """Whether JAX has started a backend (then devices can no longer change).

    There is no public way to ask: `jax._src.xla_bridge.backends_are_initialized`.
    """
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def distributed_client():
    """The client of JAX's coordination service, or None in a single process.

    `jax._src.distributed.global_state.client`, the connection every process
    opens in `jax.distributed.initialize`; its key-value store
    (`key_value_set`, `blocking_key_value_get`, `key_value_try_get`,
    `key_value_delete`) carries small host-side values between processes
    without a device collective.
    """
    from jax._src import distributed

    return distributed.global_state.client


def distributed_processes():
    """`(process count, this process's index)` as `jax.distributed.initialize` set them.

    `jax._src.distributed.global_state.num_processes` and `.process_id`:
    read without starting JAX's backend, as `jax.process_count()` would.
    """
    from jax._src import distributed

    state = distributed.global_state
    return int(state.num_processes or 1), int(state.process_id or 0)


def detect_cluster(coordinator_address, num_processes, process_id, local_device_ids,
                   initialization_timeout):
    """What `jax.distributed.initialize` detects from the cluster (SLURM, Open MPI, Kubernetes, ...).

    `jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params`,
    the call JAX makes first for the arguments left None; made here first
    so that keras_dp knows whether this is process 0 (which starts the
    coordination service). Returns the four values, the given ones kept.
    """
    from jax._src import clusters

    return clusters.ClusterEnv.auto_detect_unset_distributed_params(
        coordinator_address, num_processes, process_id, local_device_ids, None,
        initialization_timeout)


def key_value_timed_out(error):
    """Whether a `JaxRuntimeError` of `blocking_key_value_get` is its wait running out.

    The coordination service says so only in the text ("DEADLINE_EXCEEDED").
    """
    return "DEADLINE_EXCEEDED" in str(error)


def key_value_not_found(error):
    """Whether a `JaxRuntimeError` of `key_value_try_get` says the key is not there ("NOT_FOUND")."""
    return "NOT_FOUND" in str(error)


def loss_function(loss):
    """The function a Keras `Loss` object wraps (`LossFunctionWrapper.fn`), else `loss` itself.

    `keras.losses.SparseCategoricalCrossentropy()` wraps
    `keras.losses.sparse_categorical_crossentropy`: how keras_dp tells
    which loss a model trains with, to check its labels and to know a
    classification loss.
    """
    return getattr(loss, "fn", loss)


def grain_inner_iterator(iterator):
    """The dataset iterator a `grain.DataLoader`'s iterator wraps (`_iterator`), or None.

    A `DataLoader`'s iterator has no `close`; the iterator it wraps does,
    and closing it stops Grain's prefetch threads and worker processes.
    """
    return getattr(iterator, "_iterator", None)


def grain_loader_epochs(loader):
    """`num_epochs` of a `grain.DataLoader`'s sampler (`_sampler._num_epochs`): None is endless.

    1 where the loader has no such sampler.
    """
    return getattr(getattr(loader, "_sampler", None), "_num_epochs", 1)


def grain_repeat_epochs(dataset):
    """`num_epochs` of a Grain `RepeatIterDataset` (`_num_epochs`): None repeats forever."""
    return getattr(dataset, "_num_epochs", 1)


# The program of the process that hosts JAX's coordination service apart
# from the training processes (`keras_dp.liveness.serve`). It imports only
# jaxlib (a fraction of a second), ignores SIGTERM and SIGINT (a scheduler's
# signal to the job, a terminal's Ctrl-C: the training processes need the
# service to save and stop together), says "ready" once the service listens,
# and ends 2 s after process 0 writes "done" to it, or `linger` seconds after
# process 0 is gone otherwise (its pipe closed, or its parent changed), so
# that the others can still learn which process stopped answering.
SERVICE_PROGRAM = r'''
import os, select, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
import jaxlib._jax as jaxlib_jax
address, processes, heartbeat, linger = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
parent = os.getppid()
try:
    service = jaxlib_jax.get_distributed_runtime_service(
        address, processes, heartbeat_timeout=heartbeat, recoverable=True)
except Exception as error:
    print("failed", str(error).splitlines()[0][:300], flush=True)
    os._exit(1)
print("ready", flush=True)
said = b""
while os.getppid() == parent:
    if select.select([0], [], [], 0.5)[0]:
        chunk = os.read(0, 64)
        said += chunk
        if not chunk:
            break
time.sleep(2 if said.startswith(b"done") else linger)
os._exit(0)
'''


class _NoService:
    """What process 0's `jax.distributed.initialize` holds instead of the service it would start."""

    def shutdown(self):
        """Nothing: the service lives in a process of its own (`SERVICE_PROGRAM`)."""


@contextlib.contextmanager
def joining_without_service():
    """`jax.distributed.initialize` inside the block starts no coordination service in process 0.

    JAX starts it in process 0 (`jax._src.distributed.State.initialize`
    calls `_jax.get_distributed_runtime_service` when `process_id == 0`),
    so process 0's death took the service down, and JAX's client then
    aborted every other process natively at once. Here that call returns a
    stand-in; the service runs in a process of its own (`SERVICE_PROGRAM`).
    """
    from jax._src import distributed

    real = distributed._jax

    class Without:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def get_distributed_runtime_service(*args, **kwargs):
            return _NoService()

    distributed._jax = Without()
    try:
        yield
    finally:
        distributed._jax = real


def live_processes(client, processes):
    """The processes among `processes` that JAX's coordination service counts alive: a set.

    `DistributedRuntimeClient.get_live_nodes`, which returns once every live
    process among them has asked (a barrier of the live ones), so every
    process asks in a loop; a process is dropped once the service has heard
    no heartbeat from it for the heartbeat timeout.
    """
    return set(client.get_live_nodes(list(processes)))


def wait_at_barrier(client, name, timeout_seconds):
    """Wait until every process has reached barrier `name` of JAX's coordination service.

    `DistributedRuntimeClient.wait_at_barrier`: the shutdown barrier JAX's
    client holds at exit blocks no process when the service is recoverable.
    """
    client.wait_at_barrier(name, int(1000 * timeout_seconds))


def grain_elastic(dataset):
    """Whether `dataset` is a `grain.experimental.ElasticIterator` (its position is global)."""
    import grain

    elastic = getattr(grain.experimental, "ElasticIterator", None)
    return elastic is not None and isinstance(dataset, elastic)


def grain_elastic_pass(dataset):
    """A fresh pass over an `ElasticIterator`: a new one on its dataset (`_ds` and its options).

    `iter()` of an `ElasticIterator` returns the same iterator every time,
    so its second pass would be empty; keras_dp reads one pass per epoch.
    """
    fresh = type(dataset)(dataset._ds, dataset._global_batch_size, dataset._shard_options,
                          read_options=dataset._read_options,
                          multiprocessing_options=dataset._multiprocessing_options)
    return iter(fresh)


def grain_elastic_batch_size(dataset):
    """The global batch size of an `ElasticIterator` (`_global_batch_size`)."""
    return int(dataset._global_batch_size)


def grain_elastic_dataset(dataset):
    """The `MapDataset` an `ElasticIterator` reads (`_ds`)."""
    return dataset._ds
