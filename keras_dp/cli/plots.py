"""Training curves and throughput as a PNG, with matplotlib's file-only backend."""

# The parts of an epoch's time stacked in the throughput panel (`keras_dp.diagnostics.timing`).
TIME_PARTS = ("input_s", "steps_s", "callbacks_s", "validation_s", "other_s")


def throughput_data(timings):
    """What the throughput panel shows, from `trainer.timings`.

    Returns:
        A dict: `epoch` (1-based), `samples_per_s`, and each of `TIME_PARTS`
        (seconds per epoch, stacked as bars), one value per epoch.
    """
    data = {"epoch": [entry["epoch"] + 1 for entry in timings],
            "samples_per_s": [entry["samples_per_s"] for entry in timings]}
    data.update({part: [entry[part] for entry in timings] for part in TIME_PARTS})
    return data


def plot_history(history, path, title=None, timings=None):
    """Write loss and accuracy per epoch (training and validation) to `path`.

    Each curve is labelled with its Keras log name (`loss`, `val_loss`, ...),
    the names the progress bar and `keras-dp train` print. With `timings`,
    a third panel shows each epoch's samples per second and where its time
    went (`throughput_data`).

    Args:
        history: a `keras.callbacks.History` or its `.history` dict.
        path: the PNG file to write.
        title: an optional figure title.
        timings: an optional `trainer.timings` (one dict per epoch).

    Returns:
        True, or False when matplotlib is not installed (then nothing is
        written: it comes with `pip install 'keras_dp[plot]'`).
    """
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")  # No display needed, and none is touched.
    import matplotlib.pyplot as plt

    logs = getattr(history, "history", history)
    names = [name for name in ("loss", "accuracy") if name in logs]
    panels = len(names) + bool(timings)
    figure, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8), squeeze=False)
    for axis, name in zip(axes[0], names):
        epochs = range(1, len(logs[name]) + 1)
        for label in (name, f"val_{name}"):
            if label in logs:
                axis.plot(epochs, logs[label], marker="o", label=label)
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(epoch_locator())
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
        axis.legend()
    if timings:
        _throughput_panel(axes[0][-1], throughput_data(timings))
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def epoch_locator():
    """Ticks at whole epochs only, even for one epoch.

    `MaxNLocator(integer=True)` wants 2 ticks in view and falls back to
    fractional ones (0.96, 0.98, ...) around a single epoch.
    """
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True, min_n_ticks=1)


def _throughput_panel(axis, data):
    """Seconds per epoch by part as stacked bars; samples per second as a line on the right."""
    bottom = [0.0] * len(data["epoch"])
    for part in TIME_PARTS:
        axis.bar(data["epoch"], data[part], bottom=bottom, label=part[:-2], alpha=0.6)
        bottom = [below + value for below, value in zip(bottom, data[part])]
    axis.set_xlabel("epoch")
    axis.xaxis.set_major_locator(epoch_locator())
    axis.set_ylabel("seconds (bars)")
    # Headroom on both axes keeps the legend's row above the bars and the line.
    axis.set_ylim(0, 1.45 * max(bottom))
    axis.legend(fontsize="small", loc="upper center", ncols=len(TIME_PARTS),
                handlelength=1, columnspacing=0.8)
    rate = axis.twinx()
    rate.plot(data["epoch"], data["samples_per_s"], color="black", marker="o")
    rate.set_ylabel("samples/s (line)")
    rate.set_ylim(0, 1.45 * max(data["samples_per_s"]))
