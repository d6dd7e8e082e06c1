"""tf.data as a source: numpy batches, one pass per epoch, TensorFlow kept off the GPUs."""


from keras_dp import _messages
from keras_dp.sources.source import Replayable


class TFEpochs:
    """A tf.data.Dataset as a re-iterable of numpy batches.

    Ragged batches (`ragged_batch`, or `tf.strings.split` after `batch`) are
    padded with zeros to their longest row, as Keras's `model.fit` pads them
    (`RaggedTensor.to_tensor()`), inside the pipeline.

    A pipeline that reshuffles (`shuffle(..., reshuffle_each_iteration=True)`,
    the default) draws a new order at each iterator made, seeded or not.
    `model.fit` makes one per epoch, and before them one for a first batch
    to build from only while the model (or its compiled loss or metrics) is
    unbuilt; a fit on a built model, a second fit on the same dataset,
    reads its first epoch from the first iterator. keras_dp always reads a
    first batch (`peek`): with `share_first_pass` set, as `model.fit` on a
    built model, that iterator is kept and the first pass goes on from it,
    so no order is drawn that Keras does not draw. Epoch e reads the
    (e + 2)-th order (the (e + 1)-th when shared); `epoch(e)` keeps it so
    when the fit starts at epoch e (a resume, `initial_epoch`): it makes and
    drops the iterators of the epochs before, so a run resumed mid-epoch
    skips the very batches the interrupted run trained on.
    """

    def __init__(self, dataset):
        import tensorflow as tf

        self._dataset = _ragged_to_dense(dataset)
        cardinality = int(dataset.cardinality())
        infinite = cardinality == tf.data.INFINITE_CARDINALITY
        self.endless = "a tf.data.Dataset that repeats forever" if infinite else None
        # Batches per pass where tf.data knows them (not after `filter`), else
        # None: as Keras's adapter, for the progress bar and callbacks' `params`.
        self.num_batches = cardinality if cardinality >= 0 else None
        self.share_first_pass = False
        self._made = 0  # iterators made so far
        self._first_pass = None  # the first iterator, kept when shared

    def __iter__(self):
        self._made += 1
        iterator = self._dataset.as_numpy_iterator()
        if self.share_first_pass and self._made == 1:
            self._first_pass = Replayable(iterator)
            return self._first_pass
        return iterator

    def epoch(self, epoch):
        """Epoch `epoch`'s pass: the first iterator's (when shared) or the one after it, plus one per epoch before."""
        first_pass, self._first_pass = self._first_pass, None
        if epoch == 0 and first_pass is not None:
            return first_pass.replay()
        while self._made < epoch + (not self.share_first_pass):  # made and dropped
            iter(self)  # unread: each draws its order
        return iter(self)


def _ragged_to_dense(dataset):
    """`dataset` with each `tf.RaggedTensor` padded with zeros to a dense tensor."""
    import tensorflow as tf

    if not any(isinstance(spec, tf.RaggedTensorSpec)
               for spec in tf.nest.flatten(dataset.element_spec)):
        return dataset

    def dense(*parts):  # tf.data passes a tuple's parts as arguments
        parts = tf.nest.map_structure(
            lambda part: part.to_tensor() if isinstance(part, tf.RaggedTensor) else part, parts)
        return parts if len(parts) > 1 else parts[0]

    return dataset.map(dense)


def hide_gpus_from_tensorflow():
    """Keep TensorFlow (used for tf.data only) off every GPU.

    Without this, TensorFlow would reserve most of each GPU's memory for
    itself, leaving JAX to run out.
    """
    try:
        import tensorflow as tf
    except ImportError:
        raise ImportError(
            "tf.data input needs TensorFlow, which keras_dp installs only "
            "with its `tf` extra: pip install 'keras_dp[tf]'."
        ) from None

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # TensorFlow's devices are initialised already
        if tf.config.list_logical_devices("GPU"):
            _messages.warn(
                "TensorFlow started before keras_dp could hide the GPUs from it, "
                "and it holds them: it may have reserved most of their memory, "
                "leaving JAX to run out. Import keras_dp before running "
                "TensorFlow code, or call tf.config.set_visible_devices([], 'GPU') "
                "first.")
