"""Training curves as a PNG, with matplotlib's file-only backend."""


def plot_history(history, path, title=None):
    """Write loss and accuracy per epoch (training and validation) to `path`.

    Each curve is labelled with its Keras log name (`loss`, `val_loss`, ...),
    the names the progress bar and `keras-dp train` print.

    Args:
        history: a `keras.callbacks.History` or its `.history` dict.
        path: the PNG file to write.
        title: an optional figure title.

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
    from matplotlib.ticker import MaxNLocator

    logs = getattr(history, "history", history)
    names = [name for name in ("loss", "accuracy") if name in logs]
    figure, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    for axis, name in zip(axes[0], names):
        epochs = range(1, len(logs[name]) + 1)
        for label in (name, f"val_{name}"):
            if label in logs:
                axis.plot(epochs, logs[label], marker="o", label=label)
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
    return True
