"""Multi-head self-attention with one fused query/key/value projection."""

import keras
from keras import ops

from keras_vit.layers._checks import positive_int
from keras_vit.layers._checks import rate as check_rate


def qkv_initializer():
    """Xavier-uniform as the original draws each of q, k, v: (D, D) fans.

    Over the fused (D, 3D) kernel, fan_avg is 2D instead of D, so a scale of
    2 gives the same limit sqrt(6 / (D + D)) as three separate kernels.
    """
    return keras.initializers.VarianceScaling(scale=2.0, mode="fan_avg", distribution="uniform")


def _softmax_weights(query, key):
    """softmax(query key^T) in float32 for a scaled `query`.

    einsum, not matmul with a swapped key: the same product on TensorFlow, and
    on JAX it lowers to one dot_general whose backward pass takes half the time
    (benchmarks/micro.py attention).
    """
    logits = ops.einsum("bhqd,bhkd->bhqk", query, key)
    return ops.softmax(ops.cast(logits, "float32"), axis=-1)


def _attention_core(query, key, value):
    """softmax(query key^T) value, with a hand-written backward pass.

    `query` comes scaled; all three are (batch, heads, tokens, head_dim); the
    output is (batch, query tokens, heads, head_dim), the layout the output
    projection reads. The softmax runs in float32. The backward pass keeps the
    weights P and the output O and uses the identity
    sum_k P * dP = sum_d dO * O for the softmax's row term: a reduction over
    head_dim instead of over the (tokens x tokens) weights, which automatic
    differentiation reads and writes twice more. With XLA on CPU the core's
    forward + backward is ~5% faster at 197 and 577 tokens, and a ViT-S/16
    384 training step ~4% faster, for ~2% more peak memory (O is kept).
    """

    @ops.custom_gradient
    def core(query, key, value):
        weights = _softmax_weights(query, key)
        outputs = ops.einsum("bhqk,bhkd->bqhd", ops.cast(weights, value.dtype), value)

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            d_value = ops.einsum("bhqk,bqhd->bhkd", ops.cast(weights, upstream.dtype), upstream)
            d_weights = ops.cast(ops.einsum("bqhd,bhkd->bhqk", upstream, value), "float32")
            row = ops.sum(ops.cast(upstream, "float32") * ops.cast(outputs, "float32"), axis=-1)
            row = ops.expand_dims(ops.transpose(row, (0, 2, 1)), -1)  # (batch, heads, tokens, 1)
            d_logits = ops.cast(weights * (d_weights - row), query.dtype)
            d_query = ops.einsum("bhqk,bhkd->bhqd", d_logits, key)
            d_key = ops.einsum("bhqk,bhqd->bhkd", d_logits, query)
            return d_query, d_key, d_value

        return outputs, grad

    return core(query, key, value)


@keras.saving.register_keras_serializable(package="keras_vit")
class MultiHeadSelfAttention(keras.layers.Layer):
    """Multi-head scaled dot-product self-attention.

    The query, key and value projections are one Dense layer `qkv` of width
    3 * D, laid out as [query | key | value], each head-major (heads, head_dim).
    The attention logits are scaled by 1 / sqrt(head_dim) and the softmax is
    computed in float32 whatever the compute dtype.

    Args:
        num_heads: number of attention heads; must divide the token width.
        attention_dropout_rate: dropout on the attention weights.
        dropout_rate: dropout on the output projection.

    Call arguments:
        inputs: a (batch, tokens, hidden_dim) tensor.
        training: whether dropout is active.
        num_queries: attend from the first `num_queries` tokens only (keys and
            values still come from all tokens); None for every token.

    Returns:
        A (batch, tokens, hidden_dim) tensor, or (batch, num_queries,
        hidden_dim) when `num_queries` is given.

    Example:
    >>> import numpy as np
    >>> tuple(MultiHeadSelfAttention(num_heads=2)(np.zeros((1, 5, 8), "float32")).shape)
    (1, 5, 8)
    """

    def __init__(self, num_heads, attention_dropout_rate=0.0, dropout_rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = positive_int("num_heads", num_heads)
        self.attention_dropout_rate = check_rate("attention_dropout_rate", attention_dropout_rate)
        self.dropout_rate = check_rate("dropout_rate", dropout_rate)
        self.attention_dropout = keras.layers.Dropout(
            self.attention_dropout_rate, dtype=self.dtype_policy, name="attention_dropout"
        )
        self.output_dropout = keras.layers.Dropout(
            self.dropout_rate, dtype=self.dtype_policy, name="output_dropout"
        )

    def build(self, input_shape):
        if len(input_shape) != 3 or input_shape[-1] is None:
            raise ValueError(
                "MultiHeadSelfAttention expects inputs of shape (batch, tokens, hidden_dim). "
                f"Received: input_shape={tuple(input_shape)}"
            )
        hidden_dim = input_shape[-1]
        if hidden_dim % self.num_heads:
            raise ValueError(
                "`hidden_dim` must be divisible by `num_heads`. "
                f"Received: hidden_dim={hidden_dim}, num_heads={self.num_heads}"
            )
        self.hidden_dim = hidden_dim
        self.head_dim = hidden_dim // self.num_heads
        self.qkv = keras.layers.Dense(
            3 * hidden_dim,
            kernel_initializer=qkv_initializer(),
            dtype=self.dtype_policy,
            name="qkv",
        )
        self.qkv.build(input_shape)
        self.proj = keras.layers.Dense(
            hidden_dim,
            kernel_initializer="glorot_uniform",
            dtype=self.dtype_policy,
            name="proj",
        )
        self.proj.build(input_shape)
        self.built = True

    def _split_heads(self, inputs):
        # The projection runs on (batch * tokens, D) rows: one plain matrix product,
        # which oneDNN fuses with the bias (a batched product of 3-D inputs is
        # slower on CPUs). One transpose then gives (3, batch, heads, tokens,
        # head_dim), unstacked into query, key and value: batched matrix products
        # on that layout, and an unstack (not three slices) for the backward
        # pass, halve the attention core's forward + backward time without XLA
        # (see benchmarks/micro.py attention).
        qkv = self.qkv(ops.reshape(inputs, (-1, self.hidden_dim)))
        qkv = ops.reshape(qkv, (-1, inputs.shape[1], 3, self.num_heads, self.head_dim))
        query, key, value = ops.unstack(ops.transpose(qkv, (2, 0, 3, 1, 4)), num=3, axis=0)
        return query, key, value

    def _scaled_query(self, query):
        return query * ops.cast(self.head_dim**-0.5, query.dtype)

    def _attention_weights(self, query, key):
        return _softmax_weights(self._scaled_query(query), key)

    def attention_weights(self, inputs):
        """The (batch, heads, tokens, tokens) attention weights for `inputs`."""
        query, key, _ = self._split_heads(inputs)
        return self._attention_weights(query, key)

    def call(self, inputs, training=None, num_queries=None):
        query, key, value = self._split_heads(inputs)  # each (batch, heads, tokens, head_dim)
        if num_queries is not None:
            query = query[:, :, :num_queries]
        if training and self.attention_dropout_rate > 0.0:
            weights = ops.cast(self._attention_weights(query, key), value.dtype)
            weights = self.attention_dropout(weights, training=training)
            x = ops.einsum("bhqk,bhkd->bqhd", weights, value)
        else:
            x = _attention_core(self._scaled_query(query), key, value)
        x = self.output_dropout(self.proj(ops.reshape(x, (-1, self.hidden_dim))), training=training)
        return ops.reshape(x, (-1, query.shape[2], self.hidden_dim))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def compute_output_spec(self, inputs, training=None, num_queries=None):
        shape = tuple(inputs.shape)
        if num_queries is not None:
            shape = (shape[0], num_queries, shape[2])
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "attention_dropout_rate": self.attention_dropout_rate,
            "dropout_rate": self.dropout_rate,
        }
