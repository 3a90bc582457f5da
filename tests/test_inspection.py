"""Attention maps, rollout, feature extraction and plots, checked against an
independent NumPy forward pass of a tiny ViT."""

import math
import os

import keras
import numpy as np
import pytest
from numpy_reference import np_gelu, np_layer_norm

import keras_vit

RNG = np.random.default_rng(7)


def np_forward(model, images, position_embedding=None):
    """Token outputs and attention weights of each block, in NumPy alone.

    `images` are the inputs of the patch encoder: the images themselves, or
    for a hybrid the stem's feature map. `position_embedding` replaces the
    model's (a dynamic model at another size uses a resized one).
    """
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
    x = x + (get("position_embedding") if position_embedding is None else position_embedding)
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
    np.testing.assert_allclose(rollout, 0.0)  # the class token keeps to itself
    uniform = np.full((1, 3, 17, 17), 1 / 17)
    rollout = keras_vit.attention_rollout([uniform] * 3)
    # Class row of ((U + I) / 2)^3: weight on any one patch is (1 - 0.5^3) / 17.
    np.testing.assert_allclose(rollout, (1 - 0.5**3) / 17, rtol=1e-6)


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
    dynamic = keras_vit.VisionTransformer(**tiny_config, dynamic_image_size=True)
    with pytest.raises(ValueError, match=r"positive multiples of \(8, 8\).*\(2, 30, 32, 3\)"):
        keras_vit.attention_maps(dynamic, np.zeros((2, 30, 32, 3)))
    with pytest.raises(ValueError, match=r"\(batch, height, width, 3\)"):
        keras_vit.attention_maps(dynamic, np.zeros((2, 32, 32, 4)))
    with pytest.raises(ValueError, match=r"patch_grid=True.*width // 8"):
        keras_vit.feature_extractor(dynamic, patch_grid=True)


def test_inspection_of_a_dynamic_model_at_other_sizes(tiny_config, images):
    dynamic = perturbed_model(tiny_config, dynamic_image_size=True)
    wide = RNG.uniform(-1, 1, (2, 24, 40, 3)).astype("float32")  # a 3 x 5 grid of patches
    embedding = keras.ops.convert_to_numpy(
        dynamic.get_layer("patch_encoder").position_embedding_for((3, 5))
    ).astype("float64")
    expected_outputs, expected_maps = np_forward(dynamic, wide.astype("float64"), embedding)
    maps = keras_vit.attention_maps(dynamic, wide, batch_size=1)
    assert [m.shape for m in maps] == [(2, 2, 16, 16)] * 3
    for got, want in zip(maps, expected_maps):
        np.testing.assert_allclose(got, want, atol=2e-5)
    features = keras_vit.feature_extractor(dynamic, layers=-1)(wide)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(features), expected_outputs[-1], atol=5e-5
    )
    # At its own size it is the fixed model.
    fixed = keras_vit.VisionTransformer(**{**tiny_config, "num_layers": 3})
    fixed.set_weights(dynamic.get_weights())
    for got, want in zip(
        keras_vit.attention_maps(dynamic, images), keras_vit.attention_maps(fixed, images)
    ):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert keras_vit.attention_rollout(maps, grid_size=(3, 5)).shape == (2, 3, 5)
    with pytest.raises(ValueError, match=r"grid_size=\(height // 8, width // 8\)"):
        keras_vit.attention_rollout(maps, grid_size=dynamic)
    own_size = keras_vit.attention_maps(dynamic, images)
    assert keras_vit.attention_rollout(own_size, grid_size=dynamic).shape == (2, 4, 4)
    # Uniform attention over a 3 x 5 grid of 8-pixel patches: the mean pairwise distance.
    uniform = np.full((1, 2, 16, 16), 1 / 16)
    centres = np.stack(np.meshgrid(np.arange(3), np.arange(5), indexing="ij"), -1).reshape(-1, 2)
    distance = np.linalg.norm(centres[:, None] - centres[None], axis=-1).mean() * 8
    np.testing.assert_allclose(
        keras_vit.mean_attention_distance(dynamic, wide, maps=[uniform]), distance, rtol=1e-5
    )
    assert keras_vit.mean_attention_distance(dynamic, wide).shape == (3, 2)
    square = keras_vit.mean_attention_distance(dynamic, None, maps=own_size)
    np.testing.assert_allclose(square, keras_vit.mean_attention_distance(fixed, images), rtol=1e-5)
    with pytest.raises(ValueError, match="pass `images`"):
        keras_vit.mean_attention_distance(dynamic, None, maps=[uniform])


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


def test_mean_attention_distance_when_all_attend_to_the_first_patch(tiny_config):
    model = perturbed_model(tiny_config)  # with a class token, which is left out
    maps = np.zeros((1, 2, 17, 17))
    maps[..., 0] = 0.5  # the class token takes half; renormalised away
    maps[..., 1] = 0.5  # patch (0, 0)
    rows, cols = np.divmod(np.arange(16), 4)
    expected = np.mean(np.hypot(rows * 8.0, cols * 8.0))
    got = keras_vit.mean_attention_distance(model, None, maps=[maps, maps])
    assert got.shape == (2, 2)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    with pytest.raises(ValueError, match="17, 17"):
        keras_vit.mean_attention_distance(model, None, maps=[maps[..., :16, :16]])


def torch_rollout(maps, discard_ratio, head_fusion):
    """The vit-explain rollout (jacobgil/vit-explain, vit_rollout.py), per image."""
    torch = pytest.importorskip("torch")
    results = []
    for b in range(maps[0].shape[0]):
        with torch.no_grad():
            result = torch.eye(maps[0].shape[-1], dtype=torch.float64)
            for attention in maps:
                attention = torch.tensor(attention[b : b + 1])
                fused = getattr(attention, head_fusion)(axis=1)
                fused = fused if head_fusion == "mean" else fused.values
                flat = fused.view(fused.size(0), -1)
                _, indices = flat.topk(int(flat.size(-1) * discard_ratio), -1, False)
                indices = indices[indices != 0]
                flat[0, indices] = 0
                identity = torch.eye(fused.size(-1), dtype=torch.float64)
                a = (fused + identity) / 2
                a = a / a.sum(dim=-1)[..., None]  # vit-explain divides by sum(dim=-1) too
                result = torch.matmul(a, result)
        results.append(result[0, 0, 1:].numpy())
    return np.stack(results)


@pytest.mark.parametrize(
    "discard_ratio, head_fusion", [(0.0, "mean"), (0.6, "max"), (0.9, "min"), (0.3, "mean")]
)
def test_rollout_equals_the_vit_explain_reference(tiny_config, images, discard_ratio, head_fusion):
    model = perturbed_model(tiny_config)
    maps = keras_vit.attention_maps(model, images)
    expected = torch_rollout(maps, discard_ratio, head_fusion)
    got = keras_vit.attention_rollout(maps, discard_ratio=discard_ratio, head_fusion=head_fusion)
    np.testing.assert_allclose(got.reshape(2, 16), expected, rtol=1e-5, atol=1e-7)


def test_rollout_discard_keeps_the_class_token_self_attention():
    # The class token's attention to itself is the lowest weight of the map, [1, 1] the next.
    attention = np.full((1, 1, 5, 5), 0.2)
    attention[0, 0, 0] = [0.05, 0.35, 0.2, 0.2, 0.2]
    attention[0, 0, 1] = [0.2, 0.06, 0.24, 0.25, 0.25]
    # discard_ratio 0.08 of 25 weights: the two lowest, of which [0, 0] is kept.
    got = keras_vit.attention_rollout([attention], discard_ratio=0.08, grid_size=(2, 2))
    row = np.array([0.05 + 1.0, 0.35, 0.2, 0.2, 0.2])  # + identity, [0, 0] not dropped
    np.testing.assert_allclose(got.ravel(), row[1:] / row.sum(), rtol=1e-6)
    np.testing.assert_allclose(got.ravel(), torch_rollout([attention], 0.08, "mean")[0], rtol=1e-6)


def test_rollout_of_non_square_grids(tiny_config):
    model = perturbed_model(tiny_config, image_size=(32, 48), pooling="gap")
    inputs = RNG.uniform(-1, 1, (1, 32, 48, 3)).astype("float32")
    maps = keras_vit.attention_maps(model, inputs)
    assert maps[0].shape == (1, 2, 24, 24)
    with pytest.raises(ValueError, match="Cannot infer a square patch grid"):
        keras_vit.attention_rollout(maps)
    by_model = keras_vit.attention_rollout(maps, grid_size=model)
    by_size = keras_vit.attention_rollout(maps, grid_size=(4, 6))
    assert by_model.shape == (1, 4, 6)
    np.testing.assert_array_equal(by_model, by_size)
    np.testing.assert_allclose(by_model.sum(), 1.0, rtol=1e-5)  # gap: mean of rows summing to 1
    with pytest.raises(ValueError, match=r"grid_size=\(5, 5\)"):
        keras_vit.attention_rollout(maps, grid_size=(5, 5))


def test_hybrid_maps_and_features_equal_numpy(tiny_config, images):
    model = perturbed_model(tiny_config, patch_size=1, resnet_layers=(), resnet_width=1)
    for weight in model.get_layer("resnet").weights:  # a tame stem, finite activations
        weight.assign(RNG.normal(0, 0.05, weight.shape).astype("float32"))
    features = keras.Model(model.input, model.get_layer("patch_encoder").input)(images)
    outputs, expected = np_forward(model, keras.ops.convert_to_numpy(features).astype("float64"))
    maps = keras_vit.attention_maps(model, images)
    tokens = 1 + model.get_layer("patch_encoder").grid_size[0] ** 2
    assert maps[0].shape == (2, 2, tokens, tokens)
    for got, want in zip(maps, expected):
        np.testing.assert_allclose(got, want, atol=2e-5)
    last = keras_vit.feature_extractor(model, layers=-1)(images)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(last), outputs[-1], atol=1e-4)


def test_maps_stay_exact_when_attention_uses_a_fused_kernel(monkeypatch, tiny_config, images):
    from keras_vit.layers import MultiHeadSelfAttention

    def fused_call(self, inputs, training=None, num_queries=None):  # never forms the weights
        # dot_product_attention takes (batch, tokens, heads, head_dim).
        query, key, value = (keras.ops.swapaxes(t, 1, 2) for t in self._split_heads(inputs))
        query = query if num_queries is None else query[:, :num_queries]
        x = keras.ops.dot_product_attention(query, key, value, scale=self.head_dim**-0.5)
        return self.proj(keras.ops.reshape(x, (-1, query.shape[1], self.hidden_dim)))

    model = perturbed_model(tiny_config)
    expected = np_forward(model, images.astype("float64"))[1]
    monkeypatch.setattr(MultiHeadSelfAttention, "call", fused_call)
    for got, want in zip(keras_vit.attention_maps(model, images), expected):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_feature_extractor_shares_weights_and_gives_gap_grids(tiny_config, images):
    model = perturbed_model(tiny_config, pooling="gap")
    extractor = keras_vit.feature_extractor(model, layers=[1], patch_grid=True)
    before = keras.ops.convert_to_numpy(extractor(images))  # Keras unwraps one output
    assert before.shape == (2, 4, 4, 32)  # gap: all 16 tokens are patches
    expected = np_forward(model, images.astype("float64"))[0][1].reshape(2, 4, 4, 32)
    np.testing.assert_allclose(before, expected, atol=5e-5)
    bias = model.get_layer("transformer_block_1").mlp.fc2.bias
    bias.assign(bias + 1.0)
    after = keras.ops.convert_to_numpy(extractor(images))
    np.testing.assert_allclose(after, before + 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="twice"):
        keras_vit.feature_extractor(model, layers=[0, "transformer_block_0"])


def test_docstring_examples_run():
    import doctest

    from keras_vit import inspection

    result = doctest.testmod(inspection)
    assert result.attempted >= 3 and result.failed == 0
