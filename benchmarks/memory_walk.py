"""A Gemma-shaped model walked from "does not fit" to "fits" by its memory plan.

    python benchmarks/memory_walk.py [--capacity-mib 96] [--batch-size 16]

On 4 simulated devices, plans (`keras_dp.memory_plan`, nothing placed but
the weights) the train step of a keras_hub `GemmaCausalLM` made from a
config (vocabulary 16,384, 4 layers of width 256, 4 query and 2 key-value
heads of 64, sequence 128) against a device of `--capacity-mib`, each
step adding one change to the last:

1. Keras's `DataParallel` over the 4 devices: every weight on every device;
2. `state_sharding="full"`: the weights and optimizer slots split 4 ways;
3. a 2x2 ("batch", "model") mesh with `GemmaBackbone.get_layout_map`: the
   attention heads and the feed-forward split over a model axis of 2;
4. `micro_batches=4`;
5. the decoder blocks built under `keras.RematScope(mode="list_of_layers")`
   (`mode="full"` fails Keras's own build of a keras_hub task: its
   `GemmaCausalLM.call` cannot run rematerialized).

Each model is created under its distribution's scope and
`keras_dp.sharded_birth()`. Prints one markdown row a step (bytes per
device: weights, optimizer, the step's temporaries and peak, `loading`,
and whether it fits), then the first plan in full, with the changes it
lists, then the machine.
"""

import argparse
import contextlib
import os
import platform
import subprocess

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--capacity-mib", type=float, default=96)
parser.add_argument("--batch-size", type=int, default=16)
args = parser.parse_args()
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_force_host_platform_device_count=4"])

import keras_dp  # noqa: E402  (first: it selects Keras's JAX backend)
import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

SEQUENCE, VOCABULARY, LAYERS = 128, 16384, 4


def distribution(shape):
    if shape is None:
        return keras.distribution.DataParallel(devices=jax.devices()[:4])
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], jax.devices()[:4])
    return keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh), batch_dim_name="batch")


def gemma(under, remat=False):
    keras.utils.set_random_seed(0)
    blocks = [f"decoder_block_{i}" for i in range(LAYERS)]
    rematerialized = (keras.RematScope(mode="list_of_layers", layer_names=blocks) if remat
                      else contextlib.nullcontext())
    with under.scope(), keras_dp.sharded_birth():
        with rematerialized:
            backbone = keras_hub.models.GemmaBackbone(
                vocabulary_size=VOCABULARY, num_layers=LAYERS, num_query_heads=4,
                num_key_value_heads=2, hidden_dim=256, intermediate_dim=1024, head_dim=64)
        model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


tokens = np.random.default_rng(0).integers(1, VOCABULARY, size=(8, SEQUENCE + 1)).astype("int32")
x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((8, SEQUENCE), bool)}
y = tokens[:, 1:]
capacity = int(args.capacity_mib * 2**20)
full = {"state_sharding": "full"}
steps = [("DataParallel, 4 devices", None, {}, False),
         ('+ state_sharding="full"', None, full, False),
         ("2x2 mesh, Gemma's layout map", (2, 2), full, False),
         ("+ micro_batches=4", (2, 2), {**full, "micro_batches": 4}, False),
         ("+ RematScope of the decoder blocks", (2, 2),
          {"state_sharding": "full", "micro_batches": 4}, True)]
mib = keras_dp.diagnostics.memory.format_bytes
print(f"| step (batch {args.batch_size}, capacity {mib(capacity)}) | weights | optimizer "
      "| temporaries | peak | loading | fits |")
print("|---|---|---|---|---|---|---|")
first = None
for name, shape, settings, remat in steps:
    under = distribution(shape)
    plan = keras_dp.memory_plan(gemma(under, remat), x, y, batch_size=args.batch_size,
                                capacity=capacity, distribution=under, **settings)
    first = first or plan
    print(f"| {name} | {mib(plan.weights)} | {mib(plan.optimizer)} | {mib(plan.temporaries)} "
          f"| {mib(plan.peak)} | {mib(plan.loading)} | {'yes' if plan.fits() else 'no'} |",
          flush=True)
print()
print("\n".join(line for line in str(first).splitlines() if not line.startswith("    ")
                or "arguments" in line))
cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                   if line.startswith("Model name")), platform.processor())
print(f"machine: {model_name}, {os.cpu_count()} cores; keras {keras.__version__}, "
      f"jax {jax.__version__}, keras_hub {keras_hub.__version__}")
