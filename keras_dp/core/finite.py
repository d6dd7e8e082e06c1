"""The guard in every train step: a step with non-finite results changes nothing.

A NaN or Inf loss, or a non-finite new weight or optimizer value, would
poison every later step. The compiled step checks its own results and,
where they are not finite, returns the state it was given, so the host
never has to look at the weights to stop at the right step: it reads the
loss it already fetches (`keras_dp.core.inflight`), and the model keeps the
weights from before the bad step. Pure functions, traced into the steps of
`keras_dp.core.steps`, `keras_dp.core.feed` and `keras_dp.ensemble`.
"""

import jax
import jax.numpy as jnp


def keep_if_not_finite(new_state, state, logs, join=True):
    """Inside a step: `(new_state, logs)`, undone where the step gave non-finite values.

    If the running loss `logs["loss"]` is NaN or Inf, or a new trainable or
    optimizer value is (the update, checked rather than the gradients: a
    `LossScaleOptimizer` skips non-finite gradients itself), the weights,
    non-trainable values and optimizer of `state` are kept. A non-finite
    update with a finite loss also sets the float metrics and logs to NaN,
    so that the running loss says so from this step on, as it does after a
    non-finite loss: the host finds the step from the loss alone, and every
    later step of the epoch keeps the state too. Steps without a `loss`
    log are not checked; a `loss` of several values (a step of the
    model's own may log one per output) is finite when all of them are.
    `join`: see `_all_finite`.
    """
    if "loss" not in logs:
        return new_state, logs
    update_finite = _all_finite(new_state.trainable + new_state.optimizer, join)
    finite = loss_is_finite(logs["loss"]) & update_finite
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731

    def void(value):
        return jnp.where(update_finite, value, jnp.nan) if _is_float(value) else value

    return new_state._replace(
        trainable=jax.tree.map(keep, new_state.trainable, state.trainable),
        non_trainable=jax.tree.map(keep, new_state.non_trainable, state.non_trainable),
        optimizer=jax.tree.map(keep, new_state.optimizer, state.optimizer),
        metrics=jax.tree.map(void, new_state.metrics),
    ), jax.tree.map(void, logs)


def loss_is_finite(loss):
    """Inside a step: whether every value of the logged `loss` is finite (one boolean)."""
    return jnp.all(jnp.isfinite(loss))


def finite_steps(losses, steps):
    """Inside a program: how many of `steps` steps logged a finite loss.

    `losses`: the steps' `logs["loss"]` stacked on axis 0 (one step's, as
    it is, for `steps=1`), each one value or several.
    """
    losses = jnp.reshape(jnp.asarray(losses), (steps, -1))
    return jnp.sum(jnp.all(jnp.isfinite(losses), axis=1))


def _is_float(value):
    return jnp.issubdtype(jnp.result_type(value), jnp.floating)


def _all_finite(values, join):
    """Whether every float value in `values` is finite (one scalar).

    With `join`, the values of each dtype are checked as one flat vector:
    XLA fuses the join into a single reduction, where a reduction per
    variable made the whole train step compile 4.2x slower (ResNet-18 on
    XLA:CPU: 15.3 s against 3.6 s, and 3.4 s with no check;
    `benchmarks/guard_compile.py`). The join is paid per step instead: on
    CPU the copy made ResNet-18's step 17% slower than the per-variable
    check, and it takes 8% more temporary memory. Only for values laid out alike
    (replicated): joining split arrays would make XLA gather them.
    """
    floats = [value for value in jax.tree.leaves(values) if _is_float(value)]
    if join:
        by_dtype = {}
        for value in floats:
            by_dtype.setdefault(jnp.result_type(value), []).append(jnp.ravel(value))
        floats = [jnp.concatenate(group) for group in by_dtype.values()]
    checks = [jnp.all(jnp.isfinite(value)) for value in floats]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)
