"""keras_dp on a 2x2 ("batch", "model") mesh against Keras's `fit` on one device, in float64.

Trains a model split over the "model" axis by its `ModelParallel` layout map
(`--model dense`: a small MLP and a hand-written map; `--model gemma`: a
tiny keras_hub `GemmaCausalLM` from a config, random weights, with
`GemmaBackbone.get_layout_map`), with `--lora` after `enable_lora(rank=2)`,
for 2 epochs of 13 rows at global batch 5 (batches of 5, 5 and 3 rows,
split 3 + 2, 3 + 2 and 2 + 1 over the batch axis), with `shuffle=False`.
Prints one JSON line per case:

- `argument`: `fit_sharded(..., distribution=...)`, the model built under
  `distribution.scope()`;
- `global`: the model built after `keras.distribution.set_distribution`,
  `fit_sharded` with no distribution argument;
- `keras_peer`: Keras's own `model.fit` under the same distribution, at
  batch 4 on 12 rows (a batch that divides) against keras_dp on the same
  rows, and at batch 5, where Keras refuses.

Each line gives, per variable path, the largest difference from the
reference (Keras's `fit` on one device, the same initial weights)
relative to the reference's largest entry, the optimizer's too, and the
layouts after the fit. A script, so that float64 and the device count are
set before JAX and Keras start.

Keras and keras_hub compute some things in float32 under floatx float64:
`keras.backend.result_type` maps float64 to float32 (`keras_float64`),
Gemma's RMSNorm casts to float32, its attention softmax has a float32
dtype policy, and `enable_lora` makes float32 LoRA weights. This script
makes each float64 (`float64_everywhere`), so that every computation of
both runs is float64; left as they are, a sharded run differs from one
device by float32 rounding (1e-7, research notes in docs/guides/model-axis.md).
"""

import argparse
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--model", choices=["dense", "gemma"], default="dense")
parser.add_argument("--lora", action="store_true")
parser.add_argument("--cases", default="argument,global,keras_peer")
parser.add_argument("--state-sharding", default="replicated")
parser.add_argument("--width", type=int, default=32, help="the dense model's first layer")
args = parser.parse_args()
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_force_host_platform_device_count=4"])
os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_ENABLE_X64"] = "1"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_float64 import keep_keras_in_float64  # noqa: E402

ROWS, BATCH, EPOCHS, VOCAB, LENGTH = 13, 5, 2, 64, 8


def float64_everywhere():
    """Keras's and keras_hub's float32 parts in float64 (see the module doc)."""
    keep_keras_in_float64()
    add_weight = keras.layers.Layer.add_weight

    def floatx_lora(self, *arguments, **keywords):
        if str(keywords.get("name", "")).startswith("lora_kernel"):
            keywords["dtype"] = None  # floatx, where Keras asks for float32
        return add_weight(self, *arguments, **keywords)

    keras.layers.Layer.add_weight = floatx_lora
    if args.model == "gemma":
        from keras_hub.src.models.gemma import rms_normalization

        def call(self, x):  # RMSNormalization.call without its float32 casts
            variance = keras.ops.mean(keras.ops.square(x), axis=-1, keepdims=True)
            return x * keras.ops.reciprocal(keras.ops.sqrt(variance + self.epsilon)) * (
                1 + self.scale)

        rms_normalization.RMSNormalization.call = call


def dense_model():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(args.width, activation="tanh", name="up")(inputs)
    hidden = keras.layers.Dense(16, activation="tanh", name="mid")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(4, name="down")(hidden))
    if args.lora:
        for name in ("up", "mid"):
            model.get_layer(name).enable_lora(2)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def dense_distribution():
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], jax.devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = ("batch", "model")  # split over both axes, as Gemma's map does
    layout_map[".*mid/kernel"] = ("model", None)
    layout_map[".*down/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def dense_data(rows):
    rng = np.random.default_rng(1)
    return rng.normal(size=(rows, 8)), rng.normal(size=(rows, 4)), None


def gemma_model():
    import keras_hub

    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32, head_dim=4)
    for layer in backbone._flatten_layers():
        if type(layer).__name__ == "CachedGemmaAttention":
            layer.softmax.dtype_policy = "float64"  # keras_hub's is float32
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    if args.lora:
        model.backbone.enable_lora(rank=2)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[])
    return model


def gemma_distribution():
    import keras_hub

    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], jax.devices()[:4])
    return keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh), batch_dim_name="batch")


def gemma_data(rows):
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, VOCAB, size=(rows, LENGTH + 1)).astype("int32")
    mask = np.ones((rows, LENGTH), dtype=bool)
    mask[::3, -2:] = False
    return ({"token_ids": tokens[:, :-1], "padding_mask": mask}, tokens[:, 1:],
            mask.astype("float64"))


make_model, make_distribution, make_data = {
    "dense": (dense_model, dense_distribution, dense_data),
    "gemma": (gemma_model, gemma_distribution, gemma_data)}[args.model]


def fresh(initial, scope=None):
    """A model with the `initial` values (built under `scope`, a distribution, if given)."""
    keras.utils.set_random_seed(0)
    if scope is None:
        model = make_model()
    else:
        with scope.scope():
            model = make_model()
    for variable, value in zip(model.variables, initial):
        variable.assign(value)
    return model


def keras_fit(model, rows, batch_size):
    x, y, sample_weight = make_data(rows)
    return model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size, epochs=EPOCHS,
                     shuffle=False, verbose=0).history["loss"]


def ours_fit(model, rows, batch_size, **keywords):
    x, y, sample_weight = make_data(rows)
    return keras_dp.fit_sharded(model, x, y, sample_weight=sample_weight, batch_size=batch_size,
                                epochs=EPOCHS, shuffle=False, verbose=0, **keywords
                                ).history["loss"]


def differences(model, reference):
    """Per weight path, then per optimizer variable: max |difference| / max |reference|."""
    return tuple({b.path: _difference(a, b) for a, b in zip(ours, theirs, strict=True)}
                 for ours, theirs in ((model.weights, reference.weights),
                                      (model.optimizer.variables, reference.optimizer.variables)))


def _difference(ours, theirs):
    a, b = np.asarray(ours.numpy(), "float64"), np.asarray(theirs.numpy(), "float64")
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b)) / scale) if scale else float(np.max(np.abs(a - b)))


def layouts(model):
    return {v.path: [None if axis is None else str(axis) for axis in v.value.sharding.spec]
            for v in model.weights}


def main():
    float64_everywhere()
    keras.utils.set_random_seed(0)
    initial = [np.array(v.numpy()) for v in make_model().variables]
    reference = fresh(initial)
    reference_loss = keras_fit(reference, ROWS, BATCH)
    distribution = make_distribution()
    cases = args.cases.split(",")
    common = {"model": args.model, "lora": args.lora, "dtype": keras.config.floatx(),
              "state_sharding": args.state_sharding,
              "result_type": keras.backend.result_type("float64", "float32")}
    for case in ("argument", "global"):
        if case not in cases:
            continue
        if case == "argument":
            model = fresh(initial, distribution)
            built = layouts(model)
            loss = ours_fit(model, ROWS, BATCH, distribution=distribution,
                            state_sharding=args.state_sharding)
        else:
            keras.distribution.set_distribution(distribution)
            try:
                model = fresh(initial)
                built = layouts(model)
                loss = ours_fit(model, ROWS, BATCH)
            finally:
                keras.distribution.set_distribution(None)
        weights, slots = differences(model, reference)
        shardings = keras_dp.ShardedTrainer(model, distribution=distribution,
                                            state_sharding=args.state_sharding).state_layout()
        state_layouts = {
            variable.path: [None if axis is None else str(axis) for axis in placed.spec]
            for variables, placed_group in zip(keras_dp.TrainState.variables_of(model), shardings)
            for variable, placed in zip(variables, placed_group)}
        print(json.dumps({
            **common, "case": case, "weights": weights, "optimizer": slots,
            "state_layouts": state_layouts,
            "loss": loss, "reference_loss": reference_loss, "built_layouts": built,
            "layouts": layouts(model),
            "trainable": [v.path for v in model.trainable_variables],
            "slots": [v.path for v in model.optimizer.variables],
            "iterations": int(model.optimizer.iterations.numpy())}), flush=True)
    if "keras_peer" in cases:
        peer_rows, peer_batch = 12, 4  # 4 rows split 2 + 2: Keras's fit takes it
        reference = fresh(initial)
        keras_fit(reference, peer_rows, peer_batch)
        theirs = fresh(initial, distribution)
        with distribution.scope():
            keras_fit(theirs, peer_rows, peer_batch)
        ours = fresh(initial, distribution)
        ours_fit(ours, peer_rows, peer_batch, distribution=distribution)
        refused = fresh(initial, distribution)
        try:
            with distribution.scope():
                keras_fit(refused, ROWS, BATCH)
            error = None
        except Exception as exc:  # noqa: BLE001 - Keras's refusal, recorded
            error = f"{type(exc).__name__}: {exc}"
        print(json.dumps({
            **common, "case": "keras_peer",
            "ours_vs_keras_parallel": differences(ours, theirs)[0],
            "keras_parallel_vs_one_device": differences(theirs, reference)[0],
            "ours_vs_one_device": differences(ours, reference)[0],
            "keras_parallel_layouts": layouts(theirs), "layouts": layouts(ours),
            "keras_batch_5_error": error}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
