"""Models: the convnet of the Keras multi-device guide, and d2l's ResNet-18."""

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


def resnet18(input_shape=(28, 28, 1), num_classes=10):
    """Return the uncompiled ResNet-18 of d2l's multi-GPU chapter, for small images.

    The d2l variant for 28x28 inputs: rescaling to [0, 1], a 3x3 stride-1
    stem convolution with 64 channels, BatchNormalization and ReLU, no
    max-pool; four stages of two residual blocks with 64, 128, 256 and 512
    channels (the first block of stages 2-4 halves the resolution, with a
    1x1 strided convolution on its shortcut); global average pooling and a
    dense layer of `num_classes` logits.
    """
    inputs = keras.Input(shape=input_shape)
    x = layers.Rescaling(1.0 / 255.0)(inputs)
    x = layers.Conv2D(64, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.ReLU()(x)
    for stage, channels in enumerate((64, 128, 256, 512)):
        for block in range(2):
            downsample = stage > 0 and block == 0
            x = _residual_block(x, channels, strides=2 if downsample else 1)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name="resnet18")


def _residual_block(x, channels, strides):
    shortcut = x
    y = layers.Conv2D(channels, 3, strides=strides, padding="same")(x)
    y = layers.BatchNormalization()(y)
    y = layers.ReLU()(y)
    y = layers.Conv2D(channels, 3, padding="same")(y)
    y = layers.BatchNormalization()(y)
    if strides != 1 or shortcut.shape[-1] != channels:
        shortcut = layers.Conv2D(channels, 1, strides=strides)(shortcut)
    return layers.ReLU()(layers.Add()([y, shortcut]))


def compile_classifier(model, learning_rate=1e-3, decay_steps=None):
    """Compile a logits classifier as the guide does: Adam, sparse CE, accuracy.

    Args:
        model: a Keras model that outputs one logit per class.
        learning_rate: Adam's learning rate (its start, with `decay_steps`).
        decay_steps: if given, the rate decays to 0 along a cosine over this
            many steps (`keras.optimizers.schedules.CosineDecay`); by default
            it stays constant, as in the guide.

    Returns:
        `model`, compiled.
    """
    if decay_steps is not None:
        learning_rate = keras.optimizers.schedules.CosineDecay(learning_rate, decay_steps)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    return model


MODELS = {"convnet": convnet, "resnet18": resnet18}
