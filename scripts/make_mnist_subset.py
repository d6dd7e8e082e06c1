"""Make the small real MNIST subset that ships inside the package.

The main job must run on a machine with no network and no data directory, so
keras_dp carries `keras_dp/data/mnist_subset.npz`: 5,000 training and 1,000
test images drawn at random (seed 0, no repeats) from the full MNIST, in
Keras's own npz layout. Re-run this script to rebuild it:

    python scripts/make_mnist_subset.py ../shared/data/mnist.npz
"""

import argparse
import pathlib

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent.parent / "keras_dp" / "data"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="full MNIST in Keras's npz layout")
    parser.add_argument("--train", type=int, default=5000)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--out", default=str(OUT / "mnist_subset.npz"))
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    with np.load(args.source) as full:
        train = np.sort(rng.choice(len(full["y_train"]), args.train, replace=False))
        test = np.sort(rng.choice(len(full["y_test"]), args.test, replace=False))
        subset = {
            "x_train": full["x_train"][train],
            "y_train": full["y_train"][train],
            "x_test": full["x_test"][test],
            "y_test": full["y_test"][test],
        }
    np.savez_compressed(args.out, **subset)
    for key, value in subset.items():
        print(f"{key}: {value.shape} {value.dtype}")
    print("train label counts:", np.bincount(subset["y_train"], minlength=10))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
