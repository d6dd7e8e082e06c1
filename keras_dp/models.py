"""Models: the convnet of the Keras multi-device guide."""

import keras
from keras import layers


def convnet(input_shape=(28, 28, 1), num_classes=10):
    """Return the uncompiled convnet of Keras's "distributed training with JAX" guide.

    Rescaling to [0, 1], three convolutions each followed by BatchNormalization
    and ReLU, global average pooling, a 256-unit dense layer, Dropout(0.5) and
    a dense layer of `num_classes` logits (no softmax).
    """
    inputs = keras.Input(shape=input_shape)
    x = layers.Rescaling(1.0 / 255.0)(inputs)
    x = layers.Conv2D(12, 3, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization(scale=False, center=True)(x)
    x = layers.ReLU()(x)
    x = layers.Conv2D(24, 6, strides=2, use_bias=False)(x)
    x = layers.BatchNormalization(scale=False, center=True)(x)
    x = layers.ReLU()(x)
    x = layers.Conv2D(32, 6, padding="same", strides=2, name="large_k")(x)
    x = layers.BatchNormalization(scale=False, center=True)(x)
    x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(256, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    outputs = layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name="convnet")


def compile_classifier(model, learning_rate=1e-3):
    """Compile a logits classifier as the guide does: Adam, sparse CE, accuracy."""
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    return model


MODELS = {"convnet": convnet}
