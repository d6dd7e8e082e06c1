"""The training state (`keras_dp.core.state`): one definition, read from and written back to the model."""

import jax
import numpy as np

import keras_dp
from conftest import batches_of, convnet, devices, mlp


def test_state_is_donated_and_model_variables_survive(mnist):
    batch = batches_of(mnist, 1)[0]
    model = convnet()
    trainer = keras_dp.ShardedTrainer(model, devices=devices(2))
    trainer.build(batch)
    state = trainer.init_state()
    new_state, _ = trainer.train_step(state, trainer.shard(batch))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_state))
    before = [np.asarray(v.value) for v in model.trainable_variables]  # still readable
    trainer.write_back(new_state)
    after = [np.asarray(v.value) for v in model.trainable_variables]
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))


def test_the_state_follows_keras_variable_order_and_round_trips():
    model = mlp()
    model.build((None, 28, 28, 1))
    model.optimizer.build(model.trainable_variables)
    variables = keras_dp.TrainState.variables_of(model)
    assert variables.trainable == model.trainable_variables
    assert variables.optimizer == model.optimizer.variables
    mesh = keras_dp.make_mesh(devices(2))
    state = keras_dp.TrainState.from_model(model, mesh)
    assert state.weights == (state.trainable, state.non_trainable)
    assert [v.shape for v in state.trainable] == [tuple(v.shape) for v in model.trainable_variables]
    doubled = jax.tree.map(lambda value: value * 2, state)
    keras_dp.core.state.write_back(doubled, model)
    for variable, value in zip(model.trainable_variables, state.trainable):
        np.testing.assert_array_equal(np.asarray(variable.value), 2 * np.asarray(value))


def test_the_live_model_is_read_again_only_after_a_callback_changed_it():
    model = mlp()
    model.build((None, 28, 28, 1))
    model.optimizer.build(model.trainable_variables)
    mesh = keras_dp.make_mesh(devices(2))
    live = keras_dp.core.live.LiveModel(model)
    assert live.needs_read()
    live.read(keras_dp.TrainState.from_model(model, mesh), (0, 0))
    assert not live.needs_read()
    live.sync()  # a callback looked: nothing changed
    assert not live.needs_read()
    live.sync()
    model.trainable_variables[0].assign(np.zeros(model.trainable_variables[0].shape))
    assert live.needs_read()


def test_own_buffers_copies_only_a_variable_whose_buffer_another_holds():
    model = mlp()
    model.build((None, 28, 28, 1))
    model.optimizer.build(model.trainable_variables)
    kernel, bias = model.trainable_variables[:2]
    slot = next(v for v in model.optimizer.variables if v.shape == kernel.shape)  # a moment
    slot.assign(kernel)  # Keras's assign stores the array itself: one buffer for two
    assert slot.value is kernel.value
    untouched = bias.value
    assert keras_dp.core.state.own_buffers(model) == [slot.path]
    assert slot.value is not kernel.value
    assert slot.value.unsafe_buffer_pointer() != kernel.value.unsafe_buffer_pointer()
    np.testing.assert_array_equal(slot.value, kernel.value)
    assert bias.value is untouched  # a variable with a buffer of its own keeps it
    assert keras_dp.core.state.own_buffers(model) == []
