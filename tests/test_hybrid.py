"""The hybrid (ResNet-v2 stem + ViT): each piece and the whole model against an
independent NumPy forward written from the original's definition, parameter
counts, round trips, mixed precision, fit, checkpoint mapping and bad input."""

import math
import os

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import layers
from keras_vit.weights import resnet_mapping

RNG = np.random.default_rng(6)

# A tiny hybrid: 32x32 images -> root (32 channels, 8x8) -> two stages of one
# unit (bottleneck widths 32 and 64) -> a 4x4x256 map -> 16 tokens of 1x1 patches.
TINY_HYBRID = dict(
    image_size=32,
    patch_size=1,
    num_layers=2,
    num_heads=2,
    hidden_dim=32,
    mlp_dim=64,
    num_classes=10,
    resnet_layers=(1, 1),
    resnet_width=0.5,
    approximate_gelu=True,
)


def to_numpy(x):
    return keras.ops.convert_to_numpy(x)


# An independent NumPy forward, in float64, with the original's parameter names ---


def np_conv_same(x, kernel, stride):
    """TF/Flax SAME convolution: total padding p, p // 2 before, the rest after."""
    _, height, width, _ = x.shape
    kh, kw = kernel.shape[:2]
    out_h, out_w = math.ceil(height / stride), math.ceil(width / stride)
    pad_h = max((out_h - 1) * stride + kh - height, 0)
    pad_w = max((out_w - 1) * stride + kw - width, 0)
    x = np.pad(
        x, ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0))
    )
    out = 0.0
    for i in range(kh):
        for j in range(kw):
            window = x[
                :,
                i : i + (out_h - 1) * stride + 1 : stride,
                j : j + (out_w - 1) * stride + 1 : stride,
            ]
            out = out + window @ kernel[i, j]
    return out


def np_standardize(kernel, epsilon=1e-5):
    """vit_jax weight_standardize: w - mean, then / (population std + eps)."""
    centred = kernel - kernel.mean(axis=(0, 1, 2))
    return centred / (centred.std(axis=(0, 1, 2)) + epsilon)


def np_group_norm(x, scale, bias, groups=32, epsilon=1e-6):
    batch, height, width, channels = x.shape
    grouped = x.reshape(batch, height, width, groups, channels // groups)
    mean = grouped.mean(axis=(1, 2, 4), keepdims=True)
    var = grouped.var(axis=(1, 2, 4), keepdims=True)
    normed = ((grouped - mean) / np.sqrt(var + epsilon)).reshape(x.shape)
    return normed * scale.reshape(-1) + bias.reshape(-1)


def np_max_pool_same(x, size=3, stride=2):
    _, height, width, _ = x.shape
    out_h, out_w = math.ceil(height / stride), math.ceil(width / stride)
    pad_h = max((out_h - 1) * stride + size - height, 0)
    pad_w = max((out_w - 1) * stride + size - width, 0)
    pads = ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0))
    x = np.pad(x, pads, constant_values=-np.inf)
    out = np.full((x.shape[0], out_h, out_w, x.shape[3]), -np.inf)
    for i in range(size):
        for j in range(size):
            window = x[
                :,
                i : i + (out_h - 1) * stride + 1 : stride,
                j : j + (out_w - 1) * stride + 1 : stride,
            ]
            out = np.maximum(out, window)
    return out


def relu(x):
    return np.maximum(x, 0)


def np_std_conv(params, name, x, stride=1):
    return np_conv_same(x, np_standardize(params[f"{name}/kernel"]), stride)


def np_gn(params, name, x):
    return np_group_norm(x, params[f"{name}/scale"], params[f"{name}/bias"])


def np_unit(params, prefix, x, features, stride):
    """vit_jax ResidualUnit."""
    residual = x
    if x.shape[-1] != 4 * features or stride != 1:
        residual = np_gn(
            params, prefix + "gn_proj", np_std_conv(params, prefix + "conv_proj", x, stride)
        )
    y = relu(np_gn(params, prefix + "gn1", np_std_conv(params, prefix + "conv1", x)))
    y = relu(np_gn(params, prefix + "gn2", np_std_conv(params, prefix + "conv2", y, stride)))
    y = np_gn(params, prefix + "gn3", np_std_conv(params, prefix + "conv3", y))
    return relu(residual + y)


def np_stem(params, x, resnet_layers, width_factor):
    """vit_jax VisionTransformer's ResNet part: root, then ResNetStage per entry."""
    width = int(64 * width_factor)
    x = relu(np_gn(params, "gn_root", np_std_conv(params, "conv_root", x, 2)))
    x = np_max_pool_same(x)
    for index, block_size in enumerate(resnet_layers):
        for unit in range(block_size):
            stride = 2 if index > 0 and unit == 0 else 1
            x = np_unit(params, f"block{index + 1}/unit{unit + 1}/", x, width * 2**index, stride)
    return x


def np_layer_norm(params, name, x, epsilon=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + epsilon) * params[f"{name}/scale"] + params[f"{name}/bias"]


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def np_hybrid_vit(params, images, config):
    """The whole original hybrid ViT (linen names), classifier "token"."""
    x = np_stem(params, images.astype("float64"), config["resnet_layers"], config["resnet_width"])
    patch = config["patch_size"]
    kernel = params["embedding/kernel"]
    batch, height, width, _ = x.shape
    grid_h, grid_w = height // patch, width // patch
    x = x[:, : grid_h * patch, : grid_w * patch].reshape(batch, grid_h, patch, grid_w, patch, -1)
    x = np.einsum("bhpwqc,pqcd->bhwd", x, kernel) + params["embedding/bias"]
    x = x.reshape(batch, grid_h * grid_w, -1)
    x = np.concatenate([np.repeat(params["cls"], batch, axis=0), x], axis=1)
    x = x + params["Transformer/posembed_input/pos_embedding"]
    for index in range(config["num_layers"]):
        base = f"Transformer/encoderblock_{index}/"
        y = np_layer_norm(params, base + "LayerNorm_0", x)
        attention = base + "MultiHeadDotProductAttention_1/"
        q, k, v = (
            np.einsum("btd,dhk->bthk", y, params[f"{attention}{part}/kernel"])
            + params[f"{attention}{part}/bias"]
            for part in ("query", "key", "value")
        )
        logits = np.einsum("bqhk,bthk->bhqt", q / math.sqrt(q.shape[-1]), k)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights = weights / weights.sum(-1, keepdims=True)
        y = np.einsum("bhqt,bthk->bqhk", weights, v)
        y = (
            np.einsum("bqhk,hkd->bqd", y, params[f"{attention}out/kernel"])
            + params[f"{attention}out/bias"]
        )
        x = x + y
        y = np_layer_norm(params, base + "LayerNorm_2", x)
        y = (
            y @ params[base + "MlpBlock_3/Dense_0/kernel"]
            + params[base + "MlpBlock_3/Dense_0/bias"]
        )
        y = np_gelu_tanh(y)
        y = (
            y @ params[base + "MlpBlock_3/Dense_1/kernel"]
            + params[base + "MlpBlock_3/Dense_1/bias"]
        )
        x = x + y
    x = np_layer_norm(params, "Transformer/encoder_norm", x)
    return x[:, 0] @ params["head/kernel"] + params["head/bias"]


# Random weights in the original layout, drawn from the architecture alone ----


def random_stem_params(resnet_layers, width_factor, channels=3, group_norm_4d=False):
    """Original-layout ResNet weights; kernels with per-channel offsets so that
    the standardisation matters, GroupNorm parameters away from 1 and 0."""
    params = {}

    def conv(name, kh, kw, cin, cout):
        kernel = RNG.normal(0, 1, (kh, kw, cin, cout)) * RNG.uniform(0.5, 2, cout)
        params[f"{name}/kernel"] = kernel + RNG.normal(0, 1, cout)

    def gn(name, c):
        shape = (1, 1, 1, c) if group_norm_4d else (c,)
        params[f"{name}/scale"] = 1 + 0.3 * RNG.normal(size=shape)
        params[f"{name}/bias"] = 0.3 * RNG.normal(size=shape)

    width = int(64 * width_factor)
    conv("conv_root", 7, 7, channels, width)
    gn("gn_root", width)
    cin = width
    for index, block_size in enumerate(resnet_layers):
        features = width * 2**index
        for unit in range(block_size):
            base = f"block{index + 1}/unit{unit + 1}/"
            stride = 2 if index > 0 and unit == 0 else 1
            if cin != 4 * features or stride != 1:
                conv(base + "conv_proj", 1, 1, cin, 4 * features)
                gn(base + "gn_proj", 4 * features)
            conv(base + "conv1", 1, 1, cin, features)
            gn(base + "gn1", features)
            conv(base + "conv2", 3, 3, features, features)
            gn(base + "gn2", features)
            conv(base + "conv3", 1, 1, features, 4 * features)
            gn(base + "gn3", 4 * features)
            cin = 4 * features
    return {key: value.astype("float32") for key, value in params.items()}


def random_hybrid_params(config, num_tokens, feature_channels):
    """Original-layout (linen names) weights of a whole hybrid ViT."""
    params = random_stem_params(config["resnet_layers"], config["resnet_width"])
    dim, mlp, heads = config["hidden_dim"], config["mlp_dim"], config["num_heads"]
    patch = config["patch_size"]

    def dense(shape, fan_in):
        return RNG.normal(0, 1 / math.sqrt(fan_in), shape)

    params["embedding/kernel"] = dense((patch, patch, feature_channels, dim), feature_channels)
    params["embedding/bias"] = 0.1 * RNG.normal(size=dim)
    params["cls"] = 0.5 * RNG.normal(size=(1, 1, dim))
    params["Transformer/posembed_input/pos_embedding"] = 0.5 * RNG.normal(size=(1, num_tokens, dim))
    for index in range(config["num_layers"]):
        base = f"Transformer/encoderblock_{index}/"
        for norm in ("LayerNorm_0", "LayerNorm_2"):
            params[f"{base}{norm}/scale"] = 1 + 0.2 * RNG.normal(size=dim)
            params[f"{base}{norm}/bias"] = 0.2 * RNG.normal(size=dim)
        attention = base + "MultiHeadDotProductAttention_1/"
        for part in ("query", "key", "value"):
            params[f"{attention}{part}/kernel"] = dense((dim, heads, dim // heads), dim)
            params[f"{attention}{part}/bias"] = 0.1 * RNG.normal(size=(heads, dim // heads))
        params[f"{attention}out/kernel"] = dense((heads, dim // heads, dim), dim)
        params[f"{attention}out/bias"] = 0.1 * RNG.normal(size=dim)
        params[base + "MlpBlock_3/Dense_0/kernel"] = dense((dim, mlp), dim)
        params[base + "MlpBlock_3/Dense_0/bias"] = 0.1 * RNG.normal(size=mlp)
        params[base + "MlpBlock_3/Dense_1/kernel"] = dense((mlp, dim), mlp)
        params[base + "MlpBlock_3/Dense_1/bias"] = 0.1 * RNG.normal(size=dim)
    params["Transformer/encoder_norm/scale"] = 1 + 0.2 * RNG.normal(size=dim)
    params["Transformer/encoder_norm/bias"] = 0.2 * RNG.normal(size=dim)
    params["head/kernel"] = dense((dim, config["num_classes"]), dim)
    params["head/bias"] = 0.1 * RNG.normal(size=config["num_classes"])
    return {key: np.asarray(value, "float32") for key, value in params.items()}


def assign_stem(stem, params, prefix=""):
    pairs, used = resnet_mapping.map_resnet(stem, params, prefix=prefix or None)
    for variable, array, _ in pairs:
        variable.assign(array)
    return used


def assign_transformer(model, params):
    """Test-side assignment of the non-ResNet weights (original -> keras layout)."""
    encoder = model.get_layer("patch_encoder")
    encoder.kernel.assign(params["embedding/kernel"])
    encoder.bias.assign(params["embedding/bias"])
    encoder.cls_token.assign(params["cls"])
    encoder.position_embedding.assign(params["Transformer/posembed_input/pos_embedding"])
    index = 0
    while f"Transformer/encoderblock_{index}/LayerNorm_0/scale" in params:
        block = model.get_layer(f"transformer_block_{index}")
        base = f"Transformer/encoderblock_{index}/"
        attention = base + "MultiHeadDotProductAttention_1/"
        dim = block.attention.num_heads * block.attention.head_dim
        for norm, name in ((block.norm1, "LayerNorm_0"), (block.norm2, "LayerNorm_2")):
            norm.gamma.assign(params[f"{base}{name}/scale"])
            norm.beta.assign(params[f"{base}{name}/bias"])
        qkv = [
            params[f"{attention}{part}/kernel"].reshape(dim, dim)
            for part in ("query", "key", "value")
        ]
        block.attention.qkv.kernel.assign(np.concatenate(qkv, axis=1))
        qkv_bias = [
            params[f"{attention}{part}/bias"].reshape(dim) for part in ("query", "key", "value")
        ]
        block.attention.qkv.bias.assign(np.concatenate(qkv_bias))
        block.attention.proj.kernel.assign(params[f"{attention}out/kernel"].reshape(dim, dim))
        block.attention.proj.bias.assign(params[f"{attention}out/bias"])
        for dense, name in ((block.mlp.fc1, "Dense_0"), (block.mlp.fc2, "Dense_1")):
            dense.kernel.assign(params[f"{base}MlpBlock_3/{name}/kernel"])
            dense.bias.assign(params[f"{base}MlpBlock_3/{name}/bias"])
        index += 1
    norm = model.get_layer("encoder_norm")
    norm.gamma.assign(params["Transformer/encoder_norm/scale"])
    norm.beta.assign(params["Transformer/encoder_norm/bias"])
    model.get_layer("head").kernel.assign(params["head/kernel"])
    model.get_layer("head").bias.assign(params["head/bias"])


def stem_images(shape=(2, 32, 32, 3)):
    return RNG.uniform(-1, 1, size=shape).astype("float32")


# The pieces against NumPy ----------------------------------------------------


@pytest.mark.parametrize(
    "input_shape, kernel_size, strides",
    [
        ((2, 32, 32, 3), 7, 2),
        ((1, 15, 10, 8), 7, 2),
        ((2, 8, 8, 32), 3, 2),
        ((1, 7, 6, 16), 3, 1),
        ((2, 9, 8, 32), 1, 2),
    ],
)
def test_std_conv_matches_numpy(input_shape, kernel_size, strides):
    conv = layers.StdConv(12, kernel_size, strides=strides)
    x = RNG.normal(size=input_shape).astype("float32")
    conv.build(x.shape)
    kernel = RNG.normal(2.0, 3.0, conv.kernel.shape).astype("float32")
    conv.kernel.assign(kernel)
    expected = np_conv_same(x.astype("float64"), np_standardize(kernel.astype("float64")), strides)
    out = to_numpy(conv(x))
    assert out.shape == expected.shape == conv.compute_output_shape(input_shape)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    # The stored kernel is left as it is; the standardised one has mean 0, std ~1.
    np.testing.assert_array_equal(to_numpy(conv.kernel), kernel)
    standardized = to_numpy(conv.standardized_kernel())
    np.testing.assert_allclose(standardized.mean(axis=(0, 1, 2)), 0, atol=1e-5)
    np.testing.assert_allclose(standardized.std(axis=(0, 1, 2)), 1, atol=1e-4)


def test_std_conv_epsilon_is_added_to_the_standard_deviation():
    # A kernel with std 1e-5: (w - mean) / (std + 1e-5) gives std 0.5 exactly,
    # whereas / sqrt(var + 1e-5) would give about 3e-3.
    conv = layers.StdConv(1, (2, 1))
    conv.build((1, 2, 1, 1))
    conv.kernel.assign(np.array([1 - 1e-5, 1 + 1e-5], "float32").reshape(2, 1, 1, 1))
    kernel = to_numpy(conv.standardized_kernel()).reshape(-1)
    np.testing.assert_allclose(kernel, [-0.5, 0.5], rtol=2e-2)


def test_group_norm_matches_numpy():
    unit = layers.BottleneckUnit(32)
    x = RNG.normal(3.0, 2.0, size=(2, 5, 6, 128)).astype("float32")
    unit.build(x.shape)
    norm = unit.gn1
    assert (norm.groups, norm.epsilon) == (32, 1e-6)
    scale, bias = RNG.normal(1, 0.5, 32), RNG.normal(0, 0.5, 32)
    norm.gamma.assign(scale)
    norm.beta.assign(bias)
    y = RNG.normal(3.0, 2.0, size=(2, 5, 6, 32)).astype("float32")
    np.testing.assert_allclose(
        to_numpy(norm(y)), np_group_norm(y.astype("float64"), scale, bias), rtol=1e-4, atol=1e-4
    )


def test_group_norm_is_float32_exact_on_a_large_map():
    # A root-sized map with per-channel offsets: the statistics must not lose
    # precision in long float32 reductions (the original's stays within ~1e-6).
    norm = layers.GroupNorm(groups=32, epsilon=1e-6)
    x = (RNG.normal(0, 10, (1, 112, 112, 64)) + RNG.normal(0, 3, 64)).astype("float32")
    norm.build(x.shape)
    scale, bias = 1 + 0.3 * RNG.normal(size=64), 0.3 * RNG.normal(size=64)
    norm.gamma.assign(scale)
    norm.beta.assign(bias)
    expected = np_group_norm(x.astype("float64"), scale.astype("float32"), bias.astype("float32"))
    np.testing.assert_allclose(to_numpy(norm(x)), expected, rtol=0, atol=4e-6)


@pytest.mark.parametrize(
    "input_shape, filters, strides, projects",
    [((2, 8, 8, 128), 32, 1, False), ((2, 8, 8, 32), 32, 1, True), ((1, 7, 8, 128), 64, 2, True)],
)
def test_bottleneck_unit_matches_numpy(input_shape, filters, strides, projects):
    unit = layers.BottleneckUnit(filters, strides=strides)
    unit.build(input_shape)
    assert (unit.conv_proj is not None) == projects
    np.testing.assert_array_equal(to_numpy(unit.gn3.gamma), 0)  # scale_init zeros
    params = {}
    for variable, key in resnet_mapping._variables_and_keys_of_unit(unit):
        value = RNG.normal(0.5, 1.0, variable.shape).astype("float32")
        variable.assign(value)
        params[key] = value.astype("float64")
    x = RNG.normal(size=input_shape).astype("float32")
    expected = np_unit(params, "", x.astype("float64"), filters, strides)
    out = to_numpy(unit(x))
    assert out.shape == expected.shape == unit.compute_output_shape(input_shape)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "resnet_layers, width, image_shape",
    [((), 1, (2, 32, 32, 3)), ((1, 1), 0.5, (2, 32, 32, 3)), ((2, 1), 0.5, (1, 30, 22, 3))],
)
def test_stem_matches_numpy(resnet_layers, width, image_shape):
    stem = layers.ResNetStem(layers=resnet_layers, width=width)
    stem.build(image_shape)
    params = random_stem_params(resnet_layers, width)
    used = assign_stem(stem, params)
    assert used == set(params)
    images = stem_images(image_shape)
    expected = np_stem(
        {k: v.astype("float64") for k, v in params.items()},
        images.astype("float64"),
        resnet_layers,
        width,
    )
    out = to_numpy(stem(images))
    assert out.shape == expected.shape == stem.compute_output_shape(image_shape)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


# The whole hybrid against NumPy ----------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # stem with bottleneck stages, 1x1 patches
        {"resnet_layers": (), "resnet_width": 1, "patch_size": 2},  # root only, as R+ViT-Ti/16
    ],
)
def test_hybrid_logits_match_numpy(overrides):
    config = {**TINY_HYBRID, **overrides}
    model = keras_vit.VisionTransformer(**config)
    feature_shape = model.get_layer("resnet").output.shape
    num_tokens = model.get_layer("patch_encoder").position_embedding.shape[1]
    params = random_hybrid_params(config, num_tokens, feature_shape[-1])
    assign_stem(model.get_layer("resnet"), params)
    assign_transformer(model, params)
    images = stem_images()
    expected = np_hybrid_vit({k: v.astype("float64") for k, v in params.items()}, images, config)
    logits = to_numpy(model(images))
    assert np.abs(expected).max() > 0.5  # the check has teeth
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_r50_b16_parameter_count_and_feature_map():
    model = keras_vit.ViT_R50_B16()
    assert model.count_params() == 98_659_112
    assert model.get_layer("resnet").output.shape == (None, 14, 14, 1024)
    assert model.get_layer("patch_encoder").position_embedding.shape == (1, 197, 768)
    assert [len(stage.units) for stage in model.get_layer("resnet").stages] == [3, 4, 9]


def test_r50_b16_at_384_has_a_24x24_map():
    model = keras_vit.ViT_R50_B16(image_size=384, num_classes=0)
    assert model.get_layer("resnet").output.shape == (None, 24, 24, 1024)
    assert model.output_shape == (None, 768)


# Round trips, mixed precision, fit -------------------------------------------


@pytest.mark.parametrize(
    "layer, input_shape",
    [
        (lambda: layers.StdConv(8, (3, 5), strides=2, epsilon=1e-4), (2, 9, 9, 4)),
        (lambda: layers.GroupNorm(groups=4, epsilon=1e-5, gamma_initializer="zeros"), (2, 5, 6, 8)),
        (lambda: layers.BottleneckUnit(32, strides=2), (2, 8, 8, 64)),
        (lambda: layers.ResNetStage(2, 32, strides=1), (2, 8, 8, 32)),
        (lambda: layers.ResNetStem(layers=(1, 1), width=0.5), (2, 32, 32, 3)),
        (lambda: layers.ResNetStem(layers=(), width=1), (2, 16, 16, 3)),
    ],
)
def test_layer_round_trips(layer, input_shape):
    layer = layer()
    inputs = RNG.normal(size=input_shape).astype("float32")
    layer.build(input_shape)
    for weight in layer.weights:
        weight.assign(RNG.normal(0.3, 1.0, weight.shape))
    expected = to_numpy(layer(inputs))
    config = layer.get_config()
    clone = layer.__class__.from_config(config)
    assert clone.get_config() == config
    clone.build(input_shape)
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(to_numpy(clone(inputs)), expected, rtol=1e-6, atol=1e-6)
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(revived) is type(layer) and revived.get_config() == config


def test_hybrid_keras_file_round_trip_with_safe_mode(tmp_path):
    model = keras_vit.VisionTransformer(**TINY_HYBRID)
    for weight in model.weights:
        weight.assign(RNG.normal(0.2, 0.3, weight.shape))
    images = stem_images()
    path = os.path.join(tmp_path, "hybrid.keras")
    model.save(path)
    loaded = keras.models.load_model(path, safe_mode=True)
    np.testing.assert_array_equal(to_numpy(loaded(images)), to_numpy(model(images)))
    stem = loaded.get_layer("resnet")
    assert isinstance(stem, layers.ResNetStem) and stem.layers == (1, 1) and stem.width == 0.5
    assert len(loaded.weights) == len(model.weights)


def test_hybrid_mixed_bfloat16_forward_and_fit():
    model = keras_vit.VisionTransformer(**TINY_HYBRID, dtype="mixed_bfloat16")
    assert all(v.dtype == "float32" for v in model.weights)
    stem = model.get_layer("resnet")
    assert stem.conv_root.compute_dtype == "bfloat16"
    images = stem_images()
    features = keras.Model(model.input, stem.output)(images)
    assert keras.backend.standardize_dtype(features.dtype) == "bfloat16"
    logits = model(images)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    assert np.all(np.isfinite(to_numpy(logits)))
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(images, np.array([1, 2]), epochs=2, batch_size=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))


def test_hybrid_fit_trains_the_stem_through_the_standardisation():
    model = keras_vit.VisionTransformer(**TINY_HYBRID)
    # A non-zero head and gn3 scales (zero at init, as in the original, which
    # closes the residual branches), so that gradients reach all of the stem.
    model.get_layer("head").kernel.assign(RNG.normal(0, 0.5, (32, 10)))
    stem = model.get_layer("resnet")
    for stage in stem.stages:
        for unit in stage.units:
            unit.gn3.gamma.assign(np.ones(unit.gn3.gamma.shape))
    before = {v.path: to_numpy(v) for v in stem.weights}
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(stem_images(), np.array([3, 7]), epochs=1, batch_size=2, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    unchanged = [v.path for v in stem.weights if np.array_equal(to_numpy(v), before[v.path])]
    assert not unchanged, f"stem weights that received no update: {unchanged}"


# Checkpoint mapping ----------------------------------------------------------


@pytest.mark.parametrize("prefix, group_norm_4d", [("", False), ("", True), ("opt/target/", True)])
def test_map_resnet_reads_original_layout_npz(tmp_path, prefix, group_norm_4d):
    resnet_layers, width = (1, 2), 0.5
    params = random_stem_params(resnet_layers, width, group_norm_4d=group_norm_4d)
    path = os.path.join(tmp_path, "stem.npz")
    np.savez(
        path,
        **{prefix + key: value for key, value in params.items()},
        **{prefix + "Transformer/x": np.zeros(1)},
    )
    stem = layers.ResNetStem(layers=resnet_layers, width=width)
    stem.build((2, 32, 32, 3))
    with np.load(path, allow_pickle=False) as npz:
        pairs, used = resnet_mapping.map_resnet(stem, npz)
        for variable, array, _ in pairs:
            variable.assign(array)
    assert used == {prefix + key for key in params}
    assert len(pairs) == len(stem.weights)
    assert {id(variable) for variable, _, _ in pairs} == {id(v) for v in stem.weights}
    images = stem_images()
    expected = np_stem(
        {k: v.astype("float64") for k, v in params.items()},
        images.astype("float64"),
        resnet_layers,
        width,
    )
    np.testing.assert_allclose(to_numpy(stem(images)), expected, rtol=1e-4, atol=1e-4)


def test_resnet_params_is_the_inverse_of_map_resnet():
    stem = layers.ResNetStem(layers=(1, 1), width=0.5)
    stem.build((1, 32, 32, 3))
    params = random_stem_params((1, 1), 0.5)
    assign_stem(stem, params)
    written = resnet_mapping.resnet_params(stem)
    assert set(written) == set(params)
    for key, value in params.items():
        np.testing.assert_array_equal(written[key], value)


def test_map_resnet_errors_name_the_keys_and_shapes():
    stem = layers.ResNetStem(layers=(1, 1), width=0.5)
    stem.build((1, 32, 32, 3))
    params = random_stem_params((1, 1), 0.5)
    wrong = dict(params, **{"block2/unit1/conv2/kernel": np.zeros((3, 3, 64, 32), "float32")})
    with pytest.raises(
        ValueError, match=r"block2/unit1/conv2/kernel.*\(3, 3, 64, 32\).*\(3, 3, 64, 64\)"
    ):
        resnet_mapping.map_resnet(stem, wrong)
    missing = {k: v for k, v in params.items() if not k.startswith("block2/")}
    missing["block3/unit1/conv1/kernel"] = np.zeros((1, 1, 256, 128))
    with pytest.raises(
        ValueError,
        match=r"Missing: block2/unit1/conv1/kernel.*conv_proj/kernel.*Unused.*block3/unit1",
    ):
        resnet_mapping.map_resnet(stem, missing)
    with pytest.raises(ValueError, match="no key 'conv_root/kernel'"):
        resnet_mapping.map_resnet(stem, {"embedding/kernel": np.zeros((1,))})


def _write_hybrid_npz(path, config, num_tokens, feature_channels):
    params = random_hybrid_params(config, num_tokens, feature_channels)
    np.savez(path, **params)
    return params


def _require_loader():
    loader = getattr(keras_vit, "load_weights", None)
    if loader is None:
        pytest.skip("keras_vit.load_weights is not there yet (weights issue)")
    return loader


@pytest.mark.parametrize(
    "overrides", [{}, {"resnet_layers": (), "resnet_width": 1, "patch_size": 2}]
)
def test_load_weights_reads_an_original_hybrid_npz(tmp_path, overrides):
    load_weights = _require_loader()
    config = {**TINY_HYBRID, **overrides}
    model = keras_vit.VisionTransformer(**config)
    num_tokens = model.get_layer("patch_encoder").position_embedding.shape[1]
    path = os.path.join(tmp_path, "R-tiny.npz")
    params = _write_hybrid_npz(path, config, num_tokens, model.get_layer("resnet").output.shape[-1])
    load_weights(model, path)
    images = stem_images()
    expected = np_hybrid_vit({k: v.astype("float64") for k, v in params.items()}, images, config)
    np.testing.assert_allclose(to_numpy(model(images)), expected, rtol=1e-4, atol=1e-4)
    # Through the constructor argument as well.
    again = keras_vit.VisionTransformer(**config, weights=path)
    np.testing.assert_allclose(to_numpy(again(images)), expected, rtol=1e-4, atol=1e-4)


def test_load_weights_hybrid_at_a_new_resolution(tmp_path):
    load_weights = _require_loader()
    model = keras_vit.VisionTransformer(**TINY_HYBRID)
    path = os.path.join(tmp_path, "R-tiny.npz")
    params = _write_hybrid_npz(path, TINY_HYBRID, 17, 256)
    bigger = keras_vit.VisionTransformer(**{**TINY_HYBRID, "image_size": 48})
    load_weights(bigger, path)
    assert bigger.get_layer("resnet").output.shape == (None, 6, 6, 256)
    assert bigger.get_layer("patch_encoder").position_embedding.shape == (1, 37, 32)
    stem = bigger.get_layer("resnet")
    np.testing.assert_array_equal(to_numpy(stem.conv_root.kernel), params["conv_root/kernel"])
    np.testing.assert_array_equal(
        to_numpy(stem.stages[1].units[0].gn_proj.gamma), params["block2/unit1/gn_proj/scale"]
    )
    images = RNG.uniform(-1, 1, (1, 48, 48, 3)).astype("float32")
    assert np.all(np.isfinite(to_numpy(bigger(images))))
    del model


def test_load_weights_rejects_a_plain_checkpoint_for_a_hybrid(tmp_path):
    load_weights = _require_loader()
    model = keras_vit.VisionTransformer(**TINY_HYBRID)
    params = random_hybrid_params(TINY_HYBRID, 17, 256)
    params = {
        k: v for k, v in params.items() if not k.startswith(("conv_root", "gn_root", "block"))
    }
    path = os.path.join(tmp_path, "plain.npz")
    np.savez(path, **params)
    before = [to_numpy(v) for v in model.weights]
    with pytest.raises(ValueError, match="conv_root"):
        load_weights(model, path)
    for weight, value in zip(model.weights, before):
        np.testing.assert_array_equal(to_numpy(weight), value)


def test_docstring_examples_run():
    import doctest

    from keras_vit.layers import resnet

    result = doctest.testmod(resnet, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


# Bad input -------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"resnet_layers": (3, 0)}, r"resnet_layers.*Received: resnet_layers=\(3, 0\)"),
        ({"resnet_layers": 3}, r"resnet_layers.*Received: resnet_layers=3"),
        ({"resnet_layers": "349"}, r"resnet_layers.*Received: resnet_layers='349'"),
        ({"resnet_layers": (1, 2.5)}, r"resnet_layers.*Received: resnet_layers=\(1, 2.5\)"),
        ({"resnet_width": 0}, r"resnet_width.*multiple of 32.*Received: resnet_width=0"),
        ({"resnet_width": 0.75}, r"resnet_width.*Received: resnet_width=0.75"),
        ({"resnet_width": True}, r"resnet_width.*Received: resnet_width=True"),
        ({"resnet_width": "1"}, r"resnet_width.*Received: resnet_width='1'"),
        ({"patch_size": 3}, r"feature map.*\(4, 4\).*patch_size=\(3, 3\)"),
        ({"image_size": 24, "patch_size": 2}, r"feature map.*\(3, 3\).*image_size=\(24, 24\)"),
    ],
)
def test_bad_hybrid_arguments(overrides, message):
    with pytest.raises(ValueError, match=message):
        keras_vit.VisionTransformer(**{**TINY_HYBRID, **overrides})


def test_bad_layer_arguments():
    with pytest.raises(ValueError, match="filters.*multiple of 32.*Received: filters=48"):
        layers.BottleneckUnit(48)
    with pytest.raises(ValueError, match="filters.*Received: filters=0"):
        layers.StdConv(0, 3)
    with pytest.raises(ValueError, match="epsilon.*Received: epsilon=-1"):
        layers.StdConv(8, 3, epsilon=-1)
    with pytest.raises(ValueError, match="groups=32.*Received: input_shape=\\(2, 4, 4, 48\\)"):
        layers.GroupNorm(groups=32)(np.zeros((2, 4, 4, 48), "float32"))
    with pytest.raises(ValueError, match="groups.*Received: groups=0"):
        layers.GroupNorm(groups=0)
    with pytest.raises(ValueError, match="num_units.*Received: num_units=0"):
        layers.ResNetStage(0, 32)
    with pytest.raises(ValueError, match=r"width.*Received: width=0.1"):
        layers.ResNetStem(layers=(1,), width=0.1)
    with pytest.raises(ValueError, match=r"expects inputs of shape \(batch, height, width"):
        layers.ResNetStem(layers=())(np.zeros((2, 32, 3), "float32"))


def test_a_hybrid_of_any_image_size_knows_its_own_and_matches_the_fixed_one():
    fixed = keras_vit.VisionTransformer(**TINY_HYBRID)
    dynamic = keras_vit.VisionTransformer(**TINY_HYBRID, dynamic_image_size=True)
    assert dynamic.input_shape == (None, None, None, 3)
    assert keras_vit.models.model_image_size(dynamic) == (32, 32)  # its ResNet's stride is 8
    dynamic.set_weights(fixed.get_weights())
    images = stem_images()
    np.testing.assert_array_equal(to_numpy(dynamic(images)), to_numpy(fixed(images)))
    wide = to_numpy(dynamic(stem_images((1, 32, 64, 3))))  # a 4 x 8 map of patches
    assert wide.shape == (1, 10) and np.isfinite(wide).all()
    # Inspected at that size: 1 + 32 tokens; a grid step is 8 pixels of the image.
    maps = keras_vit.attention_maps(dynamic, stem_images((1, 32, 64, 3)))
    assert maps[0].shape == (1, TINY_HYBRID["num_heads"], 33, 33)
    assert keras_vit.attention_rollout(maps, grid_size=(4, 8)).shape == (1, 4, 8)
    with pytest.raises(ValueError, match=r"positive multiples of \(8, 8\)"):
        keras_vit.attention_maps(dynamic, stem_images((1, 32, 60, 3)))
