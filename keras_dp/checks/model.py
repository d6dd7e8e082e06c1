"""What keras_dp requires of a model before it trains it, each a check with the fix.

Checked when a trainer is made (`check_model`) or before a fit's first step
(`require_compiled`, `check_trainable_unchanged`): what Keras's own
`model.fit` would fail on deep inside a traced step, or would do that
keras_dp cannot (a keras_hub task's preprocessing), is refused at once,
naming the layer or setting and the fix.
"""

import inspect

import jax
import keras

from keras_dp import _compat
from keras_dp import _messages


def require_compiled(model, what):
    """Raise a `ValueError` saying how to compile, unless `model` has an optimizer.

    Args:
        what: what needs it, for the message ("fit", "evaluate").
    """
    if model.compiled and (what == "evaluate" or model.optimizer is not None):
        return
    raise ValueError(
        f"The model is not compiled, so keras_dp cannot {what} it: it needs an "
        "optimizer (and a loss, unless the model adds its own with add_loss). "
        "Either call model.compile(optimizer=..., loss=..., metrics=[...]) "
        "first, or pass optimizer= and loss= (and metrics=) to keras_dp. "
        "Predicting needs neither."
    )


def check_recompilable(model, overrides):
    """Raise a `ValueError` with the fix if `model.compile` takes arguments Keras's does not.

    keras_dp's `optimizer=`, `loss=` and `metrics=` recompile the model with
    its last compile's Keras arguments (`build.compile_model`). A model with
    a `compile` of its own (keras.io's `Distiller`: `student_loss_fn`,
    `alpha`, ...; a GAN's `d_optimizer`, `g_optimizer`) would be called
    without its own arguments: missing ones fail inside keras_dp, and those
    with defaults are silently reset (an `alpha=0.5` back to its default).

    Args:
        overrides: the compile arguments keras_dp was given, by name.

    Raises:
        ValueError: `model.compile` has a parameter `keras.Model.compile`
            has not (`*args` and `**kwargs` aside).
    """
    keras_parameters = inspect.signature(keras.Model.compile).parameters
    own = [p.name for p in inspect.signature(model.compile).parameters.values()
           if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in keras_parameters]
    if not own:
        return
    given = ", ".join(f"{name}={_label(value)}" for name, value in overrides.items())
    raise ValueError(
        f"{type(model).__name__} defines its own compile(), with arguments Keras's compile "
        f"has not ({', '.join(own)}), so keras_dp cannot recompile it: it would call that "
        "compile without them (a missing one fails; one with a default is reset to it). "
        f"Received: {given}. Compile the model yourself, model.compile(...) with its own "
        "arguments and the optimizer, loss or metrics you want, and call keras_dp without "
        "optimizer=, loss= and metrics=."
    )


def _label(value):
    """A compile argument as a user wrote it, for a message: `'adam'`, `Adam(...)`, `[...]`."""
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(_label(item) for item in value)}]"
    if isinstance(value, dict):
        return f"{{{', '.join(f'{key!r}: {_label(item)}' for key, item in value.items())}}}"
    if isinstance(value, (keras.optimizers.Optimizer, keras.losses.Loss)):
        return f"{type(value).__name__}(...)"
    return _metric_label(value)


def check_trainable_unchanged(model):
    """Raise a `ValueError` with the fix if the trainable variables changed since the optimizer was built.

    Keras pairs the optimizer's slots with `model.trainable_variables` by
    position, so setting a layer's `trainable` after the optimizer was
    built (by a first `fit`) takes effect only with a new optimizer, from
    `model.compile`; `model.fit` then fails inside its step ("Argument
    `optimizer_variables` must be a list of tensors corresponding 1:1 ...").
    `layer.enable_lora(rank)` and `model.quantize(mode)` after training
    change them too (LoRA adds trainable factors and freezes the kernel;
    quantizing replaces a kernel with non-trainable integers): the message
    names the variables that differ. An optimizer built for another model
    is refused as such (`check_optimizer_is_the_models`). A model with its
    own `train_step` chooses what its optimizer updates.
    """
    optimizer = model.optimizer
    if optimizer is None or not optimizer.built or _compat.custom_step(model, "train_step"):
        return
    built_for = _compat.optimizer_trainable_variables(optimizer)
    if [id(v) for v in built_for] == [id(v) for v in model.trainable_variables]:
        return
    check_optimizer_is_the_models(model, built_for)
    raise ValueError(
        f"The model's trainable variables changed since its optimizer was built: "
        f"{len(model.trainable_variables)} are trainable now, the optimizer holds slots "
        f"for {len(built_for)}. A layer's `trainable` set after training (or during it, "
        "in a callback), layer.enable_lora(rank) or model.quantize(mode) takes effect, as "
        "in Keras, only after model.compile(...) with a new optimizer (for example "
        "keras.optimizers.Adam(1e-5)); compiling with the built model.optimizer again "
        "keeps its old slots. The weights are kept."
        + _changed_variables(built_for, model.trainable_variables)
    )


def check_optimizer_is_the_models(model, built_for):
    """Raise a `ValueError` with the fix if the optimizer was built for another model's variables.

    One optimizer object compiled into two models (`model_b.compile(optimizer=
    model_a.optimizer)`, or one `Adam(...)` passed to both) is built for the
    first model that trains. Keras's `model.fit` then trains the second with
    the first one's slots and step count, paired by position, without a
    word; keras_dp refuses it before any step. The slots are taken for
    another model's when none of the variables they were built for is the
    model's, by object or by path (`model.quantize` replaces a kernel by a
    new variable of the same path).
    """
    ids, paths = {id(v) for v in model.variables}, {v.path for v in model.variables}
    if not built_for or any(id(v) in ids or v.path in paths for v in built_for):
        return
    optimizer = model.optimizer
    name = type(optimizer).__name__
    raise ValueError(
        f"The model's optimizer ({name}, {optimizer.name!r}) was built for another model's "
        f"variables ({_first([v.path for v in built_for], 2)}): one optimizer object was "
        f"compiled into two models. Keras's model.fit would train this model with the other "
        f"model's slots and its step count (iterations={int(optimizer.iterations)}). Compile "
        f"each model with an optimizer of its own, for example model.compile(optimizer="
        f"keras.optimizers.{name}.from_config(other_optimizer.get_config()), loss=..., "
        f"metrics=[...]) for a fresh copy of this one."
    )


def _changed_variables(before, now):
    """`" Trainable now, without slots: a, b."` and the reverse: what differs, for a message."""
    ids_before, ids_now = {id(v) for v in before}, {id(v) for v in now}
    parts = (("Trainable now, without slots", [v.path for v in now if id(v) not in ids_before]),
             ("No longer trainable, with slots", [v.path for v in before if id(v) not in ids_now]))
    return "".join(f" {what}: {_first(paths)}." for what, paths in parts if paths)


def _first(paths, shown=4):
    """The first `shown` of `paths`, joined, and how many more."""
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more


def check_model(model):
    """Raise a `TypeError` naming the fix unless `model` is a Keras model.

    A Keras model is a `keras.Model`, or any `keras.layers.Layer` with
    Keras's JAX trainer mixed in (`class M(JAXTrainer, layers.Dense)`, as
    Keras's own tests write models): what `model.fit` needs of it, keras_dp
    needs. Refuses a model with a layer that runs TensorFlow ops
    (`check_no_tensorflow_layers`), a keras_hub task with a preprocessor
    (`check_no_preprocessor`) and a stateful RNN whose states Keras does not
    track (`check_no_stateful_rnn`). Warns when the model is compiled to run
    its step eagerly or un-jitted, which keras_dp does not honour: its
    sharded step is always compiled.
    """
    if not (isinstance(model, keras.layers.Layer) and _compat.is_jax_trainer(model)):
        raise TypeError(
            "keras_dp trains a keras.Model (or a Keras layer with Keras's JAX trainer "
            "mixed in, as a keras.Model has it). Received an object of type "
            f"{type(model).__module__}.{type(model).__qualname__}. Wrap "
            "layers in keras.Sequential([...]) or keras.Model(inputs, "
            "outputs)."
        )
    check_no_tensorflow_layers(model)
    check_no_preprocessor(model)
    check_no_stateful_rnn(model)
    if model.compiled and (model.run_eagerly or model.jit_compile is False):
        why = ("run_eagerly=True" if model.run_eagerly else "jit_compile=False (from "
               "compile, or set by a layer with supports_jit=False)")
        _messages.warn(
            f"The model is compiled with {why}, but keras_dp always compiles its "
            "sharded step: call() is traced, not run eagerly. To debug it "
            "eagerly, use model.fit on one device.", UserWarning)


# Keras's preprocessing layers that call TensorFlow ops whatever the backend:
# they run in a tf.data pipeline, never inside a model traced by JAX.
TENSORFLOW_LAYERS = (
    keras.layers.TextVectorization, keras.layers.StringLookup, keras.layers.IntegerLookup,
    keras.layers.Hashing, keras.layers.HashedCrossing,
)


def layer_names(layers):
    """Layers as `name (Class), ...`, for messages."""
    return ", ".join(f"{layer.name} ({type(layer).__name__})" for layer in layers)


def check_no_tensorflow_layers(model):
    """Raise a `ValueError` naming the fix if `model` holds a TensorFlow-only layer.

    `TextVectorization`, `StringLookup`, `IntegerLookup`, `Hashing` and
    `HashedCrossing` run TensorFlow ops (and take strings), which JAX cannot
    compile: inside a model they fail deep in a traced step (under Keras's
    own `model.fit` on JAX too). Their place is the input pipeline.
    """
    found = [layer for layer in _compat.all_layers(model)
             if isinstance(layer, TENSORFLOW_LAYERS)]
    inner = {id(sub) for layer in found for sub in _compat.all_layers(layer)[1:]}
    found = [layer for layer in found if id(layer) not in inner]  # TextVectorization's own lookup
    if not found:
        return
    raise ValueError(
        f"The model holds layers that run TensorFlow ops, which JAX cannot compile "
        f"into keras_dp's step (nor into Keras's own on JAX): {layer_names(found)}. Move them into "
        "the tf.data pipeline, before batching or after: dataset.map(lambda x, y: "
        "(layer(x), y)) with the layer adapted, and start the model at their output "
        "(keras.Input(shape, dtype=\"int64\") for token ids)."
    )


def check_no_stateful_rnn(model):
    """Raise a `ValueError` naming the fix if an RNN's `stateful=True` would be dropped.

    Keras creates a stateful RNN's states (`layer.states`) untracked, outside
    the model's variables, so the stateless step of Keras's own `fit`,
    `evaluate` and `predict` on JAX, and keras_dp's, starts every batch
    from zero states and drops the new ones: only eager calls, `model(x)`,
    carry them. An unbuilt one is refused too: it creates its states when
    built, which fails inside a traced call (under `model.fit` too). A Keras
    that tracks the states of built layers, carried then as non-trainable
    variables, passes.
    """
    tracked = {id(variable) for variable in model.non_trainable_variables}
    found = [layer for layer in _compat.all_layers(model)
             if isinstance(layer, keras.layers.RNN) and layer.stateful and not (
                 layer.built and all(id(state) in tracked
                                     for state in keras.tree.flatten(layer.states)))]
    if not found:
        return
    raise ValueError(
        f"The model holds stateful RNN layers: {layer_names(found)}. Keras on JAX keeps "
        "their states outside the model's variables, so the compiled step of Keras's own "
        "model.fit, evaluate and predict, like keras_dp's, starts every batch from zero "
        "states and drops the new ones (only eager calls, model(x), carry them): "
        "stateful=True would be silently ignored. Build the layers with stateful=False "
        "(what model.fit on JAX computes) to train; for stateful step-by-step inference, "
        "copy the weights into a stateful twin, twin.set_weights(model.get_weights()), "
        "and call it eagerly, with layer.reset_state() between sequences."
    )


def check_no_preprocessor(model):
    """Raise a `ValueError` naming the fix if `model` preprocesses its data in its own `fit`.

    A keras_hub task (`BertTextClassifier`, `GPT2CausalLM`,
    `ImageClassifier`, ...) with a `preprocessor` maps `preprocess_samples`
    over the data in its own `fit`, `evaluate` and `predict` (tokenizing
    text, resizing and rescaling images, making a causal LM's labels), which
    keras_dp, calling none of them, would skip: it would train on the raw
    data, unlike `model.fit`. Without a preprocessor the task trains as any
    Keras model.
    """
    preprocessor = getattr(model, "preprocessor", None)
    if preprocessor is None or not callable(getattr(model, "preprocess_samples", None)):
        return
    raise ValueError(
        f"The model ({type(model).__name__}) has a preprocessor "
        f"({type(preprocessor).__name__}), which its own fit, evaluate and predict map "
        "over the data and keras_dp does not: it would train on the raw data. Map it "
        "over the data yourself and detach it: preprocessor = model.preprocessor; "
        "model.preprocessor = None; data = tf.data.Dataset.from_tensor_slices((x, y))"
        ".batch(batch_size).map(preprocessor); keras_dp.fit_sharded(model, data, ...); "
        "then model.preprocessor = preprocessor again before saving or generating."
    )


def check_metrics_per_output(model, y_pred):
    """Raise a `ValueError` with the fix if a model of several outputs got one flat list of metrics.

    Keras 3 reads a list of `metrics` (or `weighted_metrics`) for a model of
    several outputs as one entry per output; a flat list of another length
    (`metrics=["accuracy"]` for 2 outputs, as Keras 2 took it for every
    output) fails in Keras's build with "tuple arity mismatch" (list
    outputs) or "Expected an instance of dict" (dict outputs).
    """
    outputs = jax.tree.leaves(y_pred)
    if len(outputs) < 2:
        return
    compiled = _compat.compiled_metrics(model)
    names = list(getattr(model, "output_names", None) or []) or None
    for argument in ("metrics", "weighted_metrics"):
        given = getattr(compiled, f"_user_{argument}", None)
        if (not isinstance(given, (list, tuple)) or len(given) == len(outputs)
                or any(isinstance(item, (list, tuple, dict)) for item in given)):
            continue
        shown = f"[{', '.join(_metric_label(item) for item in given)}]"
        per_output = (f"{{{', '.join(f'{name!r}: {shown}' for name in names)}}}" if names
                      else None)
        raise ValueError(
            f"{argument}={shown} is one flat list for a model of {len(outputs)} outputs"
            + (f" ({', '.join(names)})" if names else "") + ": Keras 3 reads a list "
            f"as one entry per output, so it needs {len(outputs)}. Give one list per "
            f"output, {argument}=[{', '.join([shown] * len(outputs))}]"
            + (f", or a dict by output name, {argument}={per_output}" if per_output else "")
            + ". Keras's model.fit fails on this too, inside its build.")


def _metric_label(item):
    """A metric as a user wrote it, for a message: `'accuracy'`, `AUC(...)`, `my_metric`."""
    if isinstance(item, str):
        return repr(item)
    if isinstance(item, keras.metrics.Metric):
        return f"{type(item).__name__}(...)"
    return getattr(item, "__name__", type(item).__name__)


def allows_micro_batches(model):
    """Whether `model` can run a batch as micro-batches (`check_micro_batches` would pass)."""
    return not _compat.custom_step(model, "train_step") and not _batch_statistics(model)


def _batch_statistics(model):
    """The layers whose statistics span the batch: BatchNormalization's."""
    return [layer for layer in _compat.all_layers(model)
            if isinstance(layer, keras.layers.BatchNormalization)]


def check_micro_batches(model, micro_batches):
    """Refuse `micro_batches` above 1 for a model it cannot split exactly, naming why and the fix.

    A layer whose statistics span the batch (BatchNormalization) would see a
    micro-batch's mean and variance instead of the batch's, and update its
    moving statistics once per micro-batch; a model's own `train_step`
    computes its gradients itself, where keras_dp cannot sum them over
    micro-batches.

    Raises:
        ValueError: such a layer, or a `train_step` of the model's own.
    """
    if micro_batches == 1:
        return
    if _compat.custom_step(model, "train_step"):
        raise ValueError(
            f"micro_batches={micro_batches} sums each batch's gradient over slices of it, "
            f"but {type(model).__name__} computes its gradients in a train_step of its own, "
            "which keras_dp runs whole. Pass micro_batches=1, or accumulate inside your "
            "train_step.")
    batch_statistics = _batch_statistics(model)
    if batch_statistics:
        raise ValueError(
            f"micro_batches={micro_batches} runs each batch as {micro_batches} slices, and "
            f"this model has layers whose statistics span the batch: "
            f"{layer_names(batch_statistics)} (BatchNormalization normalizes by the batch's "
            "mean and variance, and a slice's are not the batch's). Pass micro_batches=1; "
            "or, to fit a batch in memory, split the state (state_sharding='full') or "
            "rematerialize (keras.RematScope), or use a normalization that does not span "
            "the batch (keras.layers.LayerNormalization or GroupNormalization).")
