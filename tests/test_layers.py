"""Each layer against a direct NumPy computation, round trips and bad input."""

import inspect
import math
import re

import keras
import numpy as np
import pytest
from numpy_reference import np_gelu, np_layer_norm, np_softmax

from keras_vit import layers

RNG = np.random.default_rng(1)


def np_attention(x, qkv_kernel, qkv_bias, proj_kernel, proj_bias, num_heads):
    batch, tokens, dim = x.shape
    head_dim = dim // num_heads
    qkv = x @ qkv_kernel + qkv_bias
    q, k, v = (
        qkv[..., i * dim : (i + 1) * dim].reshape(batch, tokens, num_heads, head_dim)
        for i in range(3)
    )
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    weights = np_softmax(logits)
    out = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, tokens, dim)
    return out @ proj_kernel + proj_bias, weights


def perturb(layer):
    """Give every weight random values so that each one matters."""
    for weight in layer.weights:
        weight.assign(RNG.normal(0, 0.5, weight.shape).astype("float32"))


def to_numpy(x):
    return keras.ops.convert_to_numpy(x)


def assert_round_trip(layer, inputs):
    """get_config -> from_config gives the same config, and the same outputs."""
    expected = to_numpy(layer(inputs))
    config = layer.get_config()
    clone = layer.__class__.from_config(config)
    assert clone.get_config() == config
    clone(inputs)
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(to_numpy(clone(inputs)), expected, rtol=1e-6, atol=1e-6)
    # Through the registered serialization path as well.
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(revived) is type(layer) and revived.get_config() == config


# Patches ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "image_shape, patch_size", [((32, 32), 8), ((24, 40), (4, 8)), ((8, 6), (2, 3))]
)
def test_patches_match_numpy_row_major_order(image_shape, patch_size):
    images = RNG.normal(size=(2, *image_shape, 3)).astype("float32")
    ph, pw = (patch_size, patch_size) if isinstance(patch_size, int) else patch_size
    out = to_numpy(layers.Patches(patch_size)(images))
    gh, gw = image_shape[0] // ph, image_shape[1] // pw
    assert out.shape == (2, gh * gw, ph * pw * 3)
    for b in range(2):
        for row in range(gh):
            for col in range(gw):
                patch = images[b, row * ph : (row + 1) * ph, col * pw : (col + 1) * pw, :]
                np.testing.assert_array_equal(out[b, row * gw + col], patch.reshape(-1))


def test_patches_round_trip():
    assert_round_trip(layers.Patches((4, 8)), RNG.normal(size=(1, 16, 16, 3)).astype("float32"))


@pytest.mark.parametrize(
    "shape, message",
    [((2, 30, 32, 3), "divisible"), ((2, 32, 32), "rank 4"), ((32, 32, 3, 1, 1), "rank 4")],
)
def test_patches_reject_bad_images(shape, message):
    with pytest.raises(ValueError, match=message):
        layers.Patches(8)(np.zeros(shape, "float32"))


@pytest.mark.parametrize("patch_size", [0, -4, 2.5, (4,), (4, 0), "8", True])
def test_patches_reject_bad_patch_size(patch_size):
    with pytest.raises(ValueError, match="patch_size"):
        layers.Patches(patch_size)


# PatchEncoder ----------------------------------------------------------------


@pytest.mark.parametrize("class_token", [True, False])
def test_patch_encoder_matches_flattened_projection(class_token):
    images = RNG.normal(size=(2, 16, 24, 3)).astype("float32")
    layer = layers.PatchEncoder((4, 8), hidden_dim=10, class_token=class_token)
    layer(images)
    perturb(layer)
    out = to_numpy(layer(images))
    patches = to_numpy(layers.Patches((4, 8))(images))
    kernel = to_numpy(layer.kernel)
    assert kernel.shape == (4, 8, 3, 10)  # the conv layout of the checkpoints
    expected = patches @ kernel.reshape(-1, 10) + to_numpy(layer.bias)
    if class_token:
        cls = np.broadcast_to(to_numpy(layer.cls_token), (2, 1, 10))
        expected = np.concatenate([cls, expected], axis=1)
    expected = expected + to_numpy(layer.position_embedding)
    assert out.shape == (2, 4 * 3 + int(class_token), 10)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_patch_encoder_initialisation_is_the_originals():
    layer = layers.PatchEncoder(4, hidden_dim=256)
    layer(np.zeros((1, 64, 64, 3), "float32"))
    np.testing.assert_array_equal(to_numpy(layer.cls_token), 0.0)
    assert abs(float(np.std(to_numpy(layer.position_embedding))) - 0.02) < 0.002
    np.testing.assert_array_equal(to_numpy(layer.bias), 0.0)


def test_patch_encoder_round_trip():
    assert_round_trip(
        layers.PatchEncoder(8, hidden_dim=16, class_token=False),
        RNG.normal(size=(2, 32, 16, 3)).astype("float32"),
    )


def test_patch_encoder_rejects_wrong_channels_and_grid():
    layer = layers.PatchEncoder(8, hidden_dim=16)
    layer(np.zeros((1, 32, 32, 3), "float32"))
    with pytest.raises(ValueError, match="3 channels"):
        layer(np.zeros((1, 32, 32, 1), "float32"))
    with pytest.raises(ValueError, match="built for"):
        layer(np.zeros((1, 64, 64, 3), "float32"))
    with pytest.raises(ValueError, match="hidden_dim"):
        layers.PatchEncoder(8, hidden_dim=0)
    with pytest.raises(TypeError, match="class_token"):
        layers.PatchEncoder(8, hidden_dim=8, class_token="yes")
    with pytest.raises(ValueError, match="grid_size"):
        layers.PatchEncoder(8, hidden_dim=8, grid_size=(4, 0))


def test_patch_encoder_with_a_grid_resizes_its_position_embedding():
    """grid_size: any image size; the embedding's grid part resized, the class token's kept.

    The resize itself is checked against timm's in test_weights.py.
    """
    layer = layers.PatchEncoder(4, hidden_dim=6, grid_size=(2, 3))
    layer.build((None, None, None, 3))
    assert tuple(layer.position_embedding.shape) == (1, 1 + 2 * 3, 6)
    perturb(layer)
    learned = to_numpy(layer.position_embedding)
    np.testing.assert_array_equal(to_numpy(layer.position_embedding_for((2, 3))), learned)
    for grid in [(2, 3), (4, 6), (1, 1), (3, 2)]:
        images = RNG.normal(size=(2, 4 * grid[0], 4 * grid[1], 3)).astype("float32")
        embedding = to_numpy(layer.position_embedding_for(grid))
        assert embedding.shape == (1, 1 + grid[0] * grid[1], 6)
        np.testing.assert_array_equal(embedding[:, :1], learned[:, :1])
        # The same as a fixed layer built for this grid that holds the resized embedding.
        fixed = layers.PatchEncoder(4, hidden_dim=6)
        fixed(images)
        for name in ("kernel", "bias", "cls_token"):
            getattr(fixed, name).assign(getattr(layer, name))
        fixed.position_embedding.assign(embedding)
        np.testing.assert_allclose(to_numpy(layer(images)), to_numpy(fixed(images)), atol=1e-6)
    assert_round_trip(layer, RNG.normal(size=(2, 12, 8, 3)).astype("float32"))


def _layer_loss_and_gradients(layer, x, upstream, mode="eager"):
    """sum(layer(x) * upstream) and its gradients for x and each trainable weight."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        def value_and_gradients(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x, training=True) * upstream)
            return loss, tape.gradient(loss, [x, *layer.trainable_variables])

        if mode != "eager":
            value_and_gradients = tf.function(value_and_gradients, jit_compile=mode == "xla")
        loss, grads = value_and_gradients(tf.constant(x))
        return float(loss), [g.numpy() for g in grads]
    import jax

    takes_training = "training" in inspect.signature(layer.call).parameters
    kwargs = {"training": True} if takes_training else {}  # Keras' own layers may not

    def loss_fn(trainable, x):
        out, _ = layer.stateless_call(trainable, non_trainable, x, **kwargs)
        return (out * upstream).sum()

    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]
    loss, (d_weights, d_x) = jax.value_and_grad(loss_fn, argnums=(0, 1))(trainable, x)
    return float(loss), [np.asarray(d_x), *(np.asarray(g) for g in d_weights)]


def _tensorflow_with_a_pool():
    """TensorFlow, for tests that read its CPU pool's peak; skips elsewhere."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("measures TensorFlow's CPU pool")
    import tensorflow as tf

    from keras_vit import _memory

    if not _memory.cpu_memory_pooled():
        pytest.skip("TensorFlow's CPU pool is off: no peak to read")
    return tf


def _pool_peak_of_a_training_step(forward, x, weights):
    """Peak bytes of TensorFlow's CPU pool, above those live before, while a
    graph-mode step differentiates sum(forward(x) ** 2) for `weights`."""
    import tensorflow as tf

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(forward(x)))
        return tape.gradient(loss, weights)

    step(x)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]  # earlier tests' tensors
    step(x)
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def _residual_stack(stack, x):
    """Builds each layer of `stack` on `x`; returns h -> h + layer(h, training=True)
    through them all, and their trainable weights."""
    for layer in stack:
        layer(x)

    def forward(h):
        for layer in stack:
            h = h + layer(h, training=True)
        return h

    return forward, [w for layer in stack for w in layer.trainable_weights]


def _central_differences(loss, arrays, which, step):
    """d loss / d arrays[which], each element by a central difference in float64."""
    gradient = np.zeros_like(arrays[which])
    for index in np.ndindex(gradient.shape):
        shifted = [a.copy() for a in arrays]
        shifted[which][index] += step
        plus = loss(*shifted)
        shifted[which][index] -= 2 * step
        gradient[index] = (plus - loss(*shifted)) / (2 * step)
    return gradient


# LayerNorm -------------------------------------------------------------------


def _layer_norm_inputs(shape):
    x = RNG.normal(0, 2, shape).astype("float32") + 3.0
    # Rows of tiny variance, where the epsilon decides the result.
    x.reshape(-1, shape[-1])[::2] *= 1e-3
    return x


def _perturbed_layer_norm(width):
    layer = layers.LayerNorm(epsilon=1e-6)
    layer.build((None, width))
    layer.gamma.assign(RNG.normal(1, 0.5, width).astype("float32"))
    layer.beta.assign(RNG.normal(0, 0.5, width).astype("float32"))
    return layer


@pytest.mark.parametrize("shape", [(2, 5, 24), (7, 24)])
def test_layer_norm_matches_numpy(shape):
    layer = _perturbed_layer_norm(shape[-1])
    x = _layer_norm_inputs(shape)
    expected = np_layer_norm(x, to_numpy(layer.gamma), to_numpy(layer.beta))
    for training in (False, True):
        np.testing.assert_allclose(
            to_numpy(layer(x, training=training)), expected, rtol=1e-4, atol=1e-5
        )
    assert_round_trip(layer, x)


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_layer_norm_gradients_match_finite_differences_of_numpy(mode):
    # LayerNorm trains with a hand-written backward pass: check it against
    # central differences of the float64 NumPy forward, for every input value,
    # gamma and beta. Half of the rows have a variance near epsilon.
    if mode != "eager" and keras.backend.backend() != "tensorflow":
        pytest.skip("graph and XLA modes are TensorFlow's")
    shape = (2, 3, 8)
    layer = _perturbed_layer_norm(shape[-1])
    x = _layer_norm_inputs(shape)
    upstream = RNG.normal(size=shape).astype("float32")
    _, grads = _layer_loss_and_gradients(layer, x, upstream, mode)
    assert [w.path.split("/")[-1] for w in layer.trainable_variables] == ["gamma", "beta"]
    arrays = [
        x.astype("float64"),
        *(to_numpy(w).astype("float64") for w in (layer.gamma, layer.beta)),
    ]

    def numpy_loss(x, gamma, beta):
        return float((np_layer_norm(x, gamma, beta) * upstream).sum())

    step = 1e-7
    for which, got in enumerate(grads):
        expected = _central_differences(numpy_loss, arrays, which, step)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3 * scale)


@pytest.mark.parametrize("dtype", [None, "mixed_bfloat16"])
def test_layer_norm_gradients_match_keras_layer(dtype):
    x = _layer_norm_inputs((2, 5, 16))
    upstream = RNG.normal(size=x.shape).astype("float32")
    ours = layers.LayerNorm(epsilon=1e-6, dtype=dtype)
    reference = keras.layers.LayerNormalization(epsilon=1e-6, dtype=dtype)
    for layer in (ours, reference):
        layer.build(x.shape)
    perturbed = _perturbed_layer_norm(x.shape[-1])
    for layer in (ours, reference):
        layer.set_weights(perturbed.get_weights())
    loss, got = _layer_loss_and_gradients(ours, x, upstream)
    expected_loss, expected = _layer_loss_and_gradients(reference, x, upstream)
    tolerance = 1e-4 if dtype is None else 2e-2
    assert loss == pytest.approx(expected_loss, rel=tolerance, abs=tolerance)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and np.all(np.isfinite(g))
        np.testing.assert_allclose(g, e, rtol=tolerance, atol=tolerance * np.abs(e).max())


@pytest.mark.tensorflow_only
@pytest.mark.parametrize("shape", [(2, 5, 24), (7, 24)])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_layer_norm_fused_graph_matches_numpy_and_its_gradient(monkeypatch, shape, jit_compile):
    import tensorflow as tf

    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "onednn_enabled", lambda: True)  # the form oneDNN fuses
    layer = _perturbed_layer_norm(shape[-1])
    x = tf.constant(_layer_norm_inputs(shape))
    weights = tf.constant(RNG.normal(0, 1, shape).astype("float32"))

    def value_and_gradient(training):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=training)
            loss = tf.reduce_sum(y * weights)
        return y, tape.gradient(loss, x)

    graph = tf.function(value_and_gradient, jit_compile=jit_compile)
    expected = np_layer_norm(x.numpy(), layer.gamma.numpy(), layer.beta.numpy())
    fused, fused_gradient = graph(False)
    _, keras_gradient = graph(True)  # training: the hand-written backward pass
    np.testing.assert_allclose(fused.numpy(), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fused_gradient.numpy(), keras_gradient.numpy(), rtol=1e-3, atol=1e-2)

    # The inference graph holds the batch-norm form that oneDNN fuses; training does not.
    def ops_of(training):
        function = tf.function(lambda v: layer(v, training=training))
        return {op.type for op in function.get_concrete_function(x).graph.get_operations()}

    assert "FusedBatchNormV3" in ops_of(False)
    assert "FusedBatchNormV3" not in ops_of(True)


@pytest.mark.tensorflow_only
@pytest.mark.parametrize(
    "onednn, cpu_only, fused", [(True, True, True), (False, True, False), (False, False, True)]
)
def test_layer_norm_emits_the_batch_norm_form_only_where_it_is_fast(
    monkeypatch, onednn, cpu_only, fused
):
    # Without oneDNN, on a CPU, Eigen's batch-norm kernel is ~3x slower than
    # the plain normalization; a GPU or oneDNN gets the fused form.
    import tensorflow as tf

    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "onednn_enabled", lambda: onednn)
    monkeypatch.setattr(_cpu, "cpu_only_tensorflow", lambda: cpu_only)
    layer = _perturbed_layer_norm(24)
    x = tf.constant(_layer_norm_inputs((2, 5, 24)))
    function = tf.function(lambda v: layer(v, training=False))
    ops = {op.type for op in function.get_concrete_function(x).graph.get_operations()}
    assert ("FusedBatchNormV3" in ops) is fused
    expected = np_layer_norm(x.numpy(), layer.gamma.numpy(), layer.beta.numpy())
    np.testing.assert_allclose(function(x).numpy(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.tensorflow_only
def test_layer_norm_fused_graph_keeps_mixed_precision_dtypes():
    import tensorflow as tf

    layer = layers.LayerNorm(epsilon=1e-6, dtype="mixed_bfloat16")
    x = _layer_norm_inputs((2, 3, 8)).astype("float32")
    y = tf.function(lambda v: layer(tf.cast(v, "bfloat16"), training=False))(x)
    assert y.dtype == tf.bfloat16
    np.testing.assert_allclose(
        y.numpy().astype("float32"), np_layer_norm(x, 1.0, 0.0), rtol=2e-2, atol=2e-2
    )


def test_layer_norm_other_axes_and_options_are_keras_layer():
    x = RNG.normal(0, 1, (2, 3, 4)).astype("float32")
    for kwargs in (dict(axis=1), dict(center=False, scale=False)):
        ours = layers.LayerNorm(epsilon=1e-6, **kwargs)
        reference = keras.layers.LayerNormalization(epsilon=1e-6, **kwargs)
        np.testing.assert_allclose(to_numpy(ours(x)), to_numpy(reference(x)), rtol=1e-6, atol=1e-6)


# Attention, MLP, DropPath, TransformerBlock ---------------------------------


@pytest.mark.parametrize("core", ["default", "fused"])
def test_attention_matches_numpy(core, request):
    calls = request.getfixturevalue("fused_calls") if core == "fused" else None
    x = RNG.normal(size=(2, 7, 12)).astype("float32")
    layer = layers.MultiHeadSelfAttention(num_heads=3)
    layer(x)
    perturb(layer)
    if calls is not None:
        calls.clear()
    expected, expected_weights = np_attention(
        x,
        *(
            to_numpy(w)
            for w in (layer.qkv.kernel, layer.qkv.bias, layer.proj.kernel, layer.proj.bias)
        ),
        3,
    )
    np.testing.assert_allclose(to_numpy(layer(x)), expected, rtol=1e-4, atol=1e-4)
    # The class token alone (as the last block of a class-token model attends).
    first = to_numpy(layer(x, num_queries=1))
    np.testing.assert_allclose(first, expected[:, :1], rtol=1e-4, atol=1e-4)
    assert calls is None or len(calls) == 2
    weights = to_numpy(layer.attention_weights(x))
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize(
    "mode, core",
    [("eager", "batched"), ("graph", "batched"), ("xla", "batched")]
    + [("eager", "per_head"), ("graph", "per_head"), ("eager", "fused"), ("xla", "fused")],
)
def test_attention_gradients_match_finite_differences_of_numpy(mode, core, request):
    # The attention cores have hand-written backward passes; check them against
    # central differences of the float64 NumPy forward, along random directions
    # in every weight and for each input value.
    if mode != "eager" and keras.backend.backend() != "tensorflow":
        pytest.skip("graph and XLA modes are TensorFlow's")
    fixture = {"per_head": "per_head_calls", "fused": "fused_calls"}.get(core)
    calls = request.getfixturevalue(fixture) if fixture else None
    x = RNG.normal(size=(2, 5, 12)).astype("float32")
    upstream = RNG.normal(size=(2, 5, 12)).astype("float32")
    layer = layers.MultiHeadSelfAttention(num_heads=3)
    layer(x)
    perturb(layer)
    _, grads = _layer_loss_and_gradients(layer, x, upstream, mode)
    params = [to_numpy(w).astype("float64") for w in layer.trainable_variables]
    names = ["/".join(w.path.split("/")[-2:]) for w in layer.trainable_variables]
    assert names == ["qkv/kernel", "qkv/bias", "proj/kernel", "proj/bias"]

    def numpy_loss(x, params):
        return float((np_attention(x, *params, 3)[0] * upstream).sum())

    step = 1e-6
    x64 = x.astype("float64")
    for _ in range(4):
        directions = [RNG.normal(size=p.shape) for p in params]
        plus = numpy_loss(x64, [p + step * d for p, d in zip(params, directions)])
        minus = numpy_loss(x64, [p - step * d for p, d in zip(params, directions)])
        expected = (plus - minus) / (2 * step)
        got = sum(float((g * d).sum()) for g, d in zip(grads[1:], directions))
        assert got == pytest.approx(expected, rel=1e-3, abs=1e-3)
    d_x = _central_differences(lambda x: numpy_loss(x, params), [x64], 0, step)
    np.testing.assert_allclose(grads[0], d_x, rtol=1e-3, atol=1e-3)
    if calls is not None:
        assert calls, f"the {core} core did not run"


@pytest.mark.tensorflow_only
def test_attention_per_head_core_in_mixed_precision_and_not_under_xla(per_head_calls):
    import tensorflow as tf

    x = RNG.normal(size=(3, 6, 12)).astype("float32")
    upstream = RNG.normal(size=(3, 6, 12)).astype("float32")
    reference = layers.MultiHeadSelfAttention(num_heads=3)
    reference(x)
    perturb(reference)
    count = len(per_head_calls)  # the eager call above took it
    _, expected = _layer_loss_and_gradients(reference, x, upstream, "xla")
    assert len(per_head_calls) == count  # XLA keeps the batched core
    half = layers.MultiHeadSelfAttention(num_heads=3, dtype="mixed_bfloat16")
    half(x)
    for ours, theirs in zip(half.trainable_variables, reference.trainable_variables):
        ours.assign(theirs)
    _, got = _layer_loss_and_gradients(half, x, upstream, "graph")
    assert len(per_head_calls) > count + 1
    for g, e in zip(got, expected):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, e, rtol=0.1, atol=0.15 * np.abs(e).max())
    assert half(x).dtype == tf.bfloat16
    # A short query (the last block's class token) keeps the batched core.
    count = len(per_head_calls)
    reference(x, num_queries=1)
    assert len(per_head_calls) == count


def test_per_head_attention_training_does_not_keep_the_weights(per_head_calls):
    # Twelve attention layers on a residual stream, differentiated in a
    # TensorFlow graph with the per-head core: its backward pass recomputes
    # each pair's weights, so the pool's peak stays under half of what
    # keeping the (batch, heads, tokens, tokens) weights per block would hold
    # (24 MB here), unless the executor ran the recomputation early, in the
    # forward pass, and kept its results instead.
    tf = _tensorflow_with_a_pool()
    batch, tokens, heads, blocks = 4, 256, 2, 12
    attentions = [layers.MultiHeadSelfAttention(num_heads=heads) for _ in range(blocks)]
    x = tf.constant(RNG.normal(size=(batch, tokens, 16)).astype("float32"))
    forward, weights = _residual_stack(attentions, x)
    count = len(per_head_calls)  # the eager calls above took it too
    peak = _pool_peak_of_a_training_step(forward, x, weights)
    assert len(per_head_calls) >= count + blocks, "the traced step did not take the per-head core"
    kept_weights = blocks * batch * heads * tokens * tokens * 4
    assert peak < 0.5 * kept_weights, (peak, kept_weights)


def test_per_head_attention_on_jax_keeps_no_weights_and_trains_alike(per_head_calls):
    # JAX on the CPU takes the per-head core in compiled code too. Twelve
    # attention layers on a residual stream, value and gradients under jax.jit:
    # the same numbers as the batched core, in float32 and in mixed bfloat16,
    # and XLA's temporary buffer stays under half of the (batch, heads, tokens,
    # tokens) weights that the batched core keeps for its backward pass.
    if keras.backend.backend() != "jax":
        pytest.skip("JAX's per-head core")
    import jax

    from keras_vit.layers.attention import batched_core_only

    batch, tokens, heads, blocks = 4, 256, 2, 12
    x = RNG.normal(size=(batch, tokens, 16)).astype("float32")

    def compiled_step(dtype):
        stack = [layers.MultiHeadSelfAttention(heads, dtype=dtype) for _ in range(blocks)]
        for layer in stack:
            layer(x)

        def loss(weights, x):
            h = x
            for layer, own in zip(stack, weights):
                out, _ = layer.stateless_call(own, [], h.astype(layer.compute_dtype))
                h = h + out.astype("float32")
            return (h**2).sum()

        # Random weights small enough for twelve residual layers to stay near 1.
        weights = [
            [RNG.normal(0, 0.1, v.shape).astype("float32") for v in layer.trainable_variables]
            for layer in stack
        ]
        return jax.jit(jax.value_and_grad(loss)), weights

    step, weights = compiled_step("float32")
    count = len(per_head_calls)
    per_head = step.lower(weights, x).compile()
    assert len(per_head_calls) >= count + blocks, "the compiled step did not take the per-head core"
    loss, grads = per_head(weights, x)
    with batched_core_only():
        step, _ = compiled_step("float32")
        batched = step.lower(weights, x).compile()
    expected_loss, expected = batched(weights, x)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-5)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(e), rtol=1e-3, atol=1e-3 * abs(e).max()
        )
    kept_weights = blocks * batch * heads * tokens * tokens * 4
    batched_temporary = batched.memory_analysis().temp_size_in_bytes
    per_head_temporary = per_head.memory_analysis().temp_size_in_bytes
    assert batched_temporary > kept_weights  # the measure sees kept weights
    assert per_head_temporary < 0.5 * kept_weights, (per_head_temporary, kept_weights)

    step, _ = compiled_step("mixed_bfloat16")
    half_loss, half_grads = step(weights, x)
    assert abs(float(half_loss) - float(expected_loss)) < 0.05 * float(expected_loss)
    for g, e in zip(jax.tree.leaves(half_grads), jax.tree.leaves(expected)):
        g = np.asarray(g, dtype="float32")
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, np.asarray(e), rtol=0.1, atol=0.15 * abs(e).max())


def test_attention_gradients_with_attention_dropout_and_in_mixed_precision():
    x = RNG.normal(size=(2, 5, 12)).astype("float32")
    upstream = RNG.normal(size=(2, 5, 12)).astype("float32")
    reference = layers.MultiHeadSelfAttention(num_heads=3)
    reference(x)
    perturb(reference)
    _, expected = _layer_loss_and_gradients(reference, x, upstream)
    # With attention dropout at work the layer takes the automatic-differentiation
    # path; a rate that keeps (almost) everything must give the same gradients
    # once the surviving weights are rescaled, so compare with rate -> tiny.
    dropout = layers.MultiHeadSelfAttention(num_heads=3, attention_dropout_rate=1e-9)
    dropout(x)
    for ours, theirs in zip(dropout.trainable_variables, reference.trainable_variables):
        ours.assign(theirs)
    _, got = _layer_loss_and_gradients(dropout, x, upstream)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)
    # Mixed precision: gradients in the compute dtype, close to float32's.
    half = layers.MultiHeadSelfAttention(num_heads=3, dtype="mixed_bfloat16")
    half(x)
    for ours, theirs in zip(half.trainable_variables, reference.trainable_variables):
        ours.assign(theirs)
    _, got = _layer_loss_and_gradients(half, x, upstream)
    for g, e in zip(got, expected):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, e, rtol=0.1, atol=0.15 * np.abs(e).max())


def test_fused_attention_only_on_jax_with_a_gpu_and_keras_switch_turns_it_off(monkeypatch):
    from keras_vit.layers import attention

    if keras.backend.backend() != "jax":
        assert not attention._fuses_attention()
        pytest.skip("the fused path is JAX's")
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert not attention._fuses_attention()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert attention._fuses_attention()
    try:
        keras.config.disable_flash_attention()
        assert not attention._fuses_attention()
    finally:
        keras.config.enable_flash_attention()  # Keras' default: it decides
    assert keras.config.is_flash_attention_enabled() is None
    assert attention._fuses_attention()


def test_attention_initialisation_limits_match_separate_xavier_kernels():
    layer = layers.MultiHeadSelfAttention(num_heads=4)
    layer.build((None, 5, 256))
    limit = math.sqrt(6 / (256 + 256))  # xavier-uniform of one (D, D) projection
    kernel = to_numpy(layer.qkv.kernel)
    assert kernel.shape == (256, 768)
    assert kernel.max() <= limit and kernel.max() > 0.95 * limit
    np.testing.assert_array_equal(to_numpy(layer.qkv.bias), 0.0)


def test_attention_round_trip_and_errors():
    assert_round_trip(
        layers.MultiHeadSelfAttention(2, attention_dropout_rate=0.1, dropout_rate=0.2),
        RNG.normal(size=(1, 5, 8)).astype("float32"),
    )
    with pytest.raises(
        ValueError, match="hidden_dim.*divisible by `num_heads`.*hidden_dim=10, num_heads=3"
    ):
        layers.MultiHeadSelfAttention(num_heads=3)(np.zeros((1, 4, 10), "float32"))
    with pytest.raises(ValueError, match="num_heads"):
        layers.MultiHeadSelfAttention(num_heads=0)
    with pytest.raises(ValueError, match="attention_dropout_rate"):
        layers.MultiHeadSelfAttention(num_heads=2, attention_dropout_rate=1.5)


@pytest.mark.parametrize("approximate", [False, True])
def test_mlp_matches_numpy(approximate):
    x = RNG.normal(size=(2, 5, 8)).astype("float32")
    layer = layers.MLP(mlp_dim=16, approximate_gelu=approximate)
    layer(x)
    perturb(layer)
    hidden = np_gelu(x @ to_numpy(layer.fc1.kernel) + to_numpy(layer.fc1.bias), approximate)
    expected = hidden @ to_numpy(layer.fc2.kernel) + to_numpy(layer.fc2.bias)
    np.testing.assert_allclose(to_numpy(layer(x)), expected, rtol=1e-4, atol=1e-4)
    assert_round_trip(layer, x)


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_gradient_matches_finite_differences(approximate):
    from keras_vit.layers.transformer import gelu

    x = np.linspace(-6, 6, 241).astype("float32")
    # Central differences of the float64 NumPy GELU: independent of the layer.
    step = 1e-5
    x64 = x.astype("float64")
    expected = (np_gelu(x64 + step, approximate) - np_gelu(x64 - step, approximate)) / (2 * step)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tensor = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(tensor)
            outputs = gelu(tensor, approximate)
        got = tape.gradient(outputs, tensor).numpy()
    else:
        import jax

        got = np.asarray(jax.grad(lambda v: gelu(v, approximate).sum())(x))
    np.testing.assert_allclose(
        to_numpy(gelu(x, approximate)), np_gelu(x64, approximate), rtol=1e-5, atol=1e-6
    )
    # atol: far in the tails float32 tanh saturates at -1, and the true derivative
    # (about -4e-6 at x = -5) rounds to 0.
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_exact_gelu_keeps_its_negative_tail_in_xla_and_in_bfloat16():
    from keras_vit.layers.transformer import gelu

    x = np.linspace(-8, 8, 321).astype("float32")
    expected = np_gelu(x.astype("float64"))
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(lambda v: gelu(v), jit_compile=True)(tf.constant(x)).numpy()
        np.testing.assert_allclose(compiled, expected, rtol=1e-5, atol=2e-6)
    # In bfloat16, 1 + erf(x / sqrt 2) cancels in the tail (-0.0059 for -0.0040
    # at x = -3, 0 at x = -4); the layer keeps Keras' erfc form, within 5% there.
    tail = keras.ops.convert_to_tensor(x[(x >= -4) & (x <= -2)], "bfloat16")
    exact = np_gelu(to_numpy(keras.ops.cast(tail, "float32")).astype("float64"))
    np.testing.assert_allclose(to_numpy(keras.ops.cast(gelu(tail), "float32")), exact, rtol=0.1)


def test_exact_gelu_backward_keeps_its_own_erf_under_xla():
    # The derivative writes Phi(x) through erf(-x / sqrt 2) so that XLA does not
    # merge it with the forward's erf(x / sqrt 2) (which would keep the forward's
    # term alive until the backward pass). Same numbers: erf is odd.
    if keras.backend.backend() != "tensorflow":
        pytest.skip("inspects TensorFlow's XLA program")
    import tensorflow as tf

    from keras_vit.layers.transformer import _gelu_derivative, gelu

    x = np.concatenate([np.linspace(-12, 12, 4801), RNG.normal(scale=3, size=4000)]).astype(
        "float32"
    )

    def value_and_gradient(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            outputs = gelu(v)
        return outputs, tape.gradient(outputs, v)

    compiled = tf.function(value_and_gradient, jit_compile=True)
    hlo = compiled.experimental_get_compiler_ir(tf.constant(x))(stage="optimized_hlo")
    assert len(re.findall(r"\berf\(", hlo)) == 2, hlo

    def plain(v):  # the derivative with Phi(x) written as 0.5 (1 + erf(x / sqrt 2))
        cdf = 0.5 * (1.0 + tf.math.erf(v * (1.0 / math.sqrt(2.0))))
        return cdf + v * tf.exp(-0.5 * v * v) * (1.0 / math.sqrt(2.0 * math.pi))

    for run in (lambda f: f, tf.function, lambda f: tf.function(f, jit_compile=True)):
        got = run(lambda v: _gelu_derivative(v, False))(tf.constant(x)).numpy()
        np.testing.assert_array_equal(got, run(plain)(tf.constant(x)).numpy())


def _value_and_gradients(f, upstream, *args):
    """[f(*args), then the gradient of sum(f(*args) * upstream) for each arg]."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        args = [tf.constant(a) for a in args]
        with tf.GradientTape() as tape:
            tape.watch(args)
            outputs = f(*args)
        return [outputs.numpy()] + [g.numpy() for g in tape.gradient(outputs, args, upstream)]
    import jax

    outputs, pullback = jax.vjp(f, *args)
    return [np.asarray(outputs)] + [np.asarray(g) for g in pullback(upstream)]


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_dense_matches_keras_gelu_then_a_dense_layer(approximate):
    from keras_vit.layers.transformer import gelu_dense

    x = RNG.normal(scale=2.0, size=(12, 16)).astype("float32")
    kernel = RNG.normal(size=(16, 8)).astype("float32")
    bias = RNG.normal(size=(8,)).astype("float32")
    upstream = RNG.normal(size=(12, 8)).astype("float32")

    def plain(x, kernel, bias):  # Keras' own GELU, differentiated automatically
        return keras.ops.matmul(keras.activations.gelu(x, approximate=approximate), kernel) + bias

    fused = _value_and_gradients(
        lambda *a: gelu_dense(*a, approximate=approximate), upstream, x, kernel, bias
    )
    reference = _value_and_gradients(plain, upstream, x, kernel, bias)
    for got, expected in zip(fused, reference):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_mlp_trains_through_gelu_dense_with_the_same_gradients(monkeypatch):
    layer = layers.MLP(mlp_dim=32)
    x = RNG.normal(size=(3, 5, 8)).astype("float32")
    layer(x)
    perturb(layer)
    assert layer._fuses_gelu_and_fc2()
    assert not layers.MLP(mlp_dim=32, dropout_rate=0.1)._fuses_gelu_and_fc2()
    assert not layers.MLP(mlp_dim=32)._fuses_gelu_and_fc2()  # not built yet

    upstream = RNG.normal(size=x.shape).astype("float32")
    fused_outputs = to_numpy(layer(x, training=True))
    fused_loss, fused_gradients = _layer_loss_and_gradients(layer, x, upstream)
    monkeypatch.setattr(layers.MLP, "_fuses_gelu_and_fc2", lambda self: False)
    np.testing.assert_allclose(
        fused_outputs, to_numpy(layer(x, training=True)), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(fused_outputs, to_numpy(layer(x)), rtol=1e-6, atol=1e-6)
    loss, gradients = _layer_loss_and_gradients(layer, x, upstream)
    assert fused_loss == pytest.approx(loss, rel=1e-5)
    for got, expected in zip(fused_gradients, gradients):  # x, then each weight
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_mlp_with_a_lora_or_quantized_fc2_trains_through_the_layers():
    for change in (lambda dense: dense.enable_lora(2), lambda dense: dense.quantize("int8")):
        layer = layers.MLP(mlp_dim=32)
        x = RNG.normal(size=(3, 5, 8)).astype("float32")
        layer(x)
        perturb(layer)
        change(layer.fc2)
        assert not layer._fuses_gelu_and_fc2()
        # The layers themselves run: training gives inference's output (no dropout).
        np.testing.assert_allclose(
            to_numpy(layer(x, training=True)), to_numpy(layer(x)), rtol=1e-6, atol=1e-6
        )
        hidden = keras.activations.gelu(layer.fc1(x.reshape(-1, 8)))
        expected = np.reshape(to_numpy(layer.fc2(hidden)), x.shape)
        np.testing.assert_allclose(
            to_numpy(layer(x, training=True)), expected, rtol=1e-5, atol=1e-6
        )


def test_mlp_training_keeps_less_memory_in_graph_mode(monkeypatch):
    # Twelve MLPs on a residual stream, differentiated in a TensorFlow graph:
    # without GELU's output kept per block, the pool's peak drops by about
    # one (rows, mlp_dim) tensor per block (2 MB here), unless the executor
    # ran the backward's recomputation early and kept its results instead.
    tf = _tensorflow_with_a_pool()
    rows, mlp_dim, blocks = 512, 1024, 12
    mlps = [layers.MLP(mlp_dim) for _ in range(blocks)]
    x = tf.constant(RNG.normal(size=(rows, 32)).astype("float32"))
    forward, weights = _residual_stack(mlps, x)

    def peak():
        return _pool_peak_of_a_training_step(forward, x, weights)

    fused = peak()
    monkeypatch.setattr(layers.MLP, "_fuses_gelu_and_fc2", lambda self: False)
    kept = peak()
    assert kept - fused > 0.5 * blocks * rows * mlp_dim * 4, (kept, fused)


def test_layer_norm_dense_matches_keras_layer_norm_then_a_dense_layer():
    from keras_vit.layers.normalization import layer_norm_dense

    x = (RNG.normal(scale=2.0, size=(12, 16)) + 3.0).astype("float32")
    gamma = RNG.normal(size=(16,)).astype("float32")
    beta = RNG.normal(size=(16,)).astype("float32")
    kernel = RNG.normal(size=(16, 8)).astype("float32")
    bias = RNG.normal(size=(8,)).astype("float32")
    upstream = RNG.normal(size=(12, 8)).astype("float32")
    norm = keras.layers.LayerNormalization(epsilon=1e-6)
    norm.build(x.shape)

    def plain(x, gamma, beta, kernel, bias):  # Keras' layer norm, differentiated automatically
        normalized, _ = norm.stateless_call([gamma, beta], [], x)
        return keras.ops.matmul(normalized, kernel) + bias

    fused = _value_and_gradients(
        lambda x, g, b, k, c: layer_norm_dense(x, g, b, 1e-6, k, c),
        upstream,
        *(x, gamma, beta, kernel, bias),
    )
    reference = _value_and_gradients(plain, upstream, x, gamma, beta, kernel, bias)
    for got, expected in zip(fused, reference):  # outputs, then x, gamma, beta, kernel, bias
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "mode, dtype",
    [("eager", None), ("graph", None), ("xla", None), ("eager", "mixed_bfloat16")],
)
def test_transformer_block_trains_through_layer_norm_dense_with_the_same_gradients(
    monkeypatch, mode, dtype
):
    if mode != "eager" and keras.backend.backend() != "tensorflow":
        pytest.skip("graph and XLA modes are TensorFlow's")
    from keras_vit.layers import normalization

    block = layers.TransformerBlock(num_heads=2, mlp_dim=32, dtype=dtype)
    x = RNG.normal(size=(3, 5, 8)).astype("float32")
    block(x)
    perturb(block)
    upstream = RNG.normal(size=x.shape).astype("float32")
    calls = []
    fused_function = normalization.layer_norm_dense
    monkeypatch.setattr(
        normalization, "layer_norm_dense", lambda *a: calls.append(1) or fused_function(*a)
    )
    fused_loss, fused_gradients = _layer_loss_and_gradients(block, x, upstream, mode)
    assert len(calls) == 2  # norm1 with qkv, norm2 with fc1
    # The same block with each layer norm and Dense layer run as two layers.
    monkeypatch.setattr(
        layers.LayerNorm, "dense", lambda self, inputs, layer: layer(self(inputs, training=True))
    )
    loss, gradients = _layer_loss_and_gradients(block, x, upstream, mode)
    assert len(calls) == 2
    # The bias gradients are sums over rows, in another order than Keras'
    # (1.2e-6 apart at an element of 8e-7 in graph mode, ~0.5 at most). In
    # bfloat16 (8 bits) JAX rounds the fused function's intermediates apart
    # from the layers' (loss 26.354 against 26.330).
    tolerance = 1e-5 if dtype is None else 2e-2
    assert fused_loss == pytest.approx(loss, rel=tolerance)
    for got, expected in zip(fused_gradients, gradients):  # x, then each weight
        scale = np.abs(expected).max()
        np.testing.assert_allclose(
            got, expected, rtol=tolerance, atol=tolerance * scale, err_msg=str(dtype)
        )


def test_layer_norm_dense_with_a_lora_or_quantized_layer_runs_the_layers():
    x = RNG.normal(size=(6, 8)).astype("float32")
    for change in (lambda dense: dense.enable_lora(2), lambda dense: dense.quantize("int8")):
        norm = layers.LayerNorm(epsilon=1e-6)
        dense = keras.layers.Dense(4)
        dense.build(x.shape)
        norm.build(x.shape)
        perturb(norm)
        perturb(dense)
        change(dense)
        expected = to_numpy(dense(norm(x)))
        np.testing.assert_allclose(to_numpy(norm.dense(x, dense)), expected, rtol=1e-6, atol=1e-6)
    # A Dense with an activation is not fused either: the activation applies.
    dense = keras.layers.Dense(4, activation="relu")
    dense.build(x.shape)
    got = to_numpy(norm.dense(x, dense))
    assert got.min() >= 0.0
    np.testing.assert_allclose(got, to_numpy(dense(norm(x))), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"2-D inputs.*Received: inputs.shape=\(2, 3, 8\)"):
        norm.dense(x.reshape(2, 3, 8), dense)


def test_layer_norm_dense_keeps_less_memory_in_graph_mode(monkeypatch):
    # Twelve layer norms, each followed by a Dense layer on a residual stream
    # and differentiated in a TensorFlow graph: the pool's peak drops by about
    # one normalized (rows, D) tensor per pair (1 MB here), unless the
    # executor ran the backward's recomputation early and kept its result.
    tf = _tensorflow_with_a_pool()
    rows, width, pairs = 512, 512, 12
    norms = [layers.LayerNorm(epsilon=1e-6) for _ in range(pairs)]
    denses = [keras.layers.Dense(width) for _ in range(pairs)]
    x = tf.constant(RNG.normal(size=(rows, width)).astype("float32"))
    for norm, dense in zip(norms, denses):
        dense(norm(x))
    weights = [w for layer in norms + denses for w in layer.trainable_weights]

    def forward(h):
        for norm, dense in zip(norms, denses):
            h = h + tf.tanh(norm.dense(h, dense))
        return h

    def peak():
        return _pool_peak_of_a_training_step(forward, x, weights)

    fused = peak()
    monkeypatch.setattr(
        layers.LayerNorm, "dense", lambda self, inputs, layer: layer(self(inputs, training=True))
    )
    kept = peak()
    assert kept - fused > 0.5 * pairs * rows * width * 4, (kept, fused)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow graphs")
def test_graph_mode_runs_the_backward_passes_element_wise_work_as_xla_programs():
    """Traced in graph mode (not XLA), layer_norm_dense's and gelu_dense's
    element-wise work runs as small XLA-compiled functions between TensorFlow's
    products, with eager's values; inside an XLA program it is inlined as it is."""
    import tensorflow as tf

    from keras_vit.layers.normalization import layer_norm_dense
    from keras_vit.layers.transformer import gelu_dense

    rng = np.random.default_rng(7)
    x = tf.constant((rng.normal(scale=2.0, size=(12, 16)) + 1.0).astype("float32"))
    gamma, beta = (tf.constant(rng.normal(size=(16,)).astype("float32")) for _ in range(2))
    kernel = tf.constant(rng.normal(size=(16, 16)).astype("float32"))
    bias = tf.constant(rng.normal(size=(16,)).astype("float32"))
    upstream = tf.constant(rng.normal(size=(12, 16)).astype("float32"))
    inputs = (x, gamma, beta, kernel, bias)

    def step(x, gamma, beta, kernel, bias):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta, kernel, bias])
            h = layer_norm_dense(x, gamma, beta, 1e-6, kernel, bias)
            outputs = gelu_dense(h, kernel, bias)
        return [outputs, *tape.gradient(outputs, [x, gamma, beta, kernel, bias], upstream)]

    def compiled_functions(function):
        graph = function.get_concrete_function(*inputs).graph.as_graph_def()
        return sorted(
            f.signature.name
            for f in graph.library.function
            if "_XlaMustCompile" in f.attr and f.attr["_XlaMustCompile"].b
        )

    eager = step(*inputs)
    graph = tf.function(step)
    # layer_norm_dense: the forward's normalization, its recomputation and the
    # backward; gelu_dense: the forward's GELU, its recomputation and the backward.
    names = [re.sub(r"^__inference_|_\d+$", "", name) for name in compiled_functions(graph)]
    assert names == [
        "_gelu_backward_fused",
        "_gelu_forward_fused",
        "_gelu_value_fused",
        "_normalized_rows",
        "_renormalized_rows",
        "_rows_backward",
    ], names
    xla = tf.function(step, jit_compile=True)
    assert compiled_functions(xla) == []
    for function in (graph, xla):  # float32 sums in another order: relative to each scale
        for got, expected in zip(function(*inputs), eager):
            scale = float(np.abs(expected.numpy()).max())
            np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0, atol=1e-5 * scale)


def test_mlp_bias_initialisation_is_tiny_normal():
    layer = layers.MLP(mlp_dim=4096)
    layer.build((None, 3, 1024))
    bias = to_numpy(layer.fc1.bias)
    assert 0 < np.std(bias) < 1e-5


def test_drop_path_is_identity_at_inference_and_drops_whole_samples():
    x = np.ones((4000, 3, 2), "float32")
    layer = layers.DropPath(0.25, seed=3)
    np.testing.assert_array_equal(to_numpy(layer(x)), x)
    out = to_numpy(layer(x, training=True))
    per_sample = out.reshape(4000, -1)
    # Each sample is either all dropped or all kept and rescaled by 1 / 0.75.
    assert np.all((per_sample == 0).all(1) | np.isclose(per_sample, 1 / 0.75).all(1))
    assert 0.2 < (per_sample == 0).all(1).mean() < 0.3
    assert_round_trip(layers.DropPath(0.1, seed=1), x[:2])
    with pytest.raises(ValueError, match="rate"):
        layers.DropPath(1.0)


def test_transformer_block_matches_numpy_composition():
    x = RNG.normal(size=(2, 6, 8)).astype("float32")
    block = layers.TransformerBlock(num_heads=2, mlp_dim=16, approximate_gelu=True)
    block(x)
    perturb(block)
    w = {name: to_numpy(v) for name, v in zip([v.path for v in block.weights], block.weights)}

    def get(suffix):
        (match,) = [value for path, value in w.items() if path.endswith(suffix)]
        return match

    h = np_layer_norm(x, get("norm1/gamma"), get("norm1/beta"))
    attn, _ = np_attention(
        h, get("qkv/kernel"), get("qkv/bias"), get("proj/kernel"), get("proj/bias"), 2
    )
    x1 = x + attn
    h = np_layer_norm(x1, get("norm2/gamma"), get("norm2/beta"))
    mlp = np_gelu(h @ get("fc1/kernel") + get("fc1/bias"), True) @ get("fc2/kernel") + get(
        "fc2/bias"
    )
    np.testing.assert_allclose(to_numpy(block(x)), x1 + mlp, rtol=1e-4, atol=1e-4)
    assert block.norm1.epsilon == 1e-6 and block.norm2.epsilon == 1e-6
    # The class-token-only path: the first row of the same composition.
    first = to_numpy(block(x, first_token_only=True))
    assert first.shape == (2, 1, 8)
    np.testing.assert_allclose(first, (x1 + mlp)[:, :1], rtol=1e-4, atol=1e-4)


def test_attention_num_queries_reads_every_key():
    x = RNG.normal(size=(2, 7, 12)).astype("float32")
    layer = layers.MultiHeadSelfAttention(num_heads=3)
    layer(x)
    perturb(layer)
    full = to_numpy(layer(x))
    for num_queries in (1, 3):
        part = to_numpy(layer(x, num_queries=num_queries))
        assert part.shape == (2, num_queries, 12)
        np.testing.assert_allclose(part, full[:, :num_queries], rtol=1e-5, atol=1e-5)
    # Changing a later token changes the first token's output: it is attended to.
    moved = x.copy()
    moved[:, -1] += 1.0
    assert not np.allclose(to_numpy(layer(moved, num_queries=1)), full[:, :1], atol=1e-3)


def test_transformer_block_round_trip_and_errors():
    assert_round_trip(
        layers.TransformerBlock(
            num_heads=2,
            mlp_dim=16,
            dropout_rate=0.1,
            attention_dropout_rate=0.1,
            drop_path_rate=0.2,
            approximate_gelu=True,
        ),
        RNG.normal(size=(1, 5, 8)).astype("float32"),
    )
    first_only = layers.TransformerBlock(num_heads=2, mlp_dim=16, first_token_only=True)
    assert first_only.compute_output_shape((None, 5, 8)) == (None, 1, 8)
    assert_round_trip(first_only, RNG.normal(size=(1, 5, 8)).astype("float32"))
    with pytest.raises(ValueError, match="mlp_dim"):
        layers.TransformerBlock(num_heads=2, mlp_dim=-1)
    with pytest.raises(ValueError, match="tokens, hidden_dim"):
        layers.TransformerBlock(num_heads=2, mlp_dim=8)(np.zeros((2, 8), "float32"))


def test_token_pooling():
    x = RNG.normal(size=(2, 5, 4)).astype("float32")
    np.testing.assert_allclose(to_numpy(layers.TokenPooling("token")(x)), x[:, 0])
    np.testing.assert_allclose(to_numpy(layers.TokenPooling("gap")(x)), x.mean(1), rtol=1e-6)
    assert_round_trip(layers.TokenPooling("gap"), x)
    with pytest.raises(ValueError, match="pooling.*'token', 'gap'.*Received: pooling='max'"):
        layers.TokenPooling("max")
