"""Each private Keras/JAX hook in `keras_dp._compat` still does what keras_dp needs.

One test per hook: when a Keras or JAX release renames or changes one, the
test of that hook fails here, by name, instead of a run failing deep inside.
"""

import inspect
import os

import jax
import keras
import numpy as np
import pytest

from keras_dp import _compat


def _compiled_mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1)
    loss = keras.losses.MeanSquaredError()
    model.compile(optimizer=optimizer, loss=loss, metrics=["mae"])
    return model, optimizer, loss


def test_compute_output_spec_traces_and_builds_layers():
    layer = keras.layers.Dense(5)
    spec = _compat.compute_output_spec(layer, keras.KerasTensor((2, 3)))
    assert tuple(spec.shape) == (2, 5)
    assert layer.built and layer.kernel.shape == (3, 5)


def test_symbolic_build_builds_optimizer_loss_and_metrics():
    model, _, _ = _compiled_mlp()
    assert not model.optimizer.built
    _compat.symbolic_build(model, (np.zeros((2, 3), "float32"), np.zeros((2, 2), "float32"), None))
    assert model.optimizer.built
    assert _compat.compiled_loss(model).built and _compat.compiled_metrics(model).built
    # Adam-free SGD: the iteration count and learning rate.
    assert len(model.optimizer.variables) == 2


def test_optimizer_trainable_variables_are_those_it_was_built_for_in_order():
    model, optimizer, _ = _compiled_mlp()
    optimizer.build(model.trainable_variables)
    model.layers[0].trainable = False
    assert [id(v) for v in _compat.optimizer_trainable_variables(optimizer)] == [
        id(v) for v in model.layers[0].weights + model.layers[1].weights]


def test_slots_are_named_after_their_weights_path():
    model, _, _ = _compiled_mlp()
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    slots = optimizer.variables[2:]  # iteration and learning rate first
    owners = [[w for w in model.trainable_variables
               if slot.name.startswith(_compat.slot_prefix(w))] for slot in slots]
    assert [[id(w) for w in found] for found in owners] == [
        [id(w)] for w in model.trainable_variables for _ in ("momentum", "velocity")]


def test_a_variable_created_under_a_distribution_keeps_its_layout_and_the_map_is_readable():
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], jax.devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(layout_map=layout_map,
                                                    batch_dim_name="batch")
    with distribution.scope():
        layer = keras.layers.Dense(4)
        layer.build((None, 3))
    assert _compat.layout_map(distribution) is layout_map
    assert tuple(_compat.variable_layout(layer.kernel).axes) == (None, "model")
    assert _compat.variable_layout(layer.kernel).device_mesh is mesh
    assert _compat.variable_layout(keras.Variable(np.zeros(3))) is None


def test_compile_arguments_are_the_objects_given():
    model, optimizer, loss = _compiled_mlp()
    arguments = _compat.compile_arguments(model)
    assert arguments["optimizer"] is optimizer and arguments["loss"] is loss
    assert arguments["metrics"] == ["mae"]


def test_compiled_loss_and_metrics_are_none_without_them():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd")
    assert _compat.compiled_loss(model) is None
    assert _compat.compiled_metrics(model) is None


def test_all_layers_includes_nested_layers():
    inner = keras.Sequential([keras.layers.Dense(2, name="inner_dense")], name="inner")
    outer = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1, name="top")])
    names = {layer.name for layer in _compat.all_layers(outer)}
    assert {"inner", "inner_dense", "top"} <= names


def test_loss_tracker_is_the_mean_behind_logs_loss():
    model, _, _ = _compiled_mlp()
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    tracker = _compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean)
    assert tracker in model.metrics
    assert float(tracker.result()) == history.history["loss"][-1]


def test_initial_epoch_is_what_backup_and_restore_sets(tmp_path):
    model, _, _ = _compiled_mlp()
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    backup = keras.callbacks.BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    model.fit(x, y, epochs=2, verbose=0, callbacks=[backup])
    model2, _, _ = _compiled_mlp()
    backup2 = keras.callbacks.BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    backup2.set_model(model2)
    backup2.on_train_begin()
    assert _compat.take_initial_epoch(model2) == 2
    assert _compat.take_initial_epoch(model2) is None  # consumed


def test_callback_model_calls_the_shadowed_state_sync():
    model, _, _ = _compiled_mlp()
    calls = []
    callback = keras.callbacks.Callback()
    callback.set_model(model)
    _compat.shadow_state_sync(model, lambda: calls.append(1))
    try:
        assert callback.model is model
    finally:
        _compat.unshadow_state_sync(model)
    assert calls == [1]
    callback.model  # Keras's own sync again: nothing recorded
    assert calls == [1]


def test_the_shadowed_state_sync_runs_kerass_own_first():
    # model.predict in a callback empties the variables and refills them
    # through Keras's jax_state_sync: the shadow must still call it.
    model, _, _ = _compiled_mlp()
    x = np.arange(15, dtype="float32").reshape(5, 3)
    expected = model.predict(x, verbose=0)
    calls = []
    _compat.shadow_state_sync(model, lambda: calls.append(1))
    try:
        np.testing.assert_array_equal(model.predict(x, verbose=0), expected)
        np.testing.assert_array_equal(model.predict(x, verbose=0), expected)
    finally:
        _compat.unshadow_state_sync(model)
    assert calls == [1, 1]


def test_jax_backend_started_after_devices_are_listed():
    jax.devices()
    assert _compat.jax_backend_started() is True


def test_distributed_client_is_none_in_a_single_process_and_has_the_store_api():
    # This test process never joined others; the client class is what
    # `jax.distributed.initialize` makes, and keras_dp uses these methods.
    assert _compat.distributed_client() is None
    from jax._src.lib import _jax

    for method in ("key_value_set", "blocking_key_value_get", "key_value_try_get",
                   "key_value_delete"):
        assert hasattr(_jax.DistributedRuntimeClient, method)


def test_custom_step_tells_an_override_from_kerass_own():
    model, _, _ = _compiled_mlp()
    assert not _compat.custom_step(model, "train_step")

    class Custom(keras.Sequential):
        def train_step(self, state, data):
            return {}, state

    assert _compat.custom_step(Custom([keras.layers.Dense(1)]), "train_step")
    model.test_step = lambda state, data: ({}, state)  # set on the instance
    assert _compat.custom_step(model, "test_step")


def test_has_call_is_false_only_for_models_without_one():
    class NoCall(keras.Model):
        pass

    model, _, _ = _compiled_mlp()
    assert _compat.has_call(model) and not _compat.has_call(NoCall())


def test_input_structure_is_the_nesting_a_functional_model_was_built_with():
    a, b, c = keras.Input((1,)), keras.Input((2,)), keras.Input((3,))
    out = keras.layers.Concatenate()([a, b, c])
    structure = _compat.input_structure(keras.Model([[a, b], c], out))
    assert isinstance(structure, list) and isinstance(structure[0], list)
    assert [[t.shape for t in structure[0]], structure[1].shape] == [
        [(None, 1), (None, 2)], (None, 3)]
    pair = keras.layers.Concatenate()([a, b])
    assert isinstance(_compat.input_structure(keras.Model((a, b), pair)), tuple)
    assert sorted(_compat.input_structure(keras.Model({"b": b, "a": a}, pair))) == ["a", "b"]

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert _compat.input_structure(sequential) is None
    assert _compat.input_structure(Subclassed()) is None


def test_metric_names_expand_compiled_metrics_in_kerass_order():
    model, _, _ = _compiled_mlp()
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    assert _compat.metric_names(model) == ["loss", "mae"] == list(logs)


def test_a_callback_lists_pool_is_where_shut_down_callback_pool_stops_it():
    callbacks = keras.callbacks.CallbackList(
        [keras.callbacks.History()], add_history=False, add_progbar=False)
    callbacks.on_train_begin()  # History may run asynchronously: Keras starts its pool
    executor = callbacks._executor
    assert executor is not None and callbacks._in_begin_end_block_count == 1
    _compat.shut_down_callback_pool(callbacks)
    assert executor._shutdown
    assert callbacks._executor is None and callbacks._in_begin_end_block_count == 0


def test_settle_monitor_reads_the_direction_from_the_models_compiled_metrics():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    _compat.symbolic_build(model, (np.zeros((2, 3), "float32"), np.zeros((2,), "int32"), None))
    rising, falling = (keras.callbacks.EarlyStopping("val_accuracy"),
                       keras.callbacks.EarlyStopping("val_loss"))
    assert _compat.unsettled_monitor(rising) and _compat.unsettled_monitor(falling)
    assert not _compat.unsettled_monitor(keras.callbacks.EarlyStopping("val_loss", mode="min"))
    assert not _compat.unsettled_monitor(keras.callbacks.History())
    _compat.settle_monitor(rising, model)
    _compat.settle_monitor(falling, model)
    assert rising.model is model
    assert rising.monitor_op is keras.ops.greater and falling.monitor_op is keras.ops.less
    assert not _compat.unsettled_monitor(rising)


def test_grain_hooks_read_a_loaders_epochs_a_repeats_epochs_and_the_closable_iterator():
    grain = pytest.importorskip("grain")

    def loader(num_epochs):
        sampler = grain.samplers.IndexSampler(3, num_epochs=num_epochs, shuffle=False, seed=0)
        return grain.DataLoader(data_source=[1, 2, 3], sampler=sampler)

    assert _compat.grain_loader_epochs(loader(None)) is None
    assert _compat.grain_loader_epochs(loader(2)) == 2
    source = grain.MapDataset.source([1, 2, 3]).to_iter_dataset()
    assert _compat.grain_repeat_epochs(grain.experimental.RepeatIterDataset(source)) is None
    assert _compat.grain_repeat_epochs(grain.experimental.RepeatIterDataset(source, 2)) == 2
    iterator = iter(loader(1))
    inner = _compat.grain_inner_iterator(iterator)
    assert not hasattr(iterator, "close") and callable(inner.close)
    assert list(iterator) == [1, 2, 3]
    inner.close()


_SEED_DRAWS = r"""
import json, random, sys
import keras
import numpy as np
from keras_dp import _compat


def draws():
    layer = keras.layers.Dense(3)
    layer.build((None, 2))
    return [random.random(), float(np.random.rand()),
            keras.ops.convert_to_numpy(keras.random.normal((4,))).tolist(),
            keras.ops.convert_to_numpy(layer.kernel).tolist()]


random.random(), np.random.rand(), keras.random.normal((2,))  # state to reset
_compat.set_random_seed(7)
ours = draws()
imported = "tensorflow" in sys.modules
sys.modules["tensorflow"] = None  # Keras's own function, without TensorFlow to seed
keras.utils.set_random_seed(7)
print(json.dumps({"equal": ours == draws(), "tensorflow_imported": imported}))
"""


def test_set_random_seed_is_kerass_without_importing_tensorflow():
    import json
    import subprocess
    import sys

    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", _SEED_DRAWS], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "equal": True, "tensorflow_imported": False}


def test_loss_function_is_the_function_a_keras_loss_wraps():
    # labels.py and the ensemble read which loss a model trains with from it:
    # a rename in Keras would quietly switch their checks off.
    wrapped = keras.losses.SparseCategoricalCrossentropy(ignore_class=-1)
    assert _compat.loss_function(wrapped) is keras.losses.sparse_categorical_crossentropy
    assert _compat.loss_function(keras.losses.get("mse")) is keras.losses.mean_squared_error
    custom = lambda y, p: y  # noqa: E731
    assert _compat.loss_function(custom) is custom


def test_the_coordination_services_errors_say_what_keras_dp_reads_in_them(tmp_path):
    # exchange.py tells a wait that ran out, and a key not there, only from
    # the text of JAX's errors: if it changed, every read would count as the
    # service gone, and the failure reports across processes would stop.
    import socket
    import subprocess
    import sys

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    script = f"""
import jax
jax.distributed.initialize("127.0.0.1:{port}", num_processes=1, process_id=0)
from keras_dp import _compat
client = _compat.distributed_client()
try:
    client.blocking_key_value_get("keras_dp/test/missing", 50)
except jax.errors.JaxRuntimeError as error:
    print("timed out:", _compat.key_value_timed_out(error))
try:
    client.key_value_try_get("keras_dp/test/missing")
except jax.errors.JaxRuntimeError as error:
    print("not found:", _compat.key_value_not_found(error))
client.key_value_set("keras_dp/test/there", "1")
print("read:", client.key_value_try_get("keras_dp/test/there"))
jax.distributed.shutdown()
"""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=dict(env, JAX_PLATFORMS="cpu", PYTHONPATH=root))
    assert done.stdout.split("\n")[:3] == ["timed out: True", "not found: True", "read: 1"], (
        done.stdout + done.stderr[-2000:])


def test_is_jax_trainer_knows_keras_models_and_layers_with_the_trainer_mixed_in():
    from keras.src.backend.jax.trainer import JAXTrainer

    class Mixed(JAXTrainer, keras.layers.Dense):  # as Keras's own trainer tests write models
        def __init__(self):
            keras.layers.Dense.__init__(self, 2)
            JAXTrainer.__init__(self)

    assert _compat.is_jax_trainer(keras.Sequential([keras.layers.Dense(2)]))
    assert _compat.is_jax_trainer(Mixed())
    assert not _compat.is_jax_trainer(keras.layers.Dense(2))
    # What keras_dp calls on a model, the mixin gives a layer.
    for name in ("compile", "compute_loss_and_updates", "stateless_call", "train_step",
                 "test_step", "predict_step", "jax_state_sync", "reset_metrics"):
        assert callable(getattr(Mixed(), name)), name


def test_the_coordination_service_runs_apart_and_says_who_is_alive(tmp_path):
    # keras_dp.liveness starts JAX's coordination service in a process of
    # its own (SERVICE_PROGRAM, jaxlib's get_distributed_runtime_service,
    # recoverable), joins without starting one in process 0 (jax's
    # State.initialize calls `_jax.get_distributed_runtime_service` there),
    # and asks the client which processes are alive (get_live_nodes) and
    # waits at a barrier (wait_at_barrier) at exit.
    import socket
    import subprocess
    import sys

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    script = f"""
import jax
from keras_dp import _compat, liveness
service = liveness.serve({port}, 1, 5)
with _compat.joining_without_service():
    jax.distributed.initialize("127.0.0.1:{port}", num_processes=1, process_id=0)
from jax._src import distributed
print("stand-in:", type(distributed.global_state.service).__name__)
print("processes:", _compat.distributed_processes())
client = _compat.distributed_client()
print("alive:", sorted(_compat.live_processes(client, range(1))))
_compat.wait_at_barrier(client, "keras_dp/test", 5)
print("barrier passed")
jax.distributed.shutdown()
service.stdin.write(b"done"); service.stdin.close()
print("service ended:", service.wait(timeout=30))
"""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=dict(env, JAX_PLATFORMS="cpu", PYTHONPATH=root))
    assert done.stdout.split("\n")[:5] == [
        "stand-in: _NoService", "processes: (1, 0)", "alive: [0]", "barrier passed",
        "service ended: 0"], done.stdout + done.stderr[-2000:]


def test_a_missed_heartbeat_callback_cannot_be_set_from_python():
    # Why keras_dp watches instead (keras_dp.liveness): jaxlib's client takes
    # a `missed_heartbeat_callback`, but calls it with an absl::Status, which
    # it cannot hand to Python (std::bad_cast, then the process aborts). If a
    # release documents a Python-callable status, this test tells.
    from jax._src.lib import _jax

    doc = _jax.get_distributed_runtime_client.__doc__
    assert "missed_heartbeat_callback: collections.abc.Callable | None" in doc
    assert "recoverable: bool | None" in _jax.get_distributed_runtime_service.__doc__


def test_grain_elastic_hooks_read_a_fresh_pass_its_batch_and_its_dataset():
    grain = pytest.importorskip("grain")
    dataset = grain.MapDataset.source(np.arange(20))
    elastic = grain.experimental.ElasticIterator(dataset, 8, grain.sharding.NoSharding())
    assert _compat.grain_elastic(elastic) and not _compat.grain_elastic(dataset)
    assert _compat.grain_elastic_batch_size(elastic) == 8
    assert _compat.grain_elastic_dataset(elastic) is dataset
    passes = [[batch.tolist() for batch in _compat.grain_elastic_pass(elastic)]
              for _ in range(2)]
    assert passes[0] == passes[1] == [list(range(8)), list(range(8, 16))]  # drops 4
    iterator = _compat.grain_elastic_pass(elastic)
    next(iterator)
    assert iterator.get_state() == {"global_next_index": 8}  # global: the same on every host


def test_detect_cluster_reads_slurms_variables_as_jax_does(monkeypatch):
    # keras_dp detects the cluster before JAX does, to know whether this is
    # process 0 (which starts the coordination service apart).
    for name, value in [("SLURM_JOB_ID", "4096"), ("SLURM_STEP_NODELIST", "node[007-009]"),
                        ("SLURM_NTASKS", "3"), ("SLURM_PROCID", "2"), ("SLURM_LOCALID", "0")]:
        monkeypatch.setenv(name, value)
    address, processes, index, _ = _compat.detect_cluster(None, None, None, None, 10)
    assert (address, processes, index) == ("node007:61440", 3, 2)
    assert _compat.detect_cluster("h:1", 2, 0, None, 10)[:3] == ("h:1", 2, 0)


def test_sharded_birth_hooks_still_exist_and_split_at_creation():
    """`sharded_birth` patches Keras's `should_shard_at_init` and two `JaxVariable` methods.

    Keras's `_initialize_with_initializer` must still ask the module's
    `should_shard_at_init(layout, shape)` and then jit the initializer with
    the layout as output sharding; `assign` must still convert host values
    with `_convert_to_tensor(value, dtype=...)`; a variable must still keep
    its layout in `_layout` and its shape in `_shape`.
    """
    from keras.src.backend.jax import core

    assert list(inspect.signature(core.should_shard_at_init).parameters) == ["init_layout", "shape"]
    assert "should_shard_at_init(" in inspect.getsource(
        core.JaxVariable._initialize_with_initializer)
    assert list(inspect.signature(core.JaxVariable._convert_to_tensor).parameters) == [
        "self", "value", "dtype"]
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], jax.devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["w"] = ("batch", "model")
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    created = []
    original = jax.jit

    def jit(function, **kwargs):  # Keras's sharded creation: one jit, the layout as output
        created.append(kwargs.get("out_shardings"))
        return original(function, **kwargs)

    with distribution.scope(), _compat.sharded_birth():
        jax.jit = jit
        try:
            variable = keras.Variable(keras.initializers.GlorotUniform(seed=1), shape=(8, 4),
                                      name="w")
        finally:
            jax.jit = original
        assert variable._shape == (8, 4) and variable._layout is not None
        assert created and tuple(created[0].spec) == ("batch", "model")
        whole = np.arange(32, dtype="float32").reshape(8, 4)
        assert isinstance(_compat.keras._split_sharding(variable), jax.sharding.NamedSharding)
        variable.assign(whole)
    assert tuple(variable.value.sharding.spec) == ("batch", "model")
    np.testing.assert_array_equal(np.asarray(variable.value), whole)
    assert not getattr(core.JaxVariable._convert_to_tensor, "_sharded_birth", False)
