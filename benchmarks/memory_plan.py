"""The planned bytes of one train step, by micro-batches and with rematerialization.

    python benchmarks/memory_plan.py [--devices 2] [--batch-size 8192]

Plans (`keras_dp.memory_plan`, nothing placed) the step of a stack of six
128-wide gelu Dense layers, whose temporaries are mostly activations, at
`micro_batches` 1, 2, 4 and 8, and built under `keras.RematScope(mode="full")`,
and prints one markdown row each: temporaries and peak per device.
"""

import argparse
import contextlib
import os

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=8192)
args = parser.parse_args()
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    f"--xla_force_host_platform_device_count={args.devices}"])

import keras_dp  # noqa: E402  (first: it selects Keras's JAX backend)
import keras  # noqa: E402
import numpy as np  # noqa: E402


def build(remat=False):
    keras.utils.set_random_seed(0)
    with keras.RematScope(mode="full") if remat else contextlib.nullcontext():
        model = keras.Sequential(
            [keras.Input((128,))]
            + [keras.layers.Dense(128, activation="gelu") for _ in range(6)]
            + [keras.layers.LayerNormalization(), keras.layers.Dense(10)])
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


x, y = np.zeros((8, 128), "float32"), np.zeros(8, "int64")
print(f"| setting ({args.devices} devices, batch {args.batch_size}) | temporaries | peak |")
print("|---|---|---|")
for name, model, micro in ([(f"micro_batches={m}", build(), m) for m in (1, 2, 4, 8)]
                           + [("keras.RematScope(mode='full')", build(True), 1)]):
    plan = keras_dp.memory_plan(model, x, y, batch_size=args.batch_size, micro_batches=micro)
    print(f"| {name} | {keras_dp.diagnostics.memory.format_bytes(plan.temporaries)} | "
          f"{keras_dp.diagnostics.memory.format_bytes(plan.peak)} |")
