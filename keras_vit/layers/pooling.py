"""Reducing the token sequence to one feature vector."""

import keras
from keras import ops

from keras_vit.layers._checks import one_of, rank_of, shown_shape

POOLINGS = ("token", "gap")


def _check_tokens(shape):
    """Raise a ValueError unless `shape` is that of (batch, tokens, hidden_dim) tokens."""
    if rank_of(shape) != 3:
        raise ValueError(
            "TokenPooling expects tokens of rank 3 (batch, tokens, hidden_dim). "
            f"Received: inputs.shape={shown_shape(shape)}"
        )


@keras.saving.register_keras_serializable(package="keras_vit")
class TokenPooling(keras.layers.Layer):
    """Pools a token sequence: the class token, or the mean of all tokens.

    Args:
        pooling: "token" takes the first (class) token; "gap" averages all
            tokens (the original's global average pooling, applied after the
            final LayerNorm).

    Call arguments:
        inputs: a (batch, tokens, hidden_dim) tensor.

    Returns:
        A (batch, hidden_dim) tensor.

    Example:
    >>> import numpy as np
    >>> tuple(TokenPooling("gap")(np.ones((2, 5, 8), "float32")).shape)
    (2, 8)
    """

    def __init__(self, pooling="token", **kwargs):
        super().__init__(**kwargs)
        self.pooling = one_of("pooling", pooling, POOLINGS)

    def build(self, input_shape):
        _check_tokens(input_shape)
        self.built = True

    def call(self, inputs):
        _check_tokens(inputs.shape)
        if self.pooling == "token":
            return inputs[:, 0]
        return ops.mean(inputs, axis=1)

    def compute_output_shape(self, input_shape):
        _check_tokens(input_shape)
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        return {**super().get_config(), "pooling": self.pooling}
