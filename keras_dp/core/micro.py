"""Micro-batches: one global batch's gradient summed over slices run one after another.

With `micro_batches=M`, a train step splits its batch's real rows into M
slices of `rows // M` rows, run one after another by a `lax.scan`, and the
`rows % M` rows left over as one more slice, and sums their gradients into
one update. Only one slice's activations are alive at a time, so the step's
temporaries fall towards 1/M of the whole batch's.

It is the same step: a batch's loss is the mean over its rows (Keras's
`"sum_over_batch_size"`, regularization added once), so its gradient is the
sum over slices of each slice's gradient weighted by its share of the rows,
`n_i / rows`; the loss tracker and the compiled metrics are updated slice
by slice, weighted by their rows, which leaves the same running totals. The
result equals the whole batch's up to float summation order, uneven
batches and K steps per call included. What it cannot be is a layer whose
statistics span the batch (BatchNormalization's mean and variance are a
slice's, not the batch's), which `keras_dp.checks.model.check_micro_batches`
refuses, and a model's own `train_step` (it computes its gradients itself).
A layer that draws random numbers (Dropout) draws them slice by slice: the
masks are other draws than the whole batch's, as with any change of batch.
"""

import jax
import jax.numpy as jnp


def summed(slice_step, state, batch, micro_batches, stacked):
    """Inside a step: `(grads, non_trainable, metrics, logs)` of `batch` in micro-batches.

    Args:
        slice_step: `(non_trainable, metrics, slice) -> (grads, non_trainable,
            metrics, logs)`, the gradients of one slice's loss and the metrics
            updated with it.
        state: the step's `TrainState` (its non-trainable values and metrics
            are carried from slice to slice).
        batch: the real rows `(x, y, sample_weight)`, split over the batch axis.
        micro_batches: M, at least 2.
        stacked: the sharding of `[M, rows // M, ...]` slices (the batch axis
            on the rows), so that each device keeps its own rows of each.
    """
    rows = jax.tree.leaves(batch)[0].shape[0]
    size, rest = divmod(rows, micro_batches)
    grads = jax.tree.map(jnp.zeros_like, state.trainable)
    carry, logs = (grads, state.non_trainable, state.metrics), None
    if size:
        def body(carry, piece):
            total, non_trainable, metrics = carry
            grads, non_trainable, metrics, logs = slice_step(non_trainable, metrics, piece)
            return (_add(total, grads, size / rows), non_trainable, metrics), logs

        slices = jax.tree.map(
            lambda array: jax.lax.with_sharding_constraint(
                array[: size * micro_batches].reshape(
                    (micro_batches, size) + array.shape[1:]), stacked),
            batch)
        carry, logs = jax.lax.scan(body, carry, slices)
        logs = jax.tree.map(lambda values: values[-1], logs)
    if rest:
        total, non_trainable, metrics = carry
        last = jax.tree.map(lambda array: array[size * micro_batches:], batch)
        grads, non_trainable, metrics, logs = slice_step(non_trainable, metrics, last)
        carry = (_add(total, grads, rest / rows), non_trainable, metrics)
    return (*carry, logs)


def _add(total, grads, share):
    return jax.tree.map(lambda sum_, grad: sum_ + grad * jnp.asarray(share, grad.dtype),
                        total, grads)
