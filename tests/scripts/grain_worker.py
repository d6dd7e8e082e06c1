"""One process of tests/test_grain.py's multi-process runs: Grain input sharded per process.

Started with the KERAS_DP_* variables of `keras_dp.distributed.initialize`.
Trains `many_hosts_data`'s id regression on a Grain `MapDataset` of `--rows`
rows, sharded with `keras_dp.shard_for_processes` (process p of P reads rows
p, p + P, ...), batched by `--batch-size / P` and read without look-ahead,
so the rows the data source hands out are exactly the rows read. With
`--checkpoint-dir` it checkpoints; `--signal PROCESS:EPOCH:STEP` sends that
process SIGTERM after that step. Writes `process<i>.npz` to `--out`: the
weights, the id histogram of the last epoch, and the source's reads.
"""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--rows", type=int, default=798)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--checkpoint-dir")
parser.add_argument("--signal")
args = parser.parse_args()
os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dp  # noqa: E402
from keras_dp import distributed  # noqa: E402

distributed.initialize()

import grain  # noqa: E402
import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from many_hosts_data import make_model, rows_of  # noqa: E402


class Rows:
    """All `rows` rows of the id regression; records the ids read."""

    def __init__(self, rows):
        self.x, self.y = rows_of(np.arange(rows), rows)
        self.read = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        self.read.append(int(index))
        return self.x[index], self.y[index]


class Sigterm(keras.callbacks.Callback):
    """SIGTERM to this process after step STEP of epoch EPOCH, if it is PROCESS."""

    def __init__(self, spec):
        super().__init__()
        process, epoch, step = map(int, spec.split(":")) if spec else (-1, 0, 0)
        self.at = (epoch, step) if process == jax.process_index() else None
        self.epoch, self.sent = None, False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.sent:
            time.sleep(1.0)  # JAX notices SIGTERM within a second or so; loaded, later
        elif self.at is not None and (self.epoch, batch + 1) >= self.at:
            self.sent = True
            os.kill(os.getpid(), 15)


def main():
    source = Rows(args.rows)
    local = args.batch_size // jax.process_count()
    options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    dataset = keras_dp.shard_for_processes(grain.MapDataset.source(source))
    dataset = dataset.batch(local).to_iter_dataset(options)
    model = make_model(args.rows)
    history = keras_dp.ShardedTrainer(model, steps_per_execution=4).fit(
        dataset, epochs=args.epochs, verbose=0, callbacks=[Sigterm(args.signal)],
        checkpoint_dir=args.checkpoint_dir)
    np.savez(os.path.join(args.out, f"process{jax.process_index()}.npz"),
             *[np.asarray(w) for w in model.get_weights()],
             counts=np.asarray(history.history["ids"][-1]), read=np.asarray(source.read))


if __name__ == "__main__":
    main()
    print("done", flush=True)
