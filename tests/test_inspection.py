"""Attention maps, rollout, feature extraction and plots, checked against an
independent NumPy forward pass of a tiny ViT."""

import json
import math
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_vit

RNG = np.random.default_rng(7)


def np_layer_norm(x, gamma, beta):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6) * gamma + beta


def np_gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def np_forward(model, images):
    """Token outputs and attention weights of each block, in NumPy alone."""
    weights = {v.path: keras.ops.convert_to_numpy(v).astype("float64") for v in model.weights}

    def get(suffix):
        (value,) = [w for path, w in weights.items() if path.endswith(suffix)]
        return value

    kernel = get("patch_encoder/kernel")
    ph, pw, channels, dim = kernel.shape
    batch, height, width, _ = images.shape
    gh, gw = height // ph, width // pw
    patches = images.reshape(batch, gh, ph, gw, pw, channels).transpose(0, 1, 3, 2, 4, 5)
    x = patches.reshape(batch, gh * gw, -1) @ kernel.reshape(-1, dim) + get("patch_encoder/bias")
    encoder = model.get_layer("patch_encoder")
    if encoder.class_token:
        x = np.concatenate([np.repeat(get("patch_encoder/class_token"), batch, 0), x], 1)
    x = x + get("position_embedding")
    outputs, maps = [], []
    for i in range(len([layer for layer in model.layers if "transformer_block" in layer.name])):
        block = model.get_layer(f"transformer_block_{i}")
        heads, tokens = block.num_heads, x.shape[1]
        p = f"transformer_block_{i}/"
        h = np_layer_norm(x, get(p + "norm1/gamma"), get(p + "norm1/beta"))
        qkv = h @ get(p + "attention/qkv/kernel") + get(p + "attention/qkv/bias")
        q, k, v = (
            qkv[..., j * dim : (j + 1) * dim]
            .reshape(batch, tokens, heads, -1)
            .transpose(0, 2, 1, 3)
            for j in range(3)
        )
        logits = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dim // heads)
        attention = np.exp(logits - logits.max(-1, keepdims=True))
        attention /= attention.sum(-1, keepdims=True)
        maps.append(attention)
        mixed = (attention @ v).transpose(0, 2, 1, 3).reshape(batch, tokens, dim)
        x = x + mixed @ get(p + "attention/proj/kernel") + get(p + "attention/proj/bias")
        h = np_layer_norm(x, get(p + "norm2/gamma"), get(p + "norm2/beta"))
        h = np_gelu(h @ get(p + "mlp/fc1/kernel") + get(p + "mlp/fc1/bias"))
        x = x + h @ get(p + "mlp/fc2/kernel") + get(p + "mlp/fc2/bias")
        outputs.append(x)
    return outputs, maps


def perturbed_model(tiny_config, **overrides):
    model = keras_vit.VisionTransformer(**{**tiny_config, "num_layers": 3, **overrides})
    for weight in model.weights:
        weight.assign(RNG.normal(0, 0.3, weight.shape).astype("float32"))
    return model


@pytest.mark.parametrize("pooling", ["token", "gap"])
def test_attention_maps_equal_numpy_and_rows_sum_to_one(tiny_config, images, pooling):
    model = perturbed_model(tiny_config, pooling=pooling)
    maps = keras_vit.attention_maps(model, images, batch_size=1)
    _, expected = np_forward(model, images.astype("float64"))
    tokens = 17 if pooling == "token" else 16
    assert len(maps) == 3
    for got, want in zip(maps, expected):
        assert got.shape == (2, 2, tokens, tokens)
        np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_attention_maps_on_a_model_loaded_from_keras_file(tmp_path, tiny_config, images):
    model = perturbed_model(tiny_config)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path, safe_mode=True)
    for got, want in zip(keras_vit.attention_maps(loaded, images), np_forward(model, images)[1]):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_feature_extractor_equals_internal_activations(tiny_config, images):
    model = perturbed_model(tiny_config)
    expected, _ = np_forward(model, images.astype("float64"))
    extractor = keras_vit.feature_extractor(model, layers=[0, -1])
    first, last = (keras.ops.convert_to_numpy(o) for o in extractor(images))
    np.testing.assert_allclose(first, expected[0], atol=5e-5)
    np.testing.assert_allclose(last, expected[2], atol=5e-5)
    internal = keras.Model(model.input, model.get_layer("transformer_block_1").output)(images)
    single = keras_vit.feature_extractor(model, layers="transformer_block_1")(images)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(single), internal)
    grid = keras_vit.feature_extractor(model, layers=-1, patch_grid=True)(images)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(grid), expected[2][:, 1:].reshape(2, 4, 4, 32), atol=5e-5
    )
    assert extractor.layers[1] is model.layers[1]  # shared, not copied


def test_rollout_of_identity_attention_is_uniform():
    identity = np.broadcast_to(np.eye(16), (2, 3, 16, 16))
    np.testing.assert_allclose(keras_vit.attention_rollout([identity] * 4), 1 / 16, rtol=1e-6)
    with_class = np.broadcast_to(np.eye(17), (1, 3, 17, 17))
    rollout = keras_vit.attention_rollout([with_class] * 2)
    assert rollout.shape == (1, 4, 4)
    np.testing.assert_allclose(rollout, rollout.flat[0])


def test_rollout_follows_attention_to_one_patch():
    # Every token attends only to patch 5 (token 6): the class token's rollout peaks there.
    tokens = 17
    attention = np.zeros((1, 2, tokens, tokens))
    attention[..., 6] = 1.0
    rollout = keras_vit.attention_rollout([attention, attention], head_fusion="max")
    assert np.unravel_index(np.argmax(rollout[0]), (4, 4)) == (1, 1)
    np.testing.assert_allclose(
        rollout.sum(), 1 - 0.25, rtol=1e-6
    )  # the rest stays on the class token


def test_rollout_discard_keeps_rows_normalised_and_diagonal(tiny_config, images):
    model = perturbed_model(tiny_config)
    maps = keras_vit.attention_maps(model, images)
    plain = keras_vit.attention_rollout(maps)
    dropped = keras_vit.attention_rollout(maps, discard_ratio=0.9, head_fusion="min")
    assert dropped.shape == plain.shape == (2, 4, 4)
    assert np.all(dropped >= 0) and not np.allclose(dropped, plain)


def test_bad_inputs_get_clear_errors(tiny_config, images):
    model = perturbed_model(tiny_config)
    with pytest.raises(ValueError, match=r"images.shape=\(32, 32, 3\)"):
        keras_vit.attention_maps(model, images[0])
    with pytest.raises(ValueError, match="no TransformerBlock"):
        dense = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        keras_vit.attention_maps(dense, np.zeros((1, 4)))
    with pytest.raises(ValueError, match="out of range"):
        keras_vit.feature_extractor(model, layers=[5])
    with pytest.raises(ValueError, match="no block named"):
        keras_vit.feature_extractor(model, layers=["block_9"])
    maps = keras_vit.attention_maps(model, images)
    with pytest.raises(ValueError, match="head_fusion='median'"):
        keras_vit.attention_rollout(maps, head_fusion="median")
    with pytest.raises(ValueError, match="discard_ratio"):
        keras_vit.attention_rollout(maps, discard_ratio=1.0)


def test_mean_attention_distance_of_local_and_uniform_attention(tiny_config, images):
    model = perturbed_model(tiny_config, pooling="gap")
    local = np.broadcast_to(np.eye(16), (1, 2, 16, 16))
    np.testing.assert_allclose(keras_vit.mean_attention_distance(model, None, maps=[local]), 0.0)
    uniform = np.full((1, 2, 16, 16), 1 / 16)
    centres = (
        np.stack(np.meshgrid(np.arange(4), np.arange(4), indexing="ij"), -1).reshape(-1, 2) * 8
    )
    expected = np.linalg.norm(centres[:, None] - centres[None], axis=-1).mean()
    np.testing.assert_allclose(
        keras_vit.mean_attention_distance(model, None, maps=[uniform]), expected, rtol=1e-5
    )


def test_position_similarity_diagonal_and_plots(tmp_path, tiny_config, images):
    from PIL import Image

    model = perturbed_model(tiny_config)
    similarity = keras_vit.position_embedding_similarity(model)
    assert similarity.shape == (4, 4, 4, 4)
    np.testing.assert_allclose(
        [similarity[i, j, i, j] for i in range(4) for j in range(4)], 1, atol=1e-5
    )
    paths = [os.path.join(tmp_path, f"{name}.png") for name in ("pos", "distance", "overlay")]
    keras_vit.plot_position_embedding_similarity(model, path=paths[0])
    keras_vit.plot_mean_attention_distance(model, images, path=paths[1])
    rollout = keras_vit.attention_rollout(keras_vit.attention_maps(model, images))
    keras_vit.plot_attention(images[0], rollout[0], path=paths[2], title="class 3")
    for path in paths:
        with Image.open(path) as picture:
            assert picture.format == "PNG" and min(picture.size) > 100


def test_explain_command_writes_overlays(tmp_path, tiny_config):
    from PIL import Image

    model = perturbed_model(tiny_config)
    model.save(os.path.join(tmp_path, "model.keras"))
    with open(os.path.join(tmp_path, "classes.json"), "w") as handle:
        json.dump([f"c{i}" for i in range(10)], handle)
    image_path = os.path.join(tmp_path, "photo.png")
    Image.fromarray(RNG.integers(0, 255, (60, 45, 3), dtype=np.uint8)).save(image_path)
    out = os.path.join(tmp_path, "explained")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_vit",
            "explain",
            image_path,
            "--model",
            str(tmp_path),
            "--output",
            out,
            "--top-k",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(" c") >= 3
    with Image.open(os.path.join(out, "photo_attention.png")) as overlay:
        assert overlay.size == (45, 60)
    assert os.path.isfile(os.path.join(out, "photo_explain.png"))
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_vit",
            "explain",
            "nope.png",
            "--model",
            str(tmp_path),
            "--output",
            out,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 2 and "no such image file" in missing.stderr
    assert "Traceback" not in missing.stderr
