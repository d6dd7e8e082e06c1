"""The four training systems that `bench.py` times, behind one small interface.

Each system trains the guide's convnet (`keras_dp.models.convnet()`, compiled
as `keras_dp.models.compile_classifier` does: Adam(1e-3), sparse categorical
cross-entropy on logits, accuracy) over a fixed set of devices, and keeps its
model, optimizer state and compiled programs between calls, so that only the
first call compiles:

- `KerasDP`: keras_dp's `ShardedTrainer(...).fit(...)`, which is exactly what
  `keras_dp.fit_sharded` runs, with the trainer kept across calls (a fresh
  `fit_sharded` call would compile its steps again, as a fresh Keras model
  would).
- `KerasDataParallel`: Keras's own `model.fit` under
  `keras.distribution.DataParallel`.
- `GuideLoop`: the hand-written jitted loop of Keras's guide "Multi-GPU
  distributed training with JAX".
- `KerasDPRolled`, `KerasDPUnrolled`: keras_dp with its K-step scan rolled
  (`unroll=1`) or fully unrolled (`unroll=K`), to measure what the
  trainer's per-backend default (unrolled on CPU, rolled elsewhere) buys
  (opt-in: `--systems keras_dp,rolled,unrolled`).
- `KerasDPHost`: keras_dp with `data_on_device=False`, every batch copied
  from the host, to measure what device-resident data (`keras_dp.core.feed`,
  the default for arrays that fit) buys (opt-in: `--systems keras_dp,host`).
- `KerasDPDonating`: keras_dp with `keep_last_good=False`, the state
  donated to each step, to measure what keeping the last completed state
  costs (opt-in: `--systems keras_dp,donate`).
- `ComputeBound`: keras_dp's compiled train step over batches already on the
  devices: no host input, no callbacks, no Python data pipeline.

Interface: `prepare(x, y)` does untimed set-up for the data about to be timed,
`run(x, y)` trains on every row of `x` once and returns only when the devices
are done. `x` and `y` always hold a whole number of `batch * k` rows.

Importing this module imports JAX: set `XLA_FLAGS` first (`bench.py` does).

On CPU, every loop here waits for each dispatched step (or for each call of
K steps) before dispatching the next: queuing several programs that contain
cross-device all-reduces can deadlock or abort XLA:CPU's collectives on a
machine with few cores. On GPUs and TPUs the peers run as their authors
wrote them: the guide's loop and Keras's `fit` dispatch without waiting, and
`run` waits once, at its end.
"""

import contextlib

import jax
import keras
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

import keras_dp

# Short names used in the table and the JSON file.
KERAS_DP = "keras_dp"
KERAS = "keras DataParallel"
GUIDE = "guide jit loop"
BOUND = "compute bound"
ROLLED = "keras_dp rolled scan"
UNROLLED = "keras_dp unrolled scan"
HOST = "keras_dp host-fed"
DONATING = "keras_dp donating"


class Unsupported(Exception):
    """This system cannot run this configuration (the benchmark skips it)."""


def compiled_convnet(seed, steps_per_execution=1):
    """The guide's convnet with weights fixed by `seed`, compiled as
    `keras_dp.models.compile_classifier` does (plus `steps_per_execution`)."""
    keras.utils.set_random_seed(seed)
    model = keras_dp.models.convnet()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        steps_per_execution=steps_per_execution,
    )
    return model


def require_even_split(batch, devices):
    """Raise `Unsupported` unless `batch` divides by the device count.

    Keras's `DataParallel` splits each batch evenly, or raises later with
    an IndivisibleError.
    """
    if batch % len(devices):
        raise Unsupported(
            f"Keras DataParallel needs the batch size to divide by the "
            f"device count. Received: batch={batch}, devices={len(devices)}."
        )


def waits_each_step(devices):
    """Whether loops over `devices` must wait for each step (XLA:CPU only)."""
    return devices[0].platform == "cpu"


def block_on_model(model):
    """Wait until every variable of `model` has its final value."""
    jax.block_until_ready([variable.value for variable in model.variables])


class KerasDP:
    """keras_dp's `fit_sharded`, as its `ShardedTrainer` kept between calls."""

    name = KERAS_DP
    unroll = None  # the trainer's default: unrolled on CPU, rolled elsewhere
    data_on_device = "auto"  # the default: resident arrays when they fit
    keep_last_good = "auto"  # the default: undonated state when it fits

    def __init__(self, batch, k, devices, seed):
        self.batch, self.k = batch, k
        self.trainer = keras_dp.ShardedTrainer(
            compiled_convnet(seed), devices=devices, steps_per_execution=k,
            unroll=self.unroll, data_on_device=self.data_on_device,
            keep_last_good=self.keep_last_good,
        )

    def prepare(self, x, y):
        # Data on the devices is an argument of the resident programs, which
        # compile once per dataset shape: after the warm-up (whose first
        # call compiles, as `first_call_s` reports), one untimed epoch on
        # the data about to be timed.
        if self.data_on_device is not False and self.trainer.timings:
            self.run(x, y)

    def run(self, x, y):
        # fit keeps one step in flight on CPU and writes the weights back to
        # the host before it returns, so the devices are done on return.
        self.trainer.fit(x, y, batch_size=self.batch, epochs=1, shuffle=False, verbose=0)


class KerasDPRolled(KerasDP):
    """keras_dp with K steps as a rolled `lax.scan` (`unroll=1`), to compare.

    Raises:
        Unsupported: `k == 1`, where there is no scan.
    """

    name = ROLLED
    unroll = 1

    def __init__(self, batch, k, devices, seed):
        if k == 1:
            raise Unsupported("K=1 has no scan to roll")
        super().__init__(batch, k, devices, seed)


class KerasDPUnrolled(KerasDP):
    """keras_dp with K steps as a fully unrolled `lax.scan` (`unroll=K`), to compare.

    Raises:
        Unsupported: `k == 1`, where there is no scan.
    """

    name = UNROLLED

    def __init__(self, batch, k, devices, seed):
        if k == 1:
            raise Unsupported("K=1 has no scan to unroll")
        self.unroll = k
        super().__init__(batch, k, devices, seed)


class KerasDPHost(KerasDP):
    """keras_dp with every batch copied from the host (`data_on_device=False`)."""

    name = HOST
    data_on_device = False


class KerasDPDonating(KerasDP):
    """keras_dp donating its state to each step (`keep_last_good=False`).

    The default keeps the last completed state when it fits (on CPU, when
    it is under 1 GiB), which costs XLA the reuse of the state's buffers:
    this system measures that cost.
    """

    name = DONATING
    keep_last_good = False


class _WaitEachCall(keras.callbacks.Callback):
    """Wait for each `train_function` call's logs before Keras dispatches more.

    Keras dispatches asynchronously when no callback needs the logs; on
    XLA:CPU with several devices that queue of all-reducing programs can
    deadlock (see the module docstring). With `steps_per_execution=K` Keras
    runs its K jitted steps in a Python loop inside one call, so up to K
    steps are still queued between waits.
    """

    def on_train_batch_end(self, batch, logs=None):
        jax.block_until_ready(logs)


class KerasDataParallel:
    """Keras's `model.fit` under `keras.distribution.DataParallel(devices)`.

    The model is created, and every `fit` runs, with the distribution set;
    it is reset to `None` in between so the other systems' models are
    ordinary single-device Keras models.

    Raises:
        Unsupported: `batch` does not divide by the number of devices (Keras
            splits each batch evenly, or raises later with IndivisibleError).
    """

    name = KERAS

    def __init__(self, batch, k, devices, seed):
        require_even_split(batch, devices)
        self.batch, self.k = batch, k
        self.wait = waits_each_step(devices)
        self.distribution = keras.distribution.DataParallel(devices=devices)
        with self._distributed():
            self.model = compiled_convnet(seed, steps_per_execution=k)

    @contextlib.contextmanager
    def _distributed(self):
        keras.distribution.set_distribution(self.distribution)
        try:
            yield
        finally:
            keras.distribution.set_distribution(None)

    def prepare(self, x, y):
        del x, y

    def run(self, x, y):
        with self._distributed():
            self.model.fit(
                x, y, batch_size=self.batch, epochs=1, shuffle=False, verbose=0,
                callbacks=[_WaitEachCall()] if self.wait else [],
            )
            block_on_model(self.model)


class GuideLoop:
    """The training loop of Keras's guide "Multi-GPU distributed training with JAX".

    As in the guide: the state is a `(trainable, non_trainable, optimizer)`
    tuple of lists replicated with `NamedSharding(mesh, PartitionSpec())`;
    each host batch is put on the devices split along a `"batch"` axis; the
    step is `model.stateless_call` plus the loss under `jax.value_and_grad`,
    then `optimizer.stateless_apply`, jitted with the state donated. Unlike
    the guide, the forward pass runs with `training=True` (the guide omits
    it, so its BatchNorm and Dropout run in inference mode) so that it does
    the same work as the other systems; like the guide, it tracks no metrics.

    Raises:
        Unsupported: `batch` does not divide by the number of devices.
    """

    name = GUIDE

    def __init__(self, batch, k, devices, seed):
        del k  # one step per dispatch
        if batch % len(devices):
            raise Unsupported(
                f"jax.device_put splits a batch only evenly. Received: "
                f"batch={batch}, devices={len(devices)}."
            )
        self.batch, self.k = batch, 1
        self.wait = waits_each_step(devices)
        model = compiled_convnet(seed)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
        mesh = Mesh(np.asarray(devices), ("batch",))
        self.data_sharding = NamedSharding(mesh, PartitionSpec("batch"))
        # Fresh host copies: device_put may alias a Keras variable's buffer,
        # which donating the state would then delete.
        state = tuple(
            [np.array(variable.value) for variable in variables]
            for variables in (model.trainable_variables,
                              model.non_trainable_variables, optimizer.variables)
        )
        self.state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
        self.step = jax.jit(_guide_train_step(model, optimizer), donate_argnums=0)

    def prepare(self, x, y):
        del x, y

    def run(self, x, y):
        for start in range(0, len(x), self.batch):
            x_batch = jax.device_put(x[start:start + self.batch], self.data_sharding)
            y_batch = jax.device_put(y[start:start + self.batch], self.data_sharding)
            self.state, loss = self.step(self.state, x_batch, y_batch)
            if self.wait:
                # Wait before the next dispatch: see the module docstring (the
                # guide does not, which can deadlock XLA:CPU collectives).
                loss.block_until_ready()
        jax.block_until_ready(self.state)


def _guide_train_step(model, optimizer):
    """The guide's pure step: `(state, x, y) -> (state, loss)`."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def compute_loss(trainable, non_trainable, x, y):
        y_pred, non_trainable = model.stateless_call(
            trainable, non_trainable, x, training=True
        )
        return loss_fn(y, y_pred), non_trainable

    grad_fn = jax.value_and_grad(compute_loss, has_aux=True)

    def train_step(state, x, y):
        trainable, non_trainable, optimizer_variables = state
        (loss, non_trainable), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        return (trainable, non_trainable, optimizer_variables), loss

    return train_step


class ComputeBound:
    """keras_dp's jitted `train_step` over batches placed on the devices up front.

    `prepare` shards every batch of the data to be timed once; `run` then
    only dispatches steps, so host input and `fit`'s bookkeeping are out of
    the measurement.
    """

    name = BOUND

    def __init__(self, batch, k, devices, seed):
        del k  # trainer.train_step runs one step per dispatch
        self.batch, self.k = batch, 1
        self.wait = waits_each_step(devices)
        self.trainer = keras_dp.ShardedTrainer(compiled_convnet(seed), devices=devices)
        self.state = None
        self.batches = []

    def prepare(self, x, y):
        if self.state is None:
            self.trainer.build((x[:self.batch], y[:self.batch]))
            self.state = self.trainer.init_state()
        self.batches = [
            self.trainer.shard((x[start:start + self.batch], y[start:start + self.batch]))
            for start in range(0, len(x), self.batch)
        ]
        jax.block_until_ready(self.batches)

    def run(self, x, y):
        del x, y  # the batches are on the devices already
        for batch in self.batches:
            self.state, logs = self.trainer.train_step(self.state, batch)
            if self.wait:
                jax.block_until_ready(logs)  # one step in flight: see the module docstring
        jax.block_until_ready(self.state)


SYSTEMS = {KERAS_DP: KerasDP, KERAS: KerasDataParallel, GUIDE: GuideLoop, BOUND: ComputeBound,
           ROLLED: KerasDPRolled, UNROLLED: KerasDPUnrolled}
