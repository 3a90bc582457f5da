"""LayerNorm: Keras' LayerNormalization with a fast TensorFlow inference graph."""

import keras
from keras import ops


def _fused_tensorflow_layer_norm(inputs, gamma, beta, epsilon):
    """Layer normalization over the last axis, written as the one subgraph
    that TensorFlow's graph optimizer (grappler's remapper, with oneDNN on a
    CPU) replaces by a single `_MklLayerNorm` kernel: reshape to
    (1, rows, width, 1), a training-mode `FusedBatchNormV3` in NCHW with unit
    scale and zero offset, reshape back, then `* gamma + beta`.

    Elsewhere (GPU, XLA, oneDNN off) the same graph still computes a layer
    normalization, through the batch-norm kernel.
    """
    import tensorflow as tf

    shape = tf.shape(inputs)
    rows = tf.reduce_prod(shape[:-1], keepdims=True)
    x = tf.reshape(inputs, tf.concat([[1], rows, shape[-1:], [1]], axis=0))
    # The remapper matches `Fill` nodes for the unit scale and zero offset.
    # With static shapes, constant folding would turn them into constants
    # first; a PlaceholderWithDefault is never folded, so they stay fills.
    fill_shape = tf.raw_ops.PlaceholderWithDefault(input=rows, shape=[1])
    empty = tf.constant([], dtype=tf.float32)
    x, _, _, _, _, _ = tf.raw_ops.FusedBatchNormV3(
        x=x,
        scale=tf.fill(fill_shape, 1.0),
        offset=tf.fill(fill_shape, 0.0),
        mean=empty,
        variance=empty,
        epsilon=epsilon,
        exponential_avg_factor=1.0,
        data_format="NCHW",
        is_training=True,
    )
    x = tf.reshape(x, shape)
    if gamma is not None:
        x = x * gamma
    if beta is not None:
        x = x + beta
    return x


@keras.saving.register_keras_serializable(package="keras_vit")
class LayerNorm(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization`, faster in TensorFlow inference graphs.

    Same arguments, weights (`gamma`, `beta`) and numbers as Keras' layer.
    When it normalizes the last axis of a 2-D or 3-D input inside a
    TensorFlow graph (`predict`, `evaluate`, a SavedModel) and is not
    training, it emits the subgraph that TensorFlow's oneDNN build fuses into
    one layer-norm kernel: about 4x faster than the eight separate ops of
    Keras' version at ViT-S/16 shapes on a CPU. Everywhere else (training,
    eager calls, other backends, other axes) it is Keras' layer unchanged;
    in training the unfused ops are the faster ones under XLA.

    Example:
    >>> import numpy as np
    >>> tuple(LayerNorm(epsilon=1e-6)(np.ones((2, 3, 4), "float32")).shape)
    (2, 3, 4)
    """

    def call(self, inputs, training=None):
        if training or not self._can_fuse(inputs):
            return super().call(inputs)
        gamma = ops.cast(self.gamma, "float32") if self.scale else None
        beta = ops.cast(self.beta, "float32") if self.center else None
        outputs = _fused_tensorflow_layer_norm(
            ops.cast(inputs, "float32"), gamma, beta, float(self.epsilon)
        )
        return ops.cast(outputs, self.compute_dtype)

    def _can_fuse(self, inputs):
        if keras.backend.backend() != "tensorflow" or self.rms_scaling:
            return False
        import tensorflow as tf

        if not tf.inside_function():
            return False
        rank = len(inputs.shape)
        axes = self.axis if isinstance(self.axis, (list, tuple)) else [self.axis]
        if rank not in (2, 3) or [axis % rank for axis in axes] != [rank - 1]:
            return False
        return keras.backend.standardize_dtype(inputs.dtype) in ("float16", "bfloat16", "float32")
