"""LayerNorm: Keras' LayerNormalization with a fast TensorFlow inference graph
and a hand-written backward pass."""

import keras
from keras import ops

from keras_vit import _cpu
from keras_vit.layers._backward import tied_to_upstream, xla_fused


def _fused_tensorflow_layer_norm(inputs, gamma, beta, epsilon):
    """Layer normalization over the last axis, written as the one subgraph
    that TensorFlow's graph optimizer (grappler's remapper, with oneDNN on a
    CPU) replaces by a single `_MklLayerNorm` kernel: reshape to
    (1, rows, width, 1), a training-mode `FusedBatchNormV3` in NCHW with unit
    scale and zero offset, reshape back, then `* gamma + beta`.

    Elsewhere (GPU, XLA) the same graph still computes a layer normalization,
    through the batch-norm kernel. `LayerNorm` does not emit it on a CPU-only
    TensorFlow without oneDNN, where Eigen's batch-norm kernel is the slow one.
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
    return tf.reshape(x, shape) * gamma + beta


def _layer_norm_backward(d_outputs, normalized, inverse_std, gamma, rows):
    """A layer norm's gradients (x, gamma, beta) from its output's gradient.

    `normalized` is x_hat = (x - mean) * inverse_std, in float32 as
    `d_outputs`; `rows` are the axes that gamma and beta are shared over.
    """
    scaled = d_outputs * gamma
    d_x = inverse_std * (
        scaled
        - ops.mean(scaled, axis=-1, keepdims=True)
        - normalized * ops.mean(scaled * normalized, axis=-1, keepdims=True)
    )
    return d_x, ops.sum(d_outputs * normalized, axis=rows), ops.sum(d_outputs, axis=rows)


def _layer_norm_last_axis(x, gamma, beta, epsilon):
    """(x - mean) / sqrt(var + epsilon) * gamma + beta over the last axis.

    The backward pass is written out: with g = upstream * gamma and
    x_hat = (x - mean) * r, r = 1 / sqrt(var + epsilon),

        dx = r * (g - mean(g) - x_hat * mean(g * x_hat))

    (the exact derivative, epsilon included), d_gamma = sum(upstream * x_hat)
    and d_beta = sum(upstream) over the rows. Automatic differentiation of
    the forward instead emits a separate term for each path through the mean
    and the variance. On JAX's CPU compiler those terms pile up along the
    residual stream into fusions that redo each other's work. With this form
    a ViT-S/16 training step on a CPU is ~14% faster on JAX and 2-3% faster
    on TensorFlow (XLA or graph mode), and keeps ~0.1 GB less
    (docs/performance.md).
    """

    @ops.custom_gradient
    def forward(x, gamma, beta):
        mean = ops.mean(x, axis=-1, keepdims=True)
        centered = x - mean
        inverse_std = ops.rsqrt(ops.mean(centered * centered, axis=-1, keepdims=True) + epsilon)
        outputs = centered * inverse_std * gamma + beta

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            normalized = (x - mean) * inverse_std
            rows = tuple(range(len(x.shape) - 1))
            return _layer_norm_backward(upstream, normalized, inverse_std, gamma, rows)

        return outputs, grad

    return forward(x, gamma, beta)


@xla_fused
def _normalized_rows(x, gamma, beta, epsilon, dtype):
    """(layer_norm(x) in `dtype`, each row's mean, each row's 1 / std) of 2-D `x`."""
    rows = ops.cast(x, "float32")
    mean = ops.mean(rows, axis=-1, keepdims=True)
    centered = rows - mean
    inverse_std = ops.rsqrt(ops.mean(centered * centered, axis=-1, keepdims=True) + epsilon)
    return ops.cast(centered * inverse_std * gamma + beta, dtype), mean, inverse_std


@xla_fused
def _renormalized_rows(x, mean, inverse_std, gamma, beta, dtype):
    """layer_norm(x) in `dtype` again, from float32 `x` and the kept row statistics."""
    return ops.cast((x - mean) * inverse_std * gamma + beta, dtype)


@xla_fused
def _rows_backward(d_outputs, x, mean, inverse_std, gamma, dtype):
    """The layer norm's (d_x in `dtype`, d_gamma, d_beta) for 2-D float32 `x`."""
    normalized = (x - mean) * inverse_std
    d_x, d_gamma, d_beta = _layer_norm_backward(
        ops.cast(d_outputs, "float32"), normalized, inverse_std, gamma, (0,)
    )
    return ops.cast(d_x, dtype), d_gamma, d_beta


def layer_norm_dense(x, gamma, beta, epsilon, kernel, bias):
    """`layer_norm(x) @ kernel + bias` on 2-D `x`, whose backward pass keeps `x`.

    The forward pass computes what `LayerNorm` (in training) followed by a
    Dense layer computes: the normalization in float32, its output cast to
    the kernel's dtype for the product. Apart from `x`, which the residual
    stream holds anyway, the backward pass keeps only each row's mean and
    1 / std, and recomputes the normalized rows, which the Dense layer's
    kernel gradient needs, from them: one (rows, D) tensor less per layer
    norm while training, two per transformer block (0.17 GB at ViT-S/16 384,
    batch 8). The recomputation repeats the forward's operations on the same
    values, so the gradients are those of the two layers. In a graph that is
    not an XLA program the element-wise parts run as small XLA programs
    between the products (`xla_fused`).
    """

    @ops.custom_gradient
    def forward(x, gamma, beta, kernel, bias):
        normalized, mean, inverse_std = _normalized_rows(x, gamma, beta, epsilon, kernel.dtype)
        outputs = ops.matmul(normalized, kernel) + bias

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            tied = tied_to_upstream(x, upstream)
            renormalized = _renormalized_rows(tied, mean, inverse_std, gamma, beta, upstream.dtype)
            d_kernel = ops.matmul(ops.transpose(renormalized), upstream)
            d_outputs = ops.matmul(upstream, ops.transpose(kernel))
            d_x, d_gamma, d_beta = _rows_backward(
                d_outputs, tied, mean, inverse_std, gamma, x.dtype
            )
            return d_x, d_gamma, d_beta, d_kernel, ops.sum(upstream, axis=0)

        return outputs, grad

    return forward(x, gamma, beta, kernel, bias)


@keras.saving.register_keras_serializable(package="keras_vit")
class LayerNorm(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization`, faster in inference graphs and in training.

    Same arguments, weights (`gamma`, `beta`) and numbers as Keras' layer.
    For the usual configuration (the last axis, with `gamma` and `beta`, no
    `rms_scaling`, a float16/bfloat16/float32 input):

    - inside a TensorFlow graph (`predict`, `evaluate`, a SavedModel) and not
      training, where TensorFlow runs oneDNN's CPU kernels (or a GPU is
      visible), it emits the subgraph that oneDNN fuses into one layer-norm
      kernel: about 4x faster than the eight separate ops of Keras' version
      at ViT-S/16 shapes on a CPU (2-D and 3-D inputs). The choice is made
      when the graph is traced, so a SavedModel keeps the form of the
      machine that exported it;
    - everywhere else it computes the same normalization with a hand-written
      backward pass (`_layer_norm_last_axis`), which trains faster under XLA
      and on JAX.

    Other configurations are Keras' layer unchanged. The normalization runs
    in float32 whatever the compute dtype, as in Keras.

    Example:
    >>> import numpy as np
    >>> tuple(LayerNorm(epsilon=1e-6)(np.ones((2, 3, 4), "float32")).shape)
    (2, 3, 4)
    """

    def call(self, inputs, training=None):
        if not self._usual_configuration(inputs):
            return super().call(inputs)
        gamma = ops.cast(self.gamma, "float32")
        beta = ops.cast(self.beta, "float32")
        x = ops.cast(inputs, "float32")
        if not training and self._can_fuse(inputs):
            outputs = _fused_tensorflow_layer_norm(x, gamma, beta, float(self.epsilon))
        else:
            outputs = _layer_norm_last_axis(x, gamma, beta, float(self.epsilon))
        return ops.cast(outputs, self.compute_dtype)

    def dense(self, inputs, layer):
        """`layer(self(inputs, training=True))` for a Dense `layer`, on 2-D inputs.

        Where this layer norm takes its usual configuration and `layer` is
        Keras' plain Dense (no activation, with a bias, neither quantized nor
        with LoRA), the two run as `layer_norm_dense`, which keeps less for
        the backward pass; otherwise as the two layers.
        """
        if len(inputs.shape) != 2:
            raise ValueError(
                "LayerNorm.dense expects 2-D inputs of shape (rows, features). "
                f"Received: inputs.shape={tuple(inputs.shape)}"
            )
        if not (
            self._usual_configuration(inputs)
            and isinstance(layer, keras.layers.Dense)
            and layer.use_bias
            and layer.activation is keras.activations.linear
            and layer.quantization_mode is None
            and not layer.lora_enabled
        ):
            return layer(self(inputs, training=True))
        dtype = layer.compute_dtype
        return layer_norm_dense(
            ops.cast(inputs, self.compute_dtype),
            ops.cast(self.gamma, "float32"),
            ops.cast(self.beta, "float32"),
            float(self.epsilon),
            ops.cast(layer.kernel, dtype),
            ops.cast(layer.bias, dtype),
        )

    def _usual_configuration(self, inputs):
        if self.rms_scaling or not (self.scale and self.center):
            return False
        rank = len(inputs.shape)
        axes = self.axis if isinstance(self.axis, (list, tuple)) else [self.axis]
        if rank < 1 or [axis % rank for axis in axes] != [rank - 1]:
            return False
        return keras.backend.standardize_dtype(inputs.dtype) in ("float16", "bfloat16", "float32")

    def _can_fuse(self, inputs):
        if keras.backend.backend() != "tensorflow" or len(inputs.shape) not in (2, 3):
            return False
        import tensorflow as tf

        if not tf.inside_function():
            return False
        # Without oneDNN (TensorFlow's default on CPUs without VNNI or AMX) the
        # batch-norm form runs on Eigen's batch-norm kernel, about 3x slower
        # than the plain normalization (docs/performance.md).
        return _cpu.onednn_enabled() or not _cpu.cpu_only_tensorflow()
