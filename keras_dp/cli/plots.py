"""Training curves as a PNG, with matplotlib's file-only backend."""


def plot_history(history, path, title=None):
    """Write loss and accuracy per epoch (training and validation) to `path`.

    Args:
        history: a `keras.callbacks.History` or its `.history` dict.
        path: the PNG file to write.
        title: an optional figure title.
    """
    import matplotlib

    matplotlib.use("Agg")  # No display needed, and none is touched.
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    logs = getattr(history, "history", history)
    names = [name for name in ("loss", "accuracy") if name in logs]
    figure, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.5), squeeze=False)
    for axis, name in zip(axes[0], names):
        epochs = range(1, len(logs[name]) + 1)
        axis.plot(epochs, logs[name], marker="o", label="train")
        if f"val_{name}" in logs:
            axis.plot(epochs, logs[f"val_{name}"], marker="o", label="validation")
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
        axis.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
