"""The pre-norm transformer encoder block, its MLP and stochastic depth."""

import math

import keras
from keras import ops

from keras_vit.layers._backward import remat, tied_to_upstream, xla_fused
from keras_vit.layers._checks import boolean, positive_int
from keras_vit.layers._checks import rate as check_rate
from keras_vit.layers.attention import MultiHeadSelfAttention
from keras_vit.layers.normalization import LayerNorm

LAYER_NORM_EPSILON = 1e-6
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_GELU_COEFFICIENT = 0.044715


def _gelu_derivative(x, approximate):
    return _gelu_value_and_derivative(x, approximate)[1]


def _gelu_value_and_derivative(x, approximate):
    """(GELU(x), GELU'(x)) from float32 `x`, for the backward passes."""
    if approximate:
        t = ops.tanh(SQRT_2_OVER_PI * (x + TANH_GELU_COEFFICIENT * x * x * x))
        slope = SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_GELU_COEFFICIENT * x * x)
        cdf = 0.5 * (1.0 + t)
        return x * cdf, cdf + 0.5 * x * (1.0 - t * t) * slope
    # Phi(x) = 0.5 (1 + erf(x / sqrt 2)), written as 0.5 (1 - erf(-x / sqrt 2)):
    # the same numbers (erf is odd, and TensorFlow's, XLA's and JAX's float32
    # erf give exactly -erf(z) at -z), but not the forward's expression. Were
    # it the same, XLA's common-subexpression elimination would merge the two
    # erf terms and keep the forward's alive for the backward pass: one more
    # (tokens, mlp_dim) tensor per block, 0.1 GB of peak memory at ViT-S/16
    # and 0.2 GB at ViT-B/16, batch 8 (docs/performance.md).
    cdf = 0.5 * (1.0 - ops.erf(x * (-1.0 / math.sqrt(2.0))))
    return x * cdf, cdf + x * ops.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))


def _gelu_forward(x, approximate):
    if approximate or keras.backend.standardize_dtype(x.dtype) != "float32":
        return keras.activations.gelu(x, approximate=approximate)
    # x * Phi(x) with Phi written through erf, the form PyTorch (and so timm)
    # computes. TensorFlow's own exact GELU writes Phi through erfc, whose
    # XLA lowering evaluates two approximations and selects one: twice the
    # time of this form on a CPU (docs/performance.md). In bfloat16 or float16
    # 1 + erf loses the negative tail, so those keep Keras' form.
    return 0.5 * x * (1.0 + ops.erf(x * (1.0 / math.sqrt(2.0))))


def gelu(x, approximate=False):
    """`keras.activations.gelu` whose backward pass keeps only its input.

    The forward value is Keras' for the tanh form and, in float32,
    0.5 x (1 + erf(x / sqrt 2)) for the exact one (`_gelu_forward`). The
    derivative, Phi(x) + x phi(x) (or that of the tanh form), is recomputed
    from `x` in the backward pass, in float32, so training stores none of the
    forward's intermediate terms
    (automatic differentiation of the erf form keeps two more tensors of the
    MLP's width per block).
    """

    @ops.custom_gradient
    def forward(x):
        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            derivative = _gelu_derivative(ops.cast(x, "float32"), approximate)
            return upstream * ops.cast(derivative, upstream.dtype)

        return _gelu_forward(x, approximate), grad

    return forward(x)


@xla_fused
def _gelu_forward_fused(x, approximate):
    return _gelu_forward(x, approximate)


@xla_fused
def _gelu_value_fused(x, approximate, dtype):
    """GELU(x) recomputed from float32 `x`, cast to `dtype`."""
    return ops.cast(_gelu_value_and_derivative(x, approximate)[0], dtype)


@xla_fused
def _gelu_backward_fused(x, d_value, approximate):
    """GELU'(x) d_value, from float32 `x`."""
    return d_value * ops.cast(_gelu_derivative(x, approximate), d_value.dtype)


def gelu_dense(x, kernel, bias, approximate=False):
    """`gelu(x) @ kernel + bias` on 2-D `x`, whose backward pass keeps only `x`.

    The forward pass computes what `gelu` followed by a Dense layer computes.
    The backward pass recomputes GELU(x) from `x` with its derivative (in an
    XLA program one erf or tanh for both; in graph mode two small XLA
    programs, `xla_fused`), instead of keeping GELU(x) for the kernel's
    gradient: one (rows, mlp_dim) tensor less per block while training, the
    widest the block has: 0.1 GB less peak memory at ViT-S/16 224 and 0.25
    GB at ViT-B/16, batch 8 (docs/performance.md). For the exact GELU in
    float32 the recomputed values are the forward's bit for bit (0.5 x (1 + e)
    and x (0.5 (1 + e)) round alike), so the gradients are those of the
    layers; the tanh form (Keras writes x^3 as a power) and bfloat16 may
    differ from the forward in the last bit.
    """

    @ops.custom_gradient
    def forward(x, kernel, bias):
        outputs = ops.matmul(_gelu_forward_fused(x, approximate), kernel) + bias

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            tied = tied_to_upstream(x, upstream)
            value = _gelu_value_fused(tied, approximate, upstream.dtype)
            d_kernel = ops.matmul(ops.transpose(value), upstream)
            d_value = ops.matmul(upstream, ops.transpose(kernel))
            d_x = _gelu_backward_fused(tied, d_value, approximate)
            return d_x, d_kernel, ops.sum(upstream, axis=0)

        return outputs, grad

    return forward(x, kernel, bias)


@keras.saving.register_keras_serializable(package="keras_vit")
class DropPath(keras.layers.Layer):
    """Stochastic depth: drops the whole residual branch per sample.

    In training each sample's branch is zeroed with probability `rate` and
    the survivors are scaled by 1 / (1 - rate); at inference it is the
    identity.

    Args:
        rate: the drop probability, in [0, 1).
        seed: optional int seed of the random draws.

    Call arguments:
        inputs: a tensor whose first axis is the batch.
        training: whether to drop.

    Returns:
        A tensor of the shape of `inputs`.

    Example:
    >>> import numpy as np
    >>> tuple(DropPath(0.5)(np.ones((2, 3), "float32")).shape)
    (2, 3)
    """

    def __init__(self, rate=0.0, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.rate = check_rate("rate", rate)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, inputs, training=None):
        if not training or self.rate == 0.0:
            return inputs
        keep = 1.0 - self.rate
        shape = (ops.shape(inputs)[0],) + (1,) * (len(inputs.shape) - 1)
        noise = keras.random.uniform(shape, seed=self.seed_generator, dtype=inputs.dtype)
        mask = ops.floor(noise + ops.cast(keep, inputs.dtype))
        return inputs * mask / ops.cast(keep, inputs.dtype)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}


@keras.saving.register_keras_serializable(package="keras_vit")
class MLP(keras.layers.Layer):
    """The transformer's feed-forward block: Dense -> GELU -> Dense.

    Dropout follows each Dense layer. Kernels are xavier-uniform and biases
    normal(stddev=1e-6), as in the original.

    Args:
        mlp_dim: width of the hidden layer.
        dropout_rate: dropout after each Dense layer.
        approximate_gelu: the tanh approximation of GELU (the original Flax
            code) instead of the exact erf form (timm, Hugging Face).

    Call arguments:
        inputs: a (..., hidden_dim) tensor.
        training: whether dropout is active.

    Returns:
        A tensor of the shape of `inputs`.

    Example:
    >>> import numpy as np
    >>> tuple(MLP(mlp_dim=32)(np.zeros((1, 5, 8), "float32")).shape)
    (1, 5, 8)
    """

    def __init__(self, mlp_dim, dropout_rate=0.0, approximate_gelu=False, **kwargs):
        super().__init__(**kwargs)
        self.mlp_dim = positive_int("mlp_dim", mlp_dim)
        self.dropout_rate = check_rate("dropout_rate", dropout_rate)
        self.approximate_gelu = boolean("approximate_gelu", approximate_gelu)
        self.dropout = keras.layers.Dropout(
            self.dropout_rate, dtype=self.dtype_policy, name="dropout"
        )

    def build(self, input_shape):
        bias_initializer = keras.initializers.RandomNormal(stddev=1e-6)
        self.fc1 = keras.layers.Dense(
            self.mlp_dim,
            kernel_initializer="glorot_uniform",
            bias_initializer=bias_initializer,
            dtype=self.dtype_policy,
            name="fc1",
        )
        self.fc1.build(input_shape)
        self.fc2 = keras.layers.Dense(
            input_shape[-1],
            kernel_initializer="glorot_uniform",
            bias_initializer=bias_initializer,
            dtype=self.dtype_policy,
            name="fc2",
        )
        self.fc2.build((*input_shape[:-1], self.mlp_dim))
        self.built = True

    def call(self, inputs, training=None):
        # On (rows, features): plain matrix products, which oneDNN fuses with the
        # bias and the GELU (3-D inputs become slower batched products on CPUs).
        x = self.fc1(ops.reshape(inputs, (-1, inputs.shape[-1])))
        return self._from_hidden(x, ops.shape(inputs), training)

    def normalized_call(self, inputs, norm, training=None):
        """`self(norm(inputs), ...)` for a `LayerNorm` `norm`, in training.

        The layer norm and fc1 run together (`LayerNorm.dense`), so the
        backward pass keeps `inputs` and not the normalized tokens.
        `TransformerBlock` calls it in training; it expects this layer built
        and `inputs` in its compute dtype.
        """
        x = norm.dense(ops.reshape(inputs, (-1, inputs.shape[-1])), self.fc1)
        return self._from_hidden(x, ops.shape(inputs), training)

    def _from_hidden(self, x, shape, training):
        # x: fc1's output, (rows, mlp_dim); shape: that of the MLP's input.
        if training and self._fuses_gelu_and_fc2():
            # Training keeps fc1's output only; GELU's is recomputed (gelu_dense).
            kernel = ops.cast(self.fc2.kernel, self.compute_dtype)
            bias = ops.cast(self.fc2.bias, self.compute_dtype)
            x = gelu_dense(x, kernel, bias, approximate=self.approximate_gelu)
        else:
            x = gelu(x, approximate=self.approximate_gelu)
            x = self.dropout(x, training=training)
            x = self.fc2(x)
        x = self.dropout(x, training=training)
        return ops.reshape(x, shape)

    def _fuses_gelu_and_fc2(self):
        # Not with dropout between the two, nor for an fc2 that Keras changed
        # (quantized, LoRA): those keep the layers as they are.
        fc2 = getattr(self, "fc2", None)  # None before build
        return (
            fc2 is not None
            and self.dropout_rate == 0.0
            and fc2.quantization_mode is None
            and not fc2.lora_enabled
        )

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {
            **super().get_config(),
            "mlp_dim": self.mlp_dim,
            "dropout_rate": self.dropout_rate,
            "approximate_gelu": self.approximate_gelu,
        }


@keras.saving.register_keras_serializable(package="keras_vit")
class TransformerBlock(keras.layers.Layer):
    """A pre-norm transformer encoder block.

    x = x + DropPath(MSA(LayerNorm(x))); x = x + DropPath(MLP(LayerNorm(x))),
    with LayerNorm epsilon 1e-6 (computed in float32).

    Args:
        num_heads: number of attention heads; must divide the token width.
        mlp_dim: width of the MLP's hidden layer.
        dropout_rate: dropout after the attention projection and in the MLP.
        attention_dropout_rate: dropout on the attention weights.
        drop_path_rate: stochastic-depth rate of both residual branches.
        approximate_gelu: tanh-approximate GELU (the original) or exact.
        first_token_only: compute the output of the first token only (the
            class token): its attention still reads every token, but the
            query, the output projection and the MLP run for one token. The
            last block of a class-token model needs nothing more, and skips
            most of its work. The first token's output is unchanged.
        remat: gradient checkpointing: in training, keep only the block's
            input and recompute its activations in the backward pass. Same
            numbers, less memory, about a third more compute per block. Saved
            in the config, unlike `keras.RematScope`.

    Call arguments:
        inputs: a (batch, tokens, hidden_dim) tensor.
        training: whether dropout and stochastic depth are active.
        first_token_only: overrides the constructor's `first_token_only`
            for this call (None keeps it).

    Returns:
        A (batch, tokens, hidden_dim) tensor, or (batch, 1, hidden_dim) with
        `first_token_only`.

    Example:
    >>> import numpy as np
    >>> tuple(TransformerBlock(num_heads=2, mlp_dim=32)(np.zeros((1, 5, 8), "float32")).shape)
    (1, 5, 8)
    """

    def __init__(
        self,
        num_heads,
        mlp_dim,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        drop_path_rate=0.0,
        approximate_gelu=False,
        first_token_only=False,
        remat=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_heads = positive_int("num_heads", num_heads)
        self.mlp_dim = positive_int("mlp_dim", mlp_dim)
        self.dropout_rate = check_rate("dropout_rate", dropout_rate)
        self.attention_dropout_rate = check_rate("attention_dropout_rate", attention_dropout_rate)
        self.drop_path_rate = check_rate("drop_path_rate", drop_path_rate)
        self.approximate_gelu = boolean("approximate_gelu", approximate_gelu)
        self.first_token_only = boolean("first_token_only", first_token_only)
        self.remat = boolean("remat", remat)
        policy = self.dtype_policy
        self.norm1 = LayerNorm(epsilon=LAYER_NORM_EPSILON, dtype=policy, name="norm1")
        self.attention = MultiHeadSelfAttention(
            self.num_heads,
            attention_dropout_rate=self.attention_dropout_rate,
            dropout_rate=self.dropout_rate,
            dtype=policy,
            name="attention",
        )
        self.norm2 = LayerNorm(epsilon=LAYER_NORM_EPSILON, dtype=policy, name="norm2")
        self.mlp = MLP(
            self.mlp_dim,
            dropout_rate=self.dropout_rate,
            approximate_gelu=self.approximate_gelu,
            dtype=policy,
            name="mlp",
        )
        self.drop_path = DropPath(self.drop_path_rate, dtype=policy, name="drop_path")

    def build(self, input_shape):
        if len(input_shape) != 3 or input_shape[-1] is None:
            raise ValueError(
                "TransformerBlock expects inputs of shape (batch, tokens, hidden_dim). "
                f"Received: input_shape={tuple(input_shape)}"
            )
        for layer in (self.norm1, self.attention, self.norm2, self.mlp):
            layer.build(input_shape)
        self.built = True

    def call(self, inputs, training=None, first_token_only=None):
        if first_token_only is None:
            first_token_only = self.first_token_only
        else:
            first_token_only = boolean("first_token_only", first_token_only)
        if self.remat and training:
            return remat(self, lambda x: self._forward(x, training, first_token_only))(inputs)
        return self._forward(inputs, training, first_token_only)

    def _forward(self, inputs, training, first_token_only):
        num_queries = 1 if first_token_only else None
        if training:
            # Each layer norm runs with the Dense layer after it, so training
            # keeps the block's inputs and not the normalized tokens as well
            # (LayerNorm.dense): what the layers compute, with less memory.
            x = self.attention.normalized_call(
                inputs, self.norm1, training=training, num_queries=num_queries
            )
        else:
            x = self.attention(self.norm1(inputs), training=training, num_queries=num_queries)
        shortcut = inputs[:, :1] if first_token_only else inputs
        x = shortcut + self.drop_path(x, training=training)
        if training:
            y = self.mlp.normalized_call(x, self.norm2, training=training)
        else:
            y = self.mlp(self.norm2(x), training=training)
        return x + self.drop_path(y, training=training)

    def rematerialized_call(self, layer_call, *args, **kwargs):
        # Gradient checkpointing under `keras.RematScope`, e.g. mode="list_of_layers"
        # with the block names: the backward pass recomputes the block instead of
        # storing its activations. TensorFlow's recompute_grad takes positional
        # tensors only, so the `training` flag is bound before rematerializing.
        wrapped = super().rematerialized_call(layer_call, *args, **kwargs)
        if wrapped is layer_call or self.remat:  # with `remat`, call() already recomputes
            return layer_call

        def call(inputs, training=None, **kwargs):
            return remat(self, lambda x: layer_call(x, training=training, **kwargs))(inputs)

        return call

    def compute_output_shape(self, input_shape):
        if self.first_token_only:
            return (input_shape[0], 1, input_shape[2])
        return tuple(input_shape)

    def compute_output_spec(self, inputs, training=None, first_token_only=None):
        if first_token_only is None:
            first_token_only = self.first_token_only
        shape = tuple(inputs.shape)
        if first_token_only:
            shape = (shape[0], 1, shape[2])
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "dropout_rate": self.dropout_rate,
            "attention_dropout_rate": self.attention_dropout_rate,
            "drop_path_rate": self.drop_path_rate,
            "approximate_gelu": self.approximate_gelu,
            "first_token_only": self.first_token_only,
            "remat": self.remat,
        }
