"""An emulation of Keras's merged, unreleased `lax.scan` `steps_per_execution`.

keras-team/keras#23527 (merged after Keras 3.15.1, so not in the Keras this
project installs) replaces the JAX trainer's Python loop over K jitted steps
with one jitted `jax.lax.scan` over K steps. `KerasScan` runs what that PR
runs, so that the coming Keras can be measured today. Read from the PR's
`keras/src/backend/jax/trainer.py` and its review thread; written here from
that description, none of it copied:

- The scanned step is Keras's own `model.train_step(state, data)`, the state
  the trainer's `(trainable, non_trainable, optimizer, metrics)` lists, so
  the loss tracker and the compiled metrics update every step, as in `fit`.
- The single step is `jit(train_step, donate_argnums=0, out_shardings=...)`;
  the K-step program is a second `jit` of `jax.lax.scan(body, state,
  super_batch, length=K)` whose body calls that jitted step, with the same
  donation and state shardings. The scan is rolled (no `unroll`). The logs
  returned are the last step's.
- On the host, K consecutive batches are stacked with `np.stack` into one
  `(K, batch, ...)` "super-batch" per leaf (the PR's array adapters stack
  their NumPy batches so), and each super-batch is placed on the devices
  with `jax.make_array_from_process_local_data` and the DataParallel data
  layout with a leading unsharded step axis: `PartitionSpec(None, "batch")`.
  Nothing is prefetched on CPU (the PR keeps Keras's one-batch-ahead
  iterator for other platforms only).
- A last group of fewer than K batches runs one jitted single step per batch
  (the PR's `PartialBatchList`), no sample dropped. With K = 1 every call is
  the single step: the PR uses its scan only for K > 1.

Where it may differ from the real PR: it is a bare loop, without `fit`'s
epoch iterator, data adapter, callbacks and log conversion, so if anything
it is faster than the Keras that will ship; the state is replicated with
`jax.device_put` under this benchmark's mesh instead of by Keras's
`DataParallel` variable layouts (the same sharding); and the data path
slices and stacks MNIST arrays directly instead of through
`ArrayDataAdapter`, which may copy each batch once more.
"""

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_dp import _compat
from systems import compiled_convnet
from systems import require_even_split
from systems import waits_each_step

KERAS_SCAN = "keras merged scan (emulated)"


class KerasScan:
    """Keras's merged K-step `lax.scan` over host-stacked batches (emulated).

    Args:
        batch: the global batch size; must divide by the device count.
        k: steps per execution; K > 1 runs the K-step scan.
        devices: the devices of the `"batch"` mesh.
        seed: fixes the model's initial weights.
        model: a compiled Keras model to train instead of the convnet (tests
            use a small one); `seed` is then unused.

    Raises:
        Unsupported: `batch` does not divide by the number of devices (Keras's
            `DataParallel` splits each batch evenly, or raises).
    """

    name = KERAS_SCAN

    def __init__(self, batch, k, devices, seed, model=None):
        require_even_split(batch, devices)
        self.batch, self.k = batch, k
        self.wait = waits_each_step(devices)
        self.model = compiled_convnet(seed) if model is None else model
        mesh = Mesh(np.asarray(devices), ("batch",))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.batch_sharding = NamedSharding(mesh, PartitionSpec("batch"))
        self.stacked_sharding = NamedSharding(mesh, PartitionSpec(None, "batch"))
        self.state = None
        self.step, self.steps = _make_functions(self.model, k, self.replicated)

    def prepare(self, x, y):
        if self.state is None:
            self.state = _initial_state(self.model, (x[:self.batch], y[:self.batch]),
                                        self.replicated)

    def run(self, x, y):
        """Train on every row of `x` once, K batches per dispatch, then wait."""
        group = self.batch * self.k
        whole = len(x) - len(x) % group if self.k > 1 else 0
        for start in range(0, whole, group):
            self._dispatch(self.steps, self._super_batch(x, y, start))
        for start in range(whole, len(x), self.batch):
            rows = slice(start, start + self.batch)
            self._dispatch(self.step, self._place((x[rows], y[rows]), self.batch_sharding))
        jax.block_until_ready(self.state)

    def _super_batch(self, x, y, start):
        """K consecutive batches from `start`, stacked to `(K, batch, ...)` and placed."""
        starts = range(start, start + self.batch * self.k, self.batch)
        stacked = tuple(np.stack([array[s:s + self.batch] for s in starts])
                        for array in (x, y))
        return self._place(stacked, self.stacked_sharding)

    def _place(self, data, sharding):
        return jax.tree.map(
            lambda leaf: jax.make_array_from_process_local_data(sharding, leaf), data)

    def _dispatch(self, function, data):
        logs, self.state = function(self.state, data)
        if self.wait:
            # One call in flight on XLA:CPU: see systems.py's module docstring.
            jax.block_until_ready(logs)


def _initial_state(model, batch, sharding):
    """Keras's `(trainable, non_trainable, optimizer, metrics)` state, replicated.

    Builds the loss, metrics and optimizer from a host batch as `fit` does
    first. Fresh host copies: placing a Keras variable's own buffer could
    alias it, and donating the state would then delete it.
    """
    _compat.symbolic_build(model, batch)
    state = tuple(
        [np.array(variable.value) for variable in variables]
        for variables in (model.trainable_variables, model.non_trainable_variables,
                          model.optimizer.variables, model.metrics_variables)
    )
    return jax.device_put(state, sharding)


def _make_functions(model, k, replicated):
    """`(single step, K-step scan or None)`, each `(state, data) -> (logs, state)`."""
    state_shardings = (None, replicated)  # logs inferred, state kept replicated
    step = jax.jit(model.train_step, donate_argnums=0, out_shardings=state_shardings)
    if k == 1:
        return step, None

    def k_steps(state, super_batch):
        def body(carry, data):
            logs, carry = step(carry, data)
            return carry, logs

        state, stacked_logs = jax.lax.scan(body, state, super_batch, length=k)
        return jax.tree.map(lambda log: log[-1], stacked_logs), state

    return step, jax.jit(k_steps, donate_argnums=0, out_shardings=state_shardings)


def weights(system):
    """The trainable variables the system holds, as host arrays (for tests).

    The model's own variables keep their initial values: the state holds the
    training, as in Keras's `fit` between its syncs.
    """
    return [np.asarray(value) for value in system.state[0]]
