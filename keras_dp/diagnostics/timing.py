"""Where an epoch's time went, in words, and the devices' peak FLOP/s to compare it with.

The loop times each epoch by part (`keras_dp.core.loop.EpochTimer`:
input, steps, callbacks, validation, other) and counts the FLOPs its
training calls ran, from XLA's cost analysis of the compiled programs;
`ShardedTrainer.timings` holds one result per epoch of the last `fit`.
Here: the peak FLOP/s of the devices (`PEAK_FLOPS`, `peak_flops_per_s`),
against which an epoch's rate is a fraction of peak, and one line per
epoch for people (`describe`).
"""

from keras_dp.core.loop import PARTS

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


