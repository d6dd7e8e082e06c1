"""Reference models that customise training the Keras 3 JAX way.

Builders only (no tests): small models in the style of the keras.io examples,
each fully seeded and small enough to train in seconds on CPU on 28x28x1
MNIST-like images. They exercise what keras_dp must support beyond Keras's
default step:

- `dcgan`: no `call()`, two sub-models, its own
  `compile(d_optimizer, g_optimizer, loss_fn)`, metric trackers as
  attributes, and a stateless `train_step(self, state, data)` that draws its
  latent vectors from a `keras.random.SeedGenerator` held in the model.
- `vae`: encoder + decoder, stateless `train_step` computing reconstruction +
  KL; the logs it returns (`loss`, ...) do not match its metrics' names.
- `add_loss_model`: a Functional model whose only loss comes from `add_loss`
  in a layer fed `(image, label)` inputs, compiled with only `optimizer=`.
- `eval_model`: overrides `test_step` only (default `train_step`).

Every loss is a mean over the batch (`ops.mean`, or a Keras loss with the
default `sum_over_batch_size` reduction), so splitting a batch over devices,
evenly or not, computes the same number.

On the JAX backend, `fit()` hands `train_step` the tuple `state =
(trainable_variables, non_trainable_variables, optimizer_variables,
metrics_variables)`, each a list of arrays in the order of the matching
model attribute (`model.trainable_variables`, ..., `model.optimizer.variables`,
`model.metrics_variables`), and expects `(logs, new_state)` back with the same
structure. Only `model.optimizer.variables` travel in that state, which is why
the GAN combines its two optimizers into one (`OptimizerPair`).
"""

import pathlib

import jax
import keras
import numpy as np
from keras import layers
from keras import ops

IMAGE_SHAPE = (28, 28, 1)


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------


def mnist_like(rows, seed=0):
    """`(images, labels)`: `rows` 28x28x1 float32 images in [0, 1], int32 labels.

    Real MNIST digits from keras_dp's bundled subset when it is there (5,000
    images, taken in order, so the data never depends on `seed`), otherwise
    random images drawn from `numpy.random.default_rng(seed)`.
    """
    bundled = pathlib.Path(__file__).resolve().parents[1] / "keras_dp" / "data" / "mnist_subset.npz"
    if bundled.is_file():
        with np.load(bundled) as data:
            if rows <= len(data["x_train"]):
                images = data["x_train"][:rows].astype("float32")[..., None] / 255.0
                return images, data["y_train"][:rows].astype("int32")
    rng = np.random.default_rng(seed)
    images = rng.random((rows,) + IMAGE_SHAPE, dtype=np.float32)
    return images, rng.integers(0, 10, size=rows).astype("int32")


# ----------------------------------------------------------------------------
# Helpers for stateless steps
# ----------------------------------------------------------------------------


def positions(all_variables, some_variables):
    """Indices of `some_variables` within `all_variables` (matched by identity)."""
    index = {id(variable): i for i, variable in enumerate(all_variables)}
    return [index[id(variable)] for variable in some_variables]


def take(values, indices):
    return [values[i] for i in indices]


def put(values, indices, new_values):
    """A copy of the list `values` with `values[indices[k]] = new_values[k]`."""
    values = list(values)
    for i, value in zip(indices, new_values, strict=True):
        values[i] = value
    return values


def stateless_metrics_update(model, metrics_variables, update):
    """Run `update()` (stateful metric code) against `metrics_variables`.

    The "open a StatelessScope and pretend everything is stateful" pattern:
    `update` may call `metric.update_state` / `metric.result()` on any of
    `model.metrics`; the returned list holds the new values in the order of
    `model.metrics_variables`.

    Returns:
        `(update(), new_metrics_variables)`.
    """
    variables = model.metrics_variables
    mapping = list(zip(variables, metrics_variables, strict=True))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        result = update()
    new = [scope.get_current_value(v) for v in variables]
    return result, [n if n is not None else old for n, old in zip(new, metrics_variables)]


# ----------------------------------------------------------------------------
# DCGAN
# ----------------------------------------------------------------------------


class OptimizerPair(keras.optimizers.Optimizer):
    """Two optimizers, each for its own sub-model, seen by Keras as one.

    On JAX, `fit()` carries only `model.optimizer.variables` in the training
    state (`JAXTrainer._get_jax_state`), builds only `model.optimizer`
    (`Trainer._symbolic_build`: `optimizer.build(trainable_variables)`) and
    syncs only `model.optimizer.variables` back. A GAN with a discriminator
    and a generator optimizer must therefore expose both through
    `model.optimizer`: `variables` is the discriminator optimizer's variables
    followed by the generator optimizer's; `build` builds each on its own
    sub-model's trainable variables.
    """

    def __init__(self, d_optimizer, g_optimizer, discriminator, generator):
        super().__init__(learning_rate=0.0, name="optimizer_pair")
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self._models = (discriminator, generator)

    @property
    def variables(self):
        return self.d_optimizer.variables + self.g_optimizer.variables

    def build(self, variables):
        del variables  # each optimizer takes its own sub-model's variables
        discriminator, generator = self._models
        if not self.d_optimizer.built:
            self.d_optimizer.build(discriminator.trainable_variables)
        if not self.g_optimizer.built:
            self.g_optimizer.build(generator.trainable_variables)
        self.built = True

    def split(self, optimizer_variables):
        """`(d_optimizer_values, g_optimizer_values)` from the combined list."""
        n = len(self.d_optimizer.variables)
        return list(optimizer_variables[:n]), list(optimizer_variables[n:])


class GAN(keras.Model):
    """keras.io's "GAN overriding `Model.train_step`", written statelessly for JAX.

    No `call()`: Keras's `fit()` cannot trace it, so the model marks itself
    built (as the keras.io Keras 3 GAN guides do with `self.built = True`);
    without that, `model.fit` raises "Unable to automatically build the
    model". The random latent vectors and the label noise come from
    `self.seed_generator`, whose state is one of the model's
    `non_trainable_variables`: the step threads it through the state, so a
    run is deterministic and resumable.
    """

    def __init__(self, discriminator, generator, latent_dim, seed=1337):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.built = True

    def compile(self, d_optimizer, g_optimizer, loss_fn, **kwargs):
        super().compile(
            optimizer=OptimizerPair(d_optimizer, g_optimizer, self.discriminator, self.generator),
            **kwargs,
        )
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def _indices(self):
        tv, ntv = self.trainable_variables, self.non_trainable_variables
        return {
            "d_tv": positions(tv, self.discriminator.trainable_variables),
            "g_tv": positions(tv, self.generator.trainable_variables),
            "d_ntv": positions(ntv, self.discriminator.non_trainable_variables),
            "g_ntv": positions(ntv, self.generator.non_trainable_variables),
            "seed": positions(ntv, [self.seed_generator.state]),
        }

    def _draw(self, non_trainable, idx, draw):
        """Run `draw()` (keras.random calls on `self.seed_generator`) statelessly."""
        state = self.seed_generator.state
        seed_value = take(non_trainable, idx["seed"])[0]
        with keras.StatelessScope(state_mapping=[(state, seed_value)]) as scope:
            out = draw()
        return out, put(non_trainable, idx["seed"], [scope.get_current_value(state)])

    @staticmethod
    def _train_half(loss_fn, optimizer, opt, trained, held, trainable, non_trainable, idx):
        """One half of the step: `optimizer` updates sub-model `trained` ("d" or "g").

        `loss_fn(trained_tv, trained_ntv, held_tv, held_ntv)` returns the
        loss and both sub-models' new non-trainable values; the `held`
        sub-model's weights are read, not updated. Returns the loss, the new
        optimizer values and the new trainable and non-trainable lists.
        """
        t_tv, t_ntv, h_tv, h_ntv = (f"{trained}_tv", f"{trained}_ntv", f"{held}_tv",
                                    f"{held}_ntv")
        (loss, (trained_ntv, held_ntv)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            take(trainable, idx[t_tv]), take(non_trainable, idx[t_ntv]),
            take(trainable, idx[h_tv]), take(non_trainable, idx[h_ntv]),
        )
        new_tv, opt = optimizer.stateless_apply(opt, grads, take(trainable, idx[t_tv]))
        trainable = put(trainable, idx[t_tv], new_tv)
        non_trainable = put(put(non_trainable, idx[t_ntv], trained_ntv), idx[h_ntv], held_ntv)
        return loss, opt, trainable, non_trainable

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        # fit(x) gives the bare batch; a dataset of (x,) gives a 1-tuple.
        real_images = data[0] if isinstance(data, (tuple, list)) else data
        batch_size = ops.shape(real_images)[0]
        idx = self._indices()
        d_opt, g_opt = self.optimizer.split(optimizer_variables)

        # 1. Train the discriminator on generated + real images.
        def draw_d():
            z = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
            labels = ops.concatenate(
                [ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0
            )
            noise = keras.random.uniform(ops.shape(labels), seed=self.seed_generator)
            return z, labels + 0.05 * noise

        (z, labels), non_trainable = self._draw(non_trainable, idx, draw_d)

        def d_loss_fn(d_tv, d_ntv, g_tv, g_ntv):
            fake, g_ntv = self.generator.stateless_call(g_tv, g_ntv, z, training=True)
            combined = ops.concatenate([ops.stop_gradient(fake), real_images], axis=0)
            predictions, d_ntv = self.discriminator.stateless_call(
                d_tv, d_ntv, combined, training=True
            )
            return self.loss_fn(labels, predictions), (d_ntv, g_ntv)

        d_loss, d_opt, trainable, non_trainable = self._train_half(
            d_loss_fn, self.d_optimizer, d_opt, "d", "g", trainable, non_trainable, idx)

        # 2. Train the generator to make the discriminator say "real" (0).
        def draw_g():
            return keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)

        z2, non_trainable = self._draw(non_trainable, idx, draw_g)
        misleading_labels = ops.zeros((batch_size, 1))

        def g_loss_fn(g_tv, g_ntv, d_tv, d_ntv):
            fake, g_ntv = self.generator.stateless_call(g_tv, g_ntv, z2, training=True)
            predictions, d_ntv = self.discriminator.stateless_call(
                d_tv, d_ntv, fake, training=True
            )
            return self.loss_fn(misleading_labels, predictions), (g_ntv, d_ntv)

        g_loss, g_opt, trainable, non_trainable = self._train_half(
            g_loss_fn, self.g_optimizer, g_opt, "g", "d", trainable, non_trainable, idx)

        # 3. Metrics.
        def update():
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {
                "d_loss": self.d_loss_tracker.result(),
                "g_loss": self.g_loss_tracker.result(),
            }

        logs, metrics_variables = stateless_metrics_update(self, metrics_variables, update)
        return logs, (trainable, non_trainable, d_opt + g_opt, metrics_variables)


def dcgan(seed=0, latent_dim=16):
    """A compiled DCGAN (keras.io style) on 28x28x1 images, seeded by `seed`.

    The generator has a BatchNormalization (moving statistics: non-trainable
    state updated by the step) and the discriminator a Dropout (its own
    SeedGenerator): with the GAN's latent SeedGenerator, the step updates
    three kinds of non-trainable state.
    """
    keras.utils.set_random_seed(seed)
    discriminator = keras.Sequential(
        [
            keras.Input(shape=IMAGE_SHAPE),
            layers.Conv2D(16, 3, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(32, 3, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dropout(0.2),
            layers.Dense(1),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input(shape=(latent_dim,)),
            # No bias before BatchNormalization (DCGAN's practice): its true
            # gradient is 0, and its value would be rounding noise.
            layers.Dense(7 * 7 * 16, use_bias=False),
            layers.BatchNormalization(),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((7, 7, 16)),
            layers.Conv2DTranspose(16, 4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(16, 4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, 7, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    gan = GAN(discriminator, generator, latent_dim=latent_dim, seed=1337 + seed)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=3e-4),
        g_optimizer=keras.optimizers.Adam(learning_rate=3e-4),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return gan


# ----------------------------------------------------------------------------
# VAE
# ----------------------------------------------------------------------------


class Sampling(layers.Layer):
    """Draws z from N(z_mean, exp(z_log_var)) with the layer's own SeedGenerator."""

    def __init__(self, seed=1337, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    """keras.io's VAE with a stateless JAX `train_step`.

    It has a `call()` (encoder then decoder), so Keras builds it by tracing.
    The step returns `{"loss", "reconstruction_loss", "kl_loss"}` while its
    metrics are named `total_loss`, `reconstruction_loss`, `kl_loss`: the key
    sets differ, so `fit()` reports the last step's logs at the end of each
    epoch (`Trainer._get_metrics_result_or_logs`).
    """

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def call(self, x, training=False):
        z_mean, z_log_var, z = self.encoder(x, training=training)
        return z_mean, z_log_var, self.decoder(z, training=training)

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x = data[0] if isinstance(data, (tuple, list)) else data

        def loss_fn(trainable, non_trainable):
            (z_mean, z_log_var, reconstruction), non_trainable = self.stateless_call(
                trainable, non_trainable, x, training=True
            )
            reconstruction_loss = ops.mean(
                ops.sum(keras.losses.binary_crossentropy(x, reconstruction), axis=(1, 2))
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            return reconstruction_loss + kl_loss, (reconstruction_loss, kl_loss, non_trainable)

        (total_loss, (reconstruction_loss, kl_loss, non_trainable)), grads = jax.value_and_grad(
            loss_fn, has_aux=True
        )(trainable, non_trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )

        # The guide's way: each tracker's slice of metrics_variables, in order.
        new_metrics_variables, logs = [], {}
        for tracker, value, key in (
            (self.total_loss_tracker, total_loss, "loss"),
            (self.reconstruction_loss_tracker, reconstruction_loss, "reconstruction_loss"),
            (self.kl_loss_tracker, kl_loss, "kl_loss"),
        ):
            start = len(new_metrics_variables)
            tracker_variables = metrics_variables[start:start + len(tracker.variables)]
            tracker_variables = tracker.stateless_update_state(tracker_variables, value)
            logs[key] = tracker.stateless_result(tracker_variables)
            new_metrics_variables += tracker_variables
        return logs, (trainable, non_trainable, optimizer_variables, new_metrics_variables)


def vae(seed=0, latent_dim=2):
    """A compiled convolutional VAE (keras.io style) on 28x28x1 images."""
    keras.utils.set_random_seed(seed)
    encoder_inputs = keras.Input(shape=IMAGE_SHAPE)
    h = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    h = layers.Conv2D(16, 3, activation="relu", strides=2, padding="same")(h)
    h = layers.Flatten()(h)
    h = layers.Dense(16, activation="relu")(h)
    z_mean = layers.Dense(latent_dim, name="z_mean")(h)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(h)
    z = Sampling(seed=1337 + seed)([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

    latent_inputs = keras.Input(shape=(latent_dim,))
    h = layers.Dense(7 * 7 * 16, activation="relu")(latent_inputs)
    h = layers.Reshape((7, 7, 16))(h)
    h = layers.Conv2DTranspose(16, 3, activation="relu", strides=2, padding="same")(h)
    h = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(h)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(h)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")

    model = VAE(encoder, decoder)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3))
    return model


# ----------------------------------------------------------------------------
# add_loss only
# ----------------------------------------------------------------------------


class ClassificationLossLayer(layers.Layer):
    """An endpoint layer: adds the batch-mean cross-entropy with `add_loss`.

    Like keras.io's CTC layer in the OCR example: it takes the targets as an
    input, so the model needs no `y` and no compiled loss.
    """

    def call(self, labels, probabilities):
        loss = keras.losses.sparse_categorical_crossentropy(labels, probabilities)
        self.add_loss(ops.mean(loss))
        return probabilities


def add_loss_model(seed=0):
    """A Functional model on `{"image", "label"}` trained only by `add_loss`.

    Compiled with only `optimizer=` (no loss, no metrics). Train with
    `fit(x={"image": images, "label": labels})`: Keras then hands the step a
    bare dict (no tuple). BatchNormalization and Dropout give the default
    step non-trainable state to update.
    """
    keras.utils.set_random_seed(seed)
    image = keras.Input(shape=IMAGE_SHAPE, name="image")
    label = keras.Input(shape=(), dtype="int32", name="label")
    h = layers.Conv2D(8, 3, strides=2, activation="relu")(image)
    h = layers.BatchNormalization()(h)
    h = layers.Flatten()(h)
    h = layers.Dropout(0.25)(h)
    probabilities = layers.Dense(10, activation="softmax", name="probabilities")(h)
    outputs = ClassificationLossLayer(name="loss_endpoint")(label, probabilities)
    model = keras.Model({"image": image, "label": label}, outputs)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3))
    return model


# ----------------------------------------------------------------------------
# test_step only
# ----------------------------------------------------------------------------


class EvalModel(keras.Model):
    """Overrides `test_step` only, as in keras.io's "Customizing fit() with JAX".

    The metric loop is the guide's: each of `self.metrics` updates its own
    slice of `metrics_variables`, with a dict result (the compiled metrics)
    flattened into the logs. It adds `batch_rows` (the rows of the last
    batch), a key with no metric behind it: `evaluate()` then returns the last
    step's logs as they are, and `_flatten_metrics_in_order` puts `loss`,
    `acc` first, then the other keys sorted.
    """

    def test_step(self, state, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        trainable, non_trainable, metrics_variables = state
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=False)
        loss, (trainable, non_trainable, metrics_variables) = self.stateless_compute_loss(
            trainable, non_trainable, metrics_variables,
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False,
        )
        new_metrics_variables, logs = [], {}
        for metric in self.metrics:
            start = len(new_metrics_variables)
            this = metrics_variables[start:start + len(metric.variables)]
            if metric.name == "loss":
                this = metric.stateless_update_state(
                    this, loss, sample_weight=ops.shape(jax.tree.leaves(x)[0])[0]
                )
            else:
                this = metric.stateless_update_state(this, y, y_pred, sample_weight=sample_weight)
            result = metric.stateless_result(this)
            if isinstance(result, dict):
                logs.update(result)
            else:
                logs[metric.name] = result
            new_metrics_variables += this
        logs["batch_rows"] = ops.cast(ops.shape(jax.tree.leaves(x)[0])[0], "float32")
        return logs, (trainable, non_trainable, new_metrics_variables)


def eval_model(seed=0):
    """A compiled MLP classifier on 28x28x1 images with a custom `test_step`."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=IMAGE_SHAPE)
    h = layers.Flatten()(inputs)
    h = layers.Dense(32, activation="relu")(h)
    outputs = layers.Dense(10)(h)
    model = EvalModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
    )
    return model
