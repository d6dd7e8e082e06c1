"""Where an epoch's time goes, and a profiler trace of a few steps.

`EpochTimer` splits one epoch's wall time into the parts the loop already
separates. The loop marks the end of each part (`lap`) with
`time.perf_counter` at points where it passes anyway, so timing adds no
device synchronisation, and every moment of the epoch belongs to exactly
one part: the parts add up to the epoch's wall time.

- `input_s`: waiting for the next batch (or stack of K) from the input
  pipeline and its copy to the devices (`placement.steps`; near 0 when the
  look-ahead thread keeps up, or with data on the devices), and the Python
  interpreter that thread holds meanwhile;
- `steps_s`: dispatching the compiled calls and waiting on the bound of
  steps in flight (`inflight.Throttle`), the compilation of the first call
  included, and the wait for the last calls at the epoch's end;
- `callbacks_s`: the callbacks' epoch and batch hooks, including writing
  the state back into the model when a callback looks at it;
- `validation_s`: scoring the validation data, its callbacks included;
- `other_s`: the rest: resetting the metrics, reading the model, the logs
  to Python floats.

Each epoch also counts the FLOPs its training calls ran, from XLA's cost
analysis of the compiled programs (`keras_dp.core.programs`; per device, summed
over the devices), and divides them by the same training time as its
samples per second (wall time without validation: input waits and
callbacks lower both). Where the devices' peak is in `PEAK_FLOPS`, it
gives the fraction of peak the epoch reached.

`ShardedTrainer.timings` holds one `EpochTimer.result()` per epoch of the
last `fit`. `Profile` writes a `jax.profiler` trace of a few calls of the
first epoch, after the first call (which compiles).
"""

import time

import jax

PARTS = ("input_s", "steps_s", "callbacks_s", "validation_s")

# Dense (no sparsity) peak FLOP/s of one device, by a piece of
# `device.device_kind`, first match wins: (16-bit: bfloat16 and float16,
# float32 as JAX runs it by default: TF32 on NVIDIA Ampere and newer,
# bfloat16 passes on TPU, per docs.jax.dev/en/latest/201/precision.html).
PEAK_FLOPS = (
    # NVIDIA H100 datasheet: PCIe 1,513 bf16 / 756 TF32 TFLOPS with sparsity, half dense.
    ("H100 PCIe", 756e12, 378e12),
    # NVIDIA H100 datasheet: SXM 1,979 bf16 / 989 TF32 TFLOPS with sparsity, half dense.
    ("H100", 989e12, 494e12),
    # NVIDIA H200 datasheet: the H100 SXM's tensor cores (1,979 / 989 sparse).
    ("H200", 989e12, 494e12),
    # NVIDIA A100 datasheet: 312 bf16, 156 TF32 TFLOPS dense (SXM and PCIe).
    ("A100", 312e12, 156e12),
    # Google Cloud TPU docs, per chip: v4 275, v5e 197, v5p 459 bf16 TFLOPS.
    ("TPU v4", 275e12, 275e12),
    ("TPU v5 lite", 197e12, 197e12),
    ("TPU v5e", 197e12, 197e12),
    ("TPU v5p", 459e12, 459e12),
)


class EpochTimer:
    """The seconds of one epoch, by part (see the module doc).

    Started when made; `lap(name)` counts the time since the previous lap
    (or the start) towards part `name`; `samples` counts the rows trained on.
    """

    def __init__(self, epoch, peak_flops_per_s=None):
        self.epoch = epoch
        self.peak_flops_per_s = peak_flops_per_s
        self.samples = 0
        self.seconds = dict.fromkeys(PARTS + ("other_s",), 0.0)
        self._start = self._last = time.perf_counter()

    def lap(self, name):
        """End a part: the seconds since the previous lap go to `name`."""
        now = time.perf_counter()
        self.seconds[name] += now - self._last
        self._last = now

    def result(self, flops=None):
        """The epoch's breakdown: a dict of seconds, samples, FLOPs and rates.

        Keys: `epoch`, `wall_s` (from the start of the epoch to now, the
        end of its `on_epoch_end` callbacks), the parts of `PARTS` and
        `other_s` (which add up to `wall_s`: the time since the last lap
        goes to `other_s`), `samples`, and `samples_per_s`: the samples
        over the epoch's training time, its wall time without validation.
        `flops` (the epoch's training FLOPs, all devices; None if unknown),
        `flops_per_s` (over the same training time), `peak_flops_per_s`
        (all devices, None where `PEAK_FLOPS` does not know them) and
        `fraction_of_peak` (None unless both are known).
        """
        self.lap("other_s")
        wall = self._last - self._start
        training = wall - self.seconds["validation_s"]
        rate = None if flops is None or training <= 0 else flops / training
        peak = self.peak_flops_per_s
        return {
            "epoch": self.epoch, "wall_s": wall, **self.seconds, "samples": self.samples,
            "samples_per_s": self.samples / training if training > 0 else 0.0,
            "flops": flops, "flops_per_s": rate, "peak_flops_per_s": peak,
            "fraction_of_peak": None if rate is None or peak is None else rate / peak,
        }


def peak_flops_per_s(mesh, model):
    """The peak FLOP/s of `mesh`'s devices together for `model`, or None if unknown.

    From `PEAK_FLOPS` by the first device's `device_kind`, its 16-bit
    column when the model's dtype policy computes in bfloat16 or float16,
    else its float32 one; None on CPU and devices not in the table.
    """
    devices = list(mesh.devices.flat)
    kind = devices[0].device_kind.lower()
    compute = str(model.dtype_policy.compute_dtype)
    for piece, half, single in PEAK_FLOPS:
        if piece.lower() in kind:
            return (half if compute in ("bfloat16", "float16") else single) * len(devices)
    return None


def _si(value):
    """`value` with an SI prefix: 1.23 G, 45.6 T."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:.3g} "


def describe(entry):
    """One line for an epoch's `EpochTimer.result()`: the parts, samples/s, FLOP/s where known."""
    parts = ", ".join(f"{name[:-2]} {entry[name]:.2f} s" for name in PARTS + ("other_s",))
    line = (f"epoch {entry['epoch'] + 1} time {entry['wall_s']:.2f} s: {parts}; "
            f"{entry['samples_per_s']:,.0f} samples/s")
    if entry.get("flops_per_s") is not None:
        line += f", {_si(entry['flops_per_s'])}FLOP/s"
    if entry.get("fraction_of_peak") is not None:
        line += f" ({entry['fraction_of_peak']:.1%} of peak)"
    return line


class Profile:
    """A `jax.profiler` trace of `calls` compiled calls after the first.

    `after_call(count)` is told how many calls of the traced epoch have been
    dispatched: the trace starts after the first (its compilation stays
    out) and stops after `calls` more, once the last of them is finished;
    `close` stops it at the epoch's end, or if training ends early.

    Args:
        directory: where `jax.profiler.start_trace` writes (a TensorBoard
            log directory: `plugins/profile/<run>/*.xplane.pb`).
        calls: how many calls to trace.
    """

    def __init__(self, directory, calls=5):
        self.directory, self.calls = str(directory), calls
        self._state = "waiting"

    def after_call(self, count, logs):
        """Start or stop the trace after the `count`-th call (whose logs are `logs`)."""
        if self._state == "waiting" and count == 1:
            jax.profiler.start_trace(self.directory)
            self._state = "tracing"
        elif self._state == "tracing" and count == 1 + self.calls:
            jax.block_until_ready(logs)  # the traced calls run inside the trace
            self.close()

    def close(self):
        """Stop the trace if it is running; no later call starts it again."""
        if self._state == "tracing":
            jax.profiler.stop_trace()
        self._state = "done"
