"""A Gemma-shaped model on a ("batch", "model") mesh: step time, tokens/s, model FLOP/s.

    python benchmarks/model_axis.py                      # CPU, 4 simulated devices: 2x2, 4x1, Keras
    python benchmarks/model_axis.py --platform gpu --config 1b --meshes 1xN,Nx1 --systems keras_dp

Builds a keras_hub `GemmaCausalLM` from a config (random weights: no
download; `--config tiny` or `1b`), and for each mesh `BxM` (B devices on
the batch axis, M on the model axis; N is every device of the platform)
trains it with `keras_dp.fit_sharded`: under a
`keras.distribution.ModelParallel` with `GemmaBackbone.get_layout_map` when
M > 1, as pure data parallelism (keras_dp's own 1-D mesh, no distribution)
when M is 1. With `--systems` including `keras`, Keras's own `model.fit`
under the same `ModelParallel` runs on each mesh with a model axis, from
the same weights. The global batch must divide by B for Keras (keras_dp
takes any).

Each system (`ShardedTrainer.fit` or `model.fit`, one epoch of `--steps`
steps per call, on the same token rows) runs a first epoch that compiles,
then `--rounds` timed epochs, the systems alternating round by round; the
step time is the median epoch's seconds (from `on_epoch_begin` to
`on_epoch_end`) over the steps, and each ratio is the median of the
rounds' ratios. Tokens per second are
`batch * sequence_length / step`; model FLOPs per token are 6 times the
parameters plus the attention's 12 * layers * heads * head_dim * length
(PaLM's count, appendix B), so model FLOP/s per device is that times the
tokens per second over the devices. All ratios are within this one run.
One JSON document to `--out`.
"""

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent

CONFIGS = {
    # Small enough for 4 simulated CPU devices; kv heads divide a model axis of 2.
    "tiny": dict(vocabulary_size=2048, num_layers=2, num_query_heads=4, num_key_value_heads=2,
                 hidden_dim=128, intermediate_dim=512, head_dim=32),
    # About 1.06e9 parameters: Gemma 2B's widths and vocabulary, 8 layers,
    # 8 key-value heads (so a model axis of up to 8 divides them).
    "1b": dict(vocabulary_size=256_000, num_layers=8, num_query_heads=8, num_key_value_heads=8,
               hidden_dim=2048, intermediate_dim=16_384, head_dim=256),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default="cpu")
    parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--meshes", default="2x2,4x1",
                        help="comma-separated BxM (batch x model) shapes; N: every device")
    parser.add_argument("--systems", default="keras_dp,keras",
                        help="comma-separated subset of keras_dp, keras")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="steps per epoch")
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed epochs per system, the systems alternating; a first "
                             "epoch each compiles, untimed")
    parser.add_argument("--policy", default=None,
                        help="Keras dtype policy (default float32 on CPU, mixed_bfloat16 else)")
    parser.add_argument("--out", default=None,
                        help="JSON file (default benchmarks/results-model-axis-<platform>.json)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.meshes = args.meshes.split(",")
    args.systems = args.systems.split(",")
    unknown = set(args.systems) - {"keras_dp", "keras"}
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}: choose from keras_dp, keras")
    for mesh in args.meshes:
        parts = mesh.split("x")
        if len(parts) != 2 or not all(part == "N" or part.isdigit() for part in parts):
            parser.error(f"a mesh is BxM, each a count or N; received {mesh!r}")
    args.policy = args.policy or ("float32" if args.platform == "cpu" else "mixed_bfloat16")
    if args.out is None:
        args.out = str(HERE / f"results-model-axis-{args.platform}.json")
    return args


def mesh_shape(text, count):
    """`(batch, model)` of a `BxM` text, N being `count`; refuses one that is not `count` devices."""
    batch, model = (count if part == "N" else int(part) for part in text.split("x"))
    if batch * model != count:
        raise SystemExit(f"mesh {text} is {batch * model} devices; this run has {count}")
    return batch, model


class EpochTimes:
    """A Keras callback: each epoch's wall seconds."""

    def __new__(cls):
        import keras  # noqa: PLC0415

        class Callback(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds.append(time.perf_counter() - self.start)

        callback = Callback()
        callback.seconds = []
        return callback


def model_flops_per_token(config, parameters, length):
    """6 x parameters + 12 x layers x heads x head_dim x length (PaLM, appendix B)."""
    return 6 * parameters + 12 * config["num_layers"] * config["num_query_heads"] * (
        config["head_dim"] * length)


def run(args):
    """Every system built and warmed up (its first epoch compiles), then `--rounds` rounds of
    one timed epoch each, the systems alternating, so that a change in the machine's load
    falls on all of them alike."""
    import jax  # noqa: PLC0415
    import keras  # noqa: PLC0415
    import keras_hub  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import keras_dp  # noqa: PLC0415

    keras.mixed_precision.set_global_policy(args.policy)
    config = CONFIGS[args.config]
    count = len(jax.devices())
    rows = args.batch_size * args.steps
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, config["vocabulary_size"], (rows, args.sequence_length + 1))
    x = {"token_ids": tokens[:, :-1].astype("int32"),
         "padding_mask": np.ones((rows, args.sequence_length), "int32")}
    y = tokens[:, 1:].astype("int32")

    def build(distribution=None):
        keras.utils.set_random_seed(0)
        with distribution.scope() if distribution else contextlib.nullcontext():
            backbone = keras_hub.models.GemmaBackbone(**config)
            model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
            model.compile(optimizer=keras.optimizers.Adam(1e-4),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def system(name, text):
        """`(row, epoch)`: the system's result row and a function running one timed epoch."""
        batch, width = mesh_shape(text, count)
        distribution = None
        if width > 1:
            mesh = keras.distribution.DeviceMesh((batch, width), ["batch", "model"],
                                                 jax.devices())
            distribution = keras.distribution.ModelParallel(
                layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
                batch_dim_name="batch")
        model = build(distribution)
        timer = EpochTimes()
        if name == "keras_dp":
            trainer = keras_dp.ShardedTrainer(model, distribution=distribution,
                                              devices=None if distribution else jax.devices())

            def epoch():
                trainer.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0,
                            callbacks=[timer])
        else:
            def epoch():
                with distribution.scope():
                    model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0,
                              callbacks=[timer])
        return {"system": name, "mesh": text, "batch_axis": batch, "model_axis": width,
                "parameters": model.count_params(), "timer": timer}, epoch

    systems = [system(name, text) for text in args.meshes for name in args.systems
               if name == "keras_dp" or mesh_shape(text, count)[1] > 1]
    for row, epoch in systems:  # compile
        start = time.perf_counter()
        epoch()
        row["first_epoch_s"] = time.perf_counter() - start
    for _ in range(args.rounds):
        for _, epoch in systems:
            epoch()
    results = []
    flops = None
    for row, _ in systems:
        seconds = row.pop("timer").seconds[1:]
        step = statistics.median(seconds) / args.steps
        tokens_per_s = args.batch_size * args.sequence_length / step
        flops = model_flops_per_token(config, row["parameters"], args.sequence_length)
        results.append({**row, "step_s": step, "step_s_by_round": [
            epoch_s / args.steps for epoch_s in seconds], "tokens_per_s": tokens_per_s,
            "model_flops_per_s_per_device": tokens_per_s * flops / count})
        print(json.dumps(results[-1]), flush=True)
    return results


def ratios(results):
    """Step-time ratios, each the median over the rounds of that round's ratio: each
    keras_dp mesh against the first mesh's, and keras_dp against Keras's on the same mesh."""
    rounds = {(row["system"], row["mesh"]): row["step_s_by_round"] for row in results}
    ours = [mesh for system, mesh in rounds if system == "keras_dp"]
    pairs = [(("keras_dp", mesh), ("keras_dp", ours[0])) for mesh in ours[1:]]
    pairs += [(("keras_dp", mesh), ("keras", mesh)) for system, mesh in rounds
              if system == "keras" and ("keras_dp", mesh) in rounds]
    return {f"{a[0]} {a[1]} / {b[0]} {b[1]}": statistics.median(
        x / y for x, y in zip(rounds[a], rounds[b])) for a, b in pairs}


def main(argv=None):
    args = parse_args(argv)
    load = os.getloadavg()
    if args.platform == "cpu":
        flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
                 if not flag.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join(
            flags + [f"--xla_force_host_platform_device_count={args.devices}"])
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        os.environ["JAX_PLATFORMS"] = {"gpu": "cuda"}.get(args.platform, args.platform)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ["KERAS_DP_COMPILATION_CACHE"] = "0"  # compile times are not reused
    sys.path.insert(0, str(HERE))
    import bench  # noqa: PLC0415  (its machine record)

    results = run(args)
    report = {"command": " ".join(sys.argv), "arguments": {
        key: value for key, value in vars(args).items() if key != "out"},
        "config": CONFIGS[args.config], "rows": results, "ratios": ratios(results),
        "machine": bench.machine(len(__import__("jax").devices()), load)}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["ratios"], indent=1))


if __name__ == "__main__":
    main()
