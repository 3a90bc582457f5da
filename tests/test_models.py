"""The model builder: parameter counts, pooling, heads, mixed precision,
initialisation, serialization, fit, and bad arguments."""

import contextlib
import os

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit.models import VARIANTS

# Parameter counts with a 1000-class head at 224, as published for the
# original checkpoints (DESIGN.md); ViT-S/32 as timm counts it
# (vit_small_patch32_224, 22,878,952), which DESIGN.md does not list.
PARAMETER_COUNTS = {
    "ViT_Ti16": 5_717_416,
    "ViT_S16": 22_050_664,
    "ViT_S32": 22_878_952,
    "ViT_B8": 86_576_872,
    "ViT_B16": 86_567_656,
    "ViT_B32": 88_224_232,
    "ViT_L16": 304_326_632,
    "ViT_L32": 306_535_400,
    "ViT_H14": 632_045_800,
    "ViT_R50_B16": 98_659_112,
}


def to_numpy(x):
    return keras.ops.convert_to_numpy(x)


def test_every_variant_has_a_parameter_count_check():
    constructors = {name for name in keras_vit.__all__ if name.startswith("ViT_")}
    assert set(VARIANTS) <= constructors
    missing = constructors - set(PARAMETER_COUNTS)
    assert not missing, f"variants without a parameter-count check: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_parameter_count_equals_the_original(name):
    if not hasattr(keras_vit, name):
        pytest.fail(f"keras_vit.{name} is missing")
    model = getattr(keras_vit, name)()
    assert model.count_params() == PARAMETER_COUNTS[name]


def test_forward_shapes_token_and_gap(tiny_config, images):
    model = keras_vit.VisionTransformer(**tiny_config)
    assert model.get_layer("patch_encoder").output.shape == (None, 17, 32)
    assert model(images).shape == (2, 10)
    gap = keras_vit.VisionTransformer(**{**tiny_config, "pooling": "gap"})
    assert gap.get_layer("patch_encoder").output.shape == (None, 16, 32)
    assert not gap.get_layer("patch_encoder").class_token
    assert gap(images).shape == (2, 10)


def test_only_the_last_block_of_a_class_token_model_skips_patch_tokens(tiny_config, images):
    model = keras_vit.VisionTransformer(**tiny_config)
    last = tiny_config["num_layers"] - 1
    flags = [model.get_layer(f"transformer_block_{i}").first_token_only for i in range(last + 1)]
    assert flags == [False] * last + [True]
    assert model.get_layer(f"transformer_block_{last}").output.shape == (None, 1, 32)
    for layer in model.layers:  # non-zero head and class token, so that the logits vary
        for weight in layer.weights:
            weight.assign(np.random.default_rng(2).normal(0, 0.2, weight.shape).astype("float32"))
    # The same layers composed by hand, every block on every token.
    x = model.get_layer("patch_encoder")(images)
    for index in range(last + 1):
        x = model.get_layer(f"transformer_block_{index}")(x, first_token_only=False)
    assert x.shape == (2, 17, 32)
    for name in ("encoder_norm", "pooling", "head"):
        x = model.get_layer(name)(x)
    expected = to_numpy(x)
    assert np.abs(expected).max() > 1e-2
    np.testing.assert_allclose(to_numpy(model(images)), expected, rtol=1e-5, atol=1e-5)
    gap = keras_vit.VisionTransformer(**{**tiny_config, "pooling": "gap"})
    assert not gap.get_layer(f"transformer_block_{last}").first_token_only


def test_gap_is_layer_norm_then_mean_of_all_tokens(tiny_config, images):
    model = keras_vit.VisionTransformer(**{**tiny_config, "pooling": "gap", "num_classes": 0})
    normed = keras.Model(model.input, model.get_layer("encoder_norm").output)(images)
    np.testing.assert_allclose(
        to_numpy(model(images)), to_numpy(normed).mean(axis=1), rtol=1e-5, atol=1e-6
    )


def test_features_pre_logits_and_activation(tiny_config, images):
    features = keras_vit.VisionTransformer(**{**tiny_config, "num_classes": 0})
    assert features.output_shape == (None, 32)
    assert "head" not in [layer.name for layer in features.layers]
    rep = keras_vit.VisionTransformer(**{**tiny_config, "representation_size": 24})
    assert rep.get_layer("pre_logits").kernel.shape == (32, 24)
    assert rep.get_layer("pre_logits").activation is keras.activations.tanh
    probs = keras_vit.VisionTransformer(**{**tiny_config, "classifier_activation": "softmax"})
    probs.get_layer("head").kernel.assign(np.random.default_rng(0).normal(size=(32, 10)))
    np.testing.assert_allclose(to_numpy(probs(images)).sum(-1), 1.0, atol=1e-5)


def test_non_square_images_and_patches(images):
    model = keras_vit.VisionTransformer(
        image_size=(32, 48),
        patch_size=(8, 16),
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        num_classes=3,
    )
    assert model.get_layer("patch_encoder").grid_size == (4, 3)
    assert model(np.zeros((1, 32, 48, 3), "float32")).shape == (1, 3)


def test_initialisation_is_the_originals(tiny_config):
    model = keras_vit.VisionTransformer(**tiny_config)
    np.testing.assert_array_equal(to_numpy(model.get_layer("head").kernel), 0.0)
    np.testing.assert_array_equal(to_numpy(model.get_layer("head").bias), 0.0)
    encoder = model.get_layer("patch_encoder")
    np.testing.assert_array_equal(to_numpy(encoder.cls_token), 0.0)
    block = model.get_layer("transformer_block_0")
    np.testing.assert_array_equal(to_numpy(block.norm1.gamma), 1.0)
    assert 0 < np.abs(to_numpy(block.mlp.fc1.bias)).max() < 1e-5


def test_drop_path_rate_grows_linearly_over_blocks(tiny_config):
    model = keras_vit.VisionTransformer(**{**tiny_config, "num_layers": 3, "drop_path_rate": 0.2})
    rates = [model.get_layer(f"transformer_block_{i}").drop_path_rate for i in range(3)]
    np.testing.assert_allclose(rates, [0.0, 0.1, 0.2])


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_end_to_end(tiny_config, images, policy):
    model = keras_vit.VisionTransformer(**tiny_config, dtype=policy)
    assert all(v.dtype == "float32" for v in model.weights)
    block = model.get_layer("transformer_block_0")
    assert block.attention.compute_dtype == policy.split("_")[1]
    tokens = keras.ops.cast(keras.ops.ones((2, 17, 32)), block.compute_dtype)
    assert (
        keras.backend.standardize_dtype(block.attention.attention_weights(tokens).dtype)
        == "float32"
    )
    logits = model(images)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    optimizer = keras.optimizers.AdamW(1e-3)
    if policy == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    model.compile(
        optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    history = model.fit(images, np.array([1, 2]), epochs=2, batch_size=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))


def test_keras_file_round_trip_with_safe_mode(tmp_path, tiny_config, images):
    model = keras_vit.VisionTransformer(
        **{
            **tiny_config,
            "representation_size": 16,
            "drop_path_rate": 0.1,
            "approximate_gelu": True,
        }
    )
    rng = np.random.default_rng(0)
    for weight in model.weights:
        weight.assign(rng.normal(0, 0.2, weight.shape))
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path, safe_mode=True)
    np.testing.assert_array_equal(to_numpy(loaded(images)), to_numpy(model(images)))
    assert not any(isinstance(layer, keras.layers.Lambda) for layer in loaded.layers)
    assert loaded.get_layer("transformer_block_1").approximate_gelu


def test_fit_on_tf_data_reduces_loss(tiny_config):
    # A learnable task: the class is the image quadrant that holds a bright square.
    rng = np.random.default_rng(0)
    num = 128
    labels = rng.integers(0, 4, size=num)
    images = rng.normal(0, 0.1, size=(num, 32, 32, 3)).astype("float32")
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 2)
        images[i, row * 16 : row * 16 + 16, col * 16 : col * 16 + 16] += 1.0
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(num, seed=0).batch(16)
    model = keras_vit.VisionTransformer(**{**tiny_config, "num_classes": 4})
    model.compile(
        optimizer=keras.optimizers.AdamW(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(dataset, epochs=6, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.5 * losses[0], losses


def test_graph_mode_fit_with_the_per_head_core_matches_the_batched_core(
    tiny_config, per_head_calls
):
    """The per-head attention core (long sequences on CPUs: TensorFlow's graph
    mode, compiled JAX) trains the same."""
    from keras_vit.layers.attention import batched_core_only

    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, size=(12, 32, 32, 3)).astype("float32")
    labels = rng.integers(0, 10, size=12)
    results = []
    for batched in (True, False):
        keras.utils.set_random_seed(1)
        model = keras_vit.VisionTransformer(**tiny_config)
        model.compile(
            optimizer=keras.optimizers.AdamW(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=keras.backend.backend() == "jax",
        )
        with batched_core_only() if batched else contextlib.nullcontext():
            history = model.fit(images, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)
            logits = model.predict(images, batch_size=5, verbose=0)
        results.append((history.history["loss"], model.get_weights(), logits))
        assert bool(per_head_calls) is not batched
    (loss_a, weights_a, logits_a), (loss_b, weights_b, logits_b) = results
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
    for a, b in zip(weights_a, weights_b, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(logits_a, logits_b, rtol=1e-4, atol=1e-5)


# Bad arguments: each names the argument and what it received. ----------------

BAD_ARGUMENTS = [
    (dict(image_size=30), ValueError, r"image_size.*divisible by `patch_size`.*\(30, 30\)"),
    (dict(hidden_dim=30, num_heads=4), ValueError, "hidden_dim=30, num_heads=4"),
    (dict(num_layers=0), ValueError, "num_layers=0"),
    (dict(num_heads=-2), ValueError, "num_heads=-2"),
    (dict(hidden_dim=0), ValueError, "hidden_dim=0"),
    (dict(mlp_dim=0), ValueError, "mlp_dim=0"),
    (dict(image_size=-32), ValueError, "image_size=-32"),
    (dict(patch_size=0), ValueError, "patch_size=0"),
    (dict(num_classes=-1), ValueError, "num_classes=-1"),
    (dict(representation_size=0), ValueError, "representation_size=0"),
    (dict(pooling="mean"), ValueError, "pooling='mean'"),
    (dict(dropout_rate=1.0), ValueError, "dropout_rate=1.0"),
    (dict(drop_path_rate=-0.1), ValueError, "drop_path_rate=-0.1"),
    (dict(classifier_activation="nope"), ValueError, "nope"),
    (dict(weights="no-such-checkpoint"), ValueError, "weights='no-such-checkpoint'"),
    (dict(weights=3), TypeError, "weights=3"),
    (dict(dynamic_image_size="yes"), ValueError, "dynamic_image_size='yes'"),
]


@pytest.mark.parametrize("override, error, message", BAD_ARGUMENTS)
def test_bad_arguments_raise_clear_errors(tiny_config, override, error, message):
    with pytest.raises(error, match=message):
        keras_vit.VisionTransformer(**{**tiny_config, **override})


def test_bad_arguments_of_the_constructors():
    with pytest.raises(ValueError, match="pooling='avg'"):
        keras_vit.ViT_Ti16(pooling="avg")
    with pytest.raises(ValueError, match=r"divisible by `patch_size`.*\(225, 225\)"):
        keras_vit.ViT_B16(image_size=225)
    with pytest.raises(ValueError, match="weights='imagenet'"):
        keras_vit.ViT_B16(weights="imagenet")


def test_bad_images_at_call_time(tiny_config):
    model = keras_vit.VisionTransformer(**tiny_config)
    with pytest.raises(ValueError, match=r"3|channels"):
        model(np.zeros((1, 32, 32, 1), "float32"))
    with pytest.raises(ValueError, match=r"rank|shape"):
        model(np.zeros((32, 32, 3), "float32"))
    with pytest.raises(ValueError, match=r"shape|built for"):
        model(np.zeros((1, 48, 48, 3), "float32"))
    dynamic = keras_vit.VisionTransformer(**tiny_config, dynamic_image_size=True)
    with pytest.raises(ValueError, match=r"multiple of the patch size.*\(30, 32\)"):
        dynamic(np.zeros((1, 30, 32, 3), "float32"))
    with pytest.raises(ValueError, match=r"3|channels"):
        dynamic(np.zeros((1, 32, 32, 1), "float32"))


def test_dynamic_image_size_takes_any_size_and_saves(tmp_path, tiny_config, images):
    """Fixed and dynamic models share their weights; timm's goldens are in test_weights.py."""
    fixed = keras_vit.VisionTransformer(**tiny_config)
    dynamic = keras_vit.VisionTransformer(**tiny_config, dynamic_image_size=True)
    assert dynamic.input_shape == (None, None, None, 3)
    rng = np.random.default_rng(0)
    for weight in fixed.weights:
        weight.assign(rng.normal(0, 0.2, weight.shape))
    dynamic.set_weights(fixed.get_weights())  # the same variables, the same shapes
    # At the size it was built for, the position embedding is used as it is.
    np.testing.assert_array_equal(to_numpy(dynamic(images)), to_numpy(fixed(images)))
    other = rng.uniform(-1, 1, (2, 48, 24, 3)).astype("float32")
    outputs = to_numpy(dynamic(other))
    assert outputs.shape == (2, tiny_config["num_classes"]) and np.isfinite(outputs).all()
    assert keras_vit.models.model_image_size(dynamic) == (32, 32)  # the size it was built for
    free = keras.Sequential([keras.Input((None, None, 3)), keras.layers.Conv2D(2, 3)])
    with pytest.raises(ValueError, match="no single PatchEncoder"):
        keras_vit.models.model_image_size(free)
    path = os.path.join(tmp_path, "dynamic.keras")
    dynamic.save(path)
    loaded = keras.models.load_model(path, safe_mode=True)
    assert loaded.input_shape == (None, None, None, 3)
    np.testing.assert_allclose(to_numpy(loaded(other)), outputs, rtol=1e-5, atol=1e-6)
    # Training on batches of two sizes, through Keras' compiled train function,
    # without and with XLA.
    labels = keras.utils.to_categorical([0, 1], tiny_config["num_classes"])
    for jit_compile in (False, True):
        dynamic.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss="categorical_crossentropy",
            jit_compile=jit_compile,
        )
        for batch in (images, other, images):
            assert np.isfinite(dynamic.train_on_batch(batch, labels))


def test_preprocess_inputs_maps_uint8_to_unit_range():
    out = to_numpy(keras_vit.preprocess_inputs(np.array([[0, 127, 255]], "uint8")))
    np.testing.assert_allclose(out, [[-1.0, 127 / 127.5 - 1, 1.0]], atol=1e-6)
    assert out.dtype == np.float32


def test_remat_on_jax_cpu_recomputes_in_the_backward_pass():
    # jax.checkpoint alone (keras.remat on JAX) lets the CPU's XLA scheduler
    # recompute during the forward pass, and the compiled step keeps as much as
    # without remat. keras_vit ties the recomputation to the output's gradient:
    # XLA's temporary buffer must drop under half of the plain step's, with the
    # same gradients, and with dropout the same masks and seeds.
    if not keras_vit._cpu.jax_on_cpu():
        pytest.skip("JAX on the CPU")
    import jax

    images = np.random.default_rng(0).uniform(-1, 1, (8, 64, 64, 3)).astype("float32")
    labels = np.arange(8, dtype="int32")

    def compiled(remat, dropout_rate=0.0):
        keras.utils.set_random_seed(0)
        model = keras_vit.VisionTransformer(
            image_size=64, patch_size=8, num_layers=8, num_heads=2, hidden_dim=64,
            mlp_dim=256, num_classes=10, remat=remat, dropout_rate=dropout_rate,
        )  # fmt: skip
        head = model.get_layer("head").kernel
        head.assign(np.random.default_rng(1).normal(0, 0.05, head.shape))  # not zero: gradients
        state = [v.value for v in model.non_trainable_variables]
        initial = [np.array(v) for v in state]

        def loss(weights, state):
            logits, state = model.stateless_call(weights, state, images, training=True)
            return keras.losses.sparse_categorical_crossentropy(labels, logits, True).mean(), state

        weights = [v.value for v in model.trainable_variables]
        step = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(weights, state).compile()
        (value, state), grads = step(weights, state)
        return step.memory_analysis().temp_size_in_bytes, float(value), grads, state, initial

    plain, remat = compiled(False), compiled(True)
    assert remat[0] < 0.5 * plain[0], (remat[0], plain[0])
    np.testing.assert_allclose(remat[1], plain[1], rtol=1e-6)
    for g, e in zip(remat[2], plain[2]):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * float(abs(e).max()))
    plain, remat = compiled(False, dropout_rate=0.1), compiled(True, dropout_rate=0.1)
    assert remat[1] == plain[1]  # the same masks
    for g, e in zip(remat[2], plain[2]):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * float(abs(e).max()))
    for s, e in zip(remat[3], plain[3]):  # the seeds advance alike
        np.testing.assert_array_equal(s, e)
    assert any(np.any(np.asarray(s) != e) for s, e in zip(remat[3], remat[4]))

    # Frozen blocks (fine-tuning the head): fit trains with them recomputed and
    # leaves their weights as they were.
    model = keras_vit.VisionTransformer(
        image_size=64, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64,
        mlp_dim=256, num_classes=10, remat=True,
    )  # fmt: skip
    blocks = [model.get_layer(f"transformer_block_{i}") for i in range(2)]
    for block in blocks:
        block.trainable = False
    frozen = [np.array(v) for block in blocks for v in block.weights]
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
    history = model.fit(images, labels, epochs=2, batch_size=4, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    for before, v in zip(frozen, [v for block in blocks for v in block.weights]):
        np.testing.assert_array_equal(before, np.array(v))
    assert np.any(np.array(model.get_layer("head").kernel) != 0)
