"""Multi-head self-attention with one fused query/key/value projection."""

import contextlib

import keras
from keras import ops

from keras_vit import _cpu
from keras_vit.layers._backward import in_xla_program
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


# From this many query and key tokens (577 at 384 x 384 with 16-pixel patches)
# the core runs one (image, head) pair at a time in TensorFlow's graph mode on
# CPUs, and on JAX's CPU backend.
PER_HEAD_MIN_TOKENS = 512


_batched_only = []


@contextlib.contextmanager
def batched_core_only():
    """Traces attention with the batched core only (no per-head loop).

    For graphs that leave TensorFlow, such as TFLite's, whose interpreter runs
    the loop's list operations slowly or not at all.
    """
    _batched_only.append(True)
    try:
        yield
    finally:
        _batched_only.pop()


def _runs_per_head(query, key):
    """Whether `_attention_core_per_head` is the faster core here.

    In TensorFlow's graph mode on the CPU, the batched products of each
    (tokens x head_dim) query with its key, and the softmax over the
    (batch, heads, tokens, tokens) weights, run far slower at long sequences
    than one (image, head) pair at a time, whose weights stay in the cache and
    whose pairs the loop runs side by side. Measured on a 2-core AMD EPYC at
    577 tokens, batch 8, 6 heads (`python benchmarks/micro.py attention
    --tokens 577`): the core's forward 94.7 -> 56.2 ms, forward + backward
    253.0 -> 168.7 ms; a ViT-S/16 at 384 in graph mode predicted 1.18-1.26x
    and trained 1.11-1.42x faster (docs/performance.md, "Long sequences").
    Under TensorFlow's XLA the whole model was not faster (0.97x), so it keeps
    the batched core. On JAX's CPU backend (every call compiled by XLA) the
    pairs win: at 577 tokens the core's forward ran 1.7-2.1x and forward +
    backward 1.5x faster, and its backward pass keeps no weights
    (`python benchmarks/micro.py attention --tokens 577` with
    KERAS_BACKEND=jax; docs/performance.md, "Long sequences on JAX"). At 197
    tokens they gain nothing on either backend.
    """
    tokens = (query.shape[2], key.shape[2])
    if _batched_only or any(count is None or count < PER_HEAD_MIN_TOKENS for count in tokens):
        return False
    return _cpu.jax_on_cpu() or (_cpu.cpu_only_tensorflow() and not in_xla_program())


def _attention_core_per_head(query, key, value):
    """`_attention_core`, one (image, head) pair per loop step.

    The same arithmetic on 2-D products inside a `tf.map_fn` loop (a while
    loop in the graph, in XLA and in a SavedModel; `jax.lax.map` on JAX, see
    `_attention_core_per_head_jax`), but training keeps less.
    The backward pass recomputes each pair's weights from its query and key
    instead of keeping the (batch, heads, tokens, tokens) weights from the
    forward pass: the largest tensor a block keeps at long sequences (64 MB
    per block at ViT-S/16 384, batch 8: 0.77 GB over 12 blocks), for one more
    (tokens x head_dim) by (head_dim x tokens) product and softmax per pair.
    And it reads the output in the layout it returns (which the output
    projection keeps) rather than keeping the loop's own. The recomputation
    runs the forward's own operations on the same inputs, so the weights, and
    the gradients, are those of keeping them, bit for bit (checked on this
    machine at 577 tokens).
    """
    if keras.backend.backend() == "jax":
        return _attention_core_per_head_jax(query, key, value)
    import tensorflow as tf

    heads, queries, head_dim = query.shape[1], query.shape[2], query.shape[3]
    keys = key.shape[2]

    def pairs(tensor, tokens):  # (batch, heads, tokens, head_dim) -> (pairs, tokens, head_dim)
        return tf.reshape(tensor, (-1, tokens, head_dim))

    def to_output_layout(tensor):  # (pairs, queries, head_dim) -> (batch, queries, heads, head_dim)
        return tf.transpose(tf.reshape(tensor, (-1, heads, queries, head_dim)), (0, 2, 1, 3))

    def weights_of(q, k):
        return tf.nn.softmax(tf.cast(tf.matmul(q, k, transpose_b=True), tf.float32), axis=-1)

    @tf.custom_gradient
    def core(query, key, value):
        def forward(pair):
            q, k, v = pair
            return tf.matmul(tf.cast(weights_of(q, k), v.dtype), v)

        inputs = (pairs(query, queries), pairs(key, keys), pairs(value, keys))
        outputs = tf.map_fn(forward, inputs, fn_output_signature=value.dtype)
        result = to_output_layout(outputs)

        def grad(upstream):
            def backward(pair):
                row, d_o, q, k, v = pair
                w = weights_of(q, k)
                d_value = tf.matmul(tf.cast(w, d_o.dtype), d_o, transpose_a=True)
                d_weights = tf.cast(tf.matmul(d_o, v, transpose_b=True), tf.float32)
                d_logits = tf.cast(w * (d_weights - row), q.dtype)
                d_query = tf.matmul(d_logits, k)
                d_key = tf.matmul(d_logits, q, transpose_a=True)
                return d_query, d_key, d_value

            # The softmax's row term sum_d dO * O, from the output as returned:
            # the output projection keeps that tensor anyway, so the loop's own
            # output (the same numbers, laid out by pair) need not be kept too.
            row = tf.reduce_sum(
                tf.cast(upstream, tf.float32) * tf.cast(result, tf.float32), axis=-1
            )  # (batch, queries, heads)
            row = tf.reshape(tf.transpose(row, (0, 2, 1)), (-1, queries, 1))
            d_outputs = pairs(tf.transpose(upstream, (0, 2, 1, 3)), queries)
            # query + 0 * (an element of upstream): the same numbers, but the
            # loop's recomputation of the weights now waits for the backward
            # pass; TensorFlow's executor would otherwise start its first
            # iterations as soon as the query and key exist, in the forward pass.
            anchor = tf.cast(0.0, query.dtype) * d_outputs[:1, :1, :1]
            d_query, d_key, d_value = tf.map_fn(
                backward,
                (row, d_outputs, inputs[0] + anchor, *inputs[1:]),
                fn_output_signature=(query.dtype, key.dtype, value.dtype),
            )
            return (
                tf.reshape(d_query, tf.shape(query)),
                tf.reshape(d_key, tf.shape(key)),
                tf.reshape(d_value, tf.shape(value)),
            )

        return result, grad

    return core(query, key, value)


def _attention_core_per_head_jax(query, key, value):
    """`_attention_core_per_head` on JAX: a `jax.lax.map` over the pairs.

    The same forward and backward arithmetic as the TensorFlow loop, written
    as a `jax.custom_vjp`: the backward pass keeps the query, key, value and
    the output as returned (which the output projection keeps anyway), and
    recomputes each pair's weights.
    """
    import jax
    import jax.numpy as jnp

    heads, queries, head_dim = query.shape[1], query.shape[2], query.shape[3]
    keys = key.shape[2]

    def pairs(tensor, tokens):  # (batch, heads, tokens, head_dim) -> (pairs, tokens, head_dim)
        return jnp.reshape(tensor, (-1, tokens, head_dim))

    def weights_of(q, k):
        return jax.nn.softmax((q @ k.T).astype(jnp.float32), axis=-1)

    def forward(query, key, value):
        def pair_forward(pair):
            q, k, v = pair
            return weights_of(q, k).astype(v.dtype) @ v

        outputs = jax.lax.map(
            pair_forward, (pairs(query, queries), pairs(key, keys), pairs(value, keys))
        )
        # (pairs, queries, head_dim) -> (batch, queries, heads, head_dim)
        return jnp.transpose(jnp.reshape(outputs, (-1, heads, queries, head_dim)), (0, 2, 1, 3))

    def forward_keeping(query, key, value):
        result = forward(query, key, value)
        return result, (query, key, value, result)

    def backward(kept, upstream):
        query, key, value, result = kept

        def pair_backward(pair):
            row, d_o, q, k, v = pair
            w = weights_of(q, k)
            d_value = w.astype(d_o.dtype).T @ d_o
            d_weights = (d_o @ v.T).astype(jnp.float32)
            d_logits = (w * (d_weights - row)).astype(q.dtype)
            return d_logits @ k, d_logits.T @ q, d_value

        # The softmax's row term sum_d dO * O, from the output as returned.
        row = jnp.sum(upstream.astype(jnp.float32) * result.astype(jnp.float32), axis=-1)
        row = jnp.reshape(jnp.transpose(row, (0, 2, 1)), (-1, queries, 1))
        d_outputs = pairs(jnp.transpose(upstream, (0, 2, 1, 3)), queries)
        d_query, d_key, d_value = jax.lax.map(
            pair_backward,
            (row, d_outputs, pairs(query, queries), pairs(key, keys), pairs(value, keys)),
        )
        return (
            jnp.reshape(d_query, query.shape),
            jnp.reshape(d_key, key.shape),
            jnp.reshape(d_value, value.shape),
        )

    core = jax.custom_vjp(forward)
    core.defvjp(forward_keeping, backward)
    return core(query, key, value)


def _fused_attention(query, key, value):
    """`keras.ops.dot_product_attention` for a scaled `query`.

    All three in Keras' (batch, tokens, heads, head_dim) layout, which
    `MultiHeadSelfAttention._attend` slices out of the qkv projection with no
    transpose; the output, (batch, query tokens, heads, head_dim), is the
    layout the cores return too.
    """
    return ops.dot_product_attention(query, key, value, scale=1.0)


def _fuses_attention():
    """Whether the attention goes to `keras.ops.dot_product_attention`: on JAX with a GPU.

    There Keras runs cuDNN's fused (flash) attention where the GPU, cuDNN and
    the inputs allow it (Ampere or newer, float16 or bfloat16, head_dim a
    multiple of 8 up to 128, 256 from Hopper on), which never materializes
    the (tokens x tokens) weights, and XLA's own attention otherwise (its
    logits and softmax in float32, as the cores'); timm's GPU training uses
    PyTorch's fused attention likewise. `benchmarks/gpu.sh` measures it. On
    CPUs the hand-written cores stay: there TensorFlow's
    `ops.dot_product_attention` (einsum and softmax, no fused kernel) ran the
    core in 31.6 against 14.4 ms in graph mode, 18.3 against 17.5 ms with XLA
    (docs/performance.md). TensorFlow keeps them on GPUs too, for want of a
    fused kernel. `keras.config.disable_flash_attention()` keeps them on
    GPUs as well, for models traced after it, and
    `keras.config.enable_flash_attention()` (Keras' default) restores this.
    """
    if keras.backend.backend() != "jax" or keras.config.is_flash_attention_enabled() is False:
        return False
    import jax

    return jax.default_backend() in ("gpu", "cuda", "rocm")


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
        self.tokens = input_shape[1]  # None: any
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

    def _project(self, inputs):
        # The projection runs on (batch * tokens, D) rows: one plain matrix product,
        # which oneDNN fuses with the bias (a batched product of 3-D inputs is
        # slower on CPUs).
        return self.qkv(ops.reshape(inputs, (-1, self.hidden_dim)))

    def _split_heads(self, inputs):
        return self._heads(self._project(inputs), _tokens(inputs))

    def _heads(self, qkv, tokens):
        # One transpose gives (3, batch, heads, tokens, head_dim), unstacked into
        # query, key and value: batched matrix products on that layout, and an
        # unstack (not three slices) for the backward pass, halve the attention
        # core's forward + backward time without XLA (see benchmarks/micro.py
        # attention).
        qkv = ops.reshape(qkv, (-1, tokens, 3, self.num_heads, self.head_dim))
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
        return self._attend(self._project(inputs), _tokens(inputs), training, num_queries)

    def normalized_call(self, inputs, norm, training=None, num_queries=None):
        """`self(norm(inputs), ...)` for a `LayerNorm` `norm`, in training.

        The layer norm and the qkv projection run together (`LayerNorm.dense`),
        so the backward pass keeps `inputs` and not the normalized tokens.
        `TransformerBlock` calls it in training; it expects this layer built
        and `inputs` in its compute dtype.
        """
        qkv = norm.dense(ops.reshape(inputs, (-1, self.hidden_dim)), self.qkv)
        return self._attend(qkv, _tokens(inputs), training, num_queries)

    def _attend(self, qkv, tokens, training, num_queries):
        # qkv: the projection's (batch * tokens, 3 * D) rows. Each branch gives x as
        # (batch, query tokens, heads, head_dim), the layout the output projection reads.
        dropout = training and self.attention_dropout_rate > 0.0
        if not dropout and _fuses_attention():
            # Keras' (batch, tokens, heads, head_dim) straight from the rows: no transpose.
            qkv = ops.reshape(qkv, (-1, tokens, 3, self.num_heads, self.head_dim))
            query, key, value = ops.unstack(qkv, num=3, axis=2)
            if num_queries is not None:
                query = query[:, :num_queries]
            x = _fused_attention(self._scaled_query(query), key, value)
        else:
            query, key, value = self._heads(qkv, tokens)  # each (batch, heads, tokens, head_dim)
            if num_queries is not None:
                query = query[:, :, :num_queries]
            if dropout:
                weights = ops.cast(self._attention_weights(query, key), value.dtype)
                weights = self.attention_dropout(weights, training=training)
                x = ops.einsum("bhqk,bhkd->bqhd", weights, value)
            elif _runs_per_head(query, key):
                x = _attention_core_per_head(self._scaled_query(query), key, value)
            else:
                x = _attention_core(self._scaled_query(query), key, value)
        queries = _tokens(x)
        x = self.output_dropout(self.proj(ops.reshape(x, (-1, self.hidden_dim))), training=training)
        return ops.reshape(x, (-1, queries, self.hidden_dim))

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


def _tokens(tensor, axis=1):
    """The token count: a Python int where the shape is known, else a scalar tensor."""
    count = tensor.shape[axis]
    return count if count is not None else ops.shape(tensor)[axis]


def runs_per_head(model):
    """Whether an attention layer of `model` takes the per-head core in graph mode.

    True when a built `MultiHeadSelfAttention` of `model` (nested layers
    included) reads at least `PER_HEAD_MIN_TOKENS` tokens: on a TensorFlow
    machine without GPU or TPU, its graph-mode calls run one (image, head)
    pair at a time (on JAX's CPU backend, all its calls do).
    """
    return (tokens_per_image(model) or 0) >= PER_HEAD_MIN_TOKENS


def tokens_per_image(model):
    """The most tokens a `MultiHeadSelfAttention` of `model` reads per image, or None.

    None when `model` (nested layers included) has no built attention layer
    of known size (a model built for any image size).
    """
    counts = [
        layer.tokens
        for layer in model._flatten_layers()
        if isinstance(layer, MultiHeadSelfAttention) and getattr(layer, "tokens", None)
    ]
    return max(counts) if counts else None
