"""Keep every Keras computation in float64, for float64 comparisons in scripts.

Under floatx float64, Keras on JAX still computes some things in float32:
`keras.backend.result_type` maps float64 to float32 (its private
`BIT64_TO_BIT32_DTYPE` table), and BatchNormalization computes its batch
statistics in `result_type(inputs.dtype, "float32")`, as `keras.ops.mean`
(so GlobalAveragePooling2D) does. A batch reduction on N devices sums each
device's rows first and all-reduces the partial sums, another float32
summation order than one device's, so float32 rounding (1e-7) would show
through a float64 comparison of 1 and N devices. Call this before building
models so that both runs are float64 throughout.
"""

import keras


def keep_keras_in_float64():
    """Make `keras.backend.result_type("float64", "float32")` float64, or exit."""
    keras.config.set_floatx("float64")
    from keras.src.backend.common import dtypes as keras_dtypes  # private: no public switch

    if hasattr(keras_dtypes, "BIT64_TO_BIT32_DTYPE"):
        keras_dtypes.BIT64_TO_BIT32_DTYPE["float64"] = "float64"
    if keras.backend.result_type("float64", "float32") != "float64":
        raise SystemExit(
            "Could not keep Keras in float64: keras.backend.result_type('float64', "
            "'float32') is still float32 in this Keras version."
        )
