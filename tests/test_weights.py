"""Checkpoint loading: parity with timm goldens, the original npz layout, strictness."""

import functools
import http.server
import logging
import os
import threading

import keras
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import keras_vit
from keras_vit import weights as weights_module
from keras_vit.weights import infer_config, load_weights, resize_position_embedding

DATA = os.path.join(os.path.dirname(__file__), "data")
HEADS = 4
TOLERANCE = 1e-4


def fixture(name):
    state = load_file(os.path.join(DATA, f"timm_{name}.safetensors"))
    inputs = np.load(os.path.join(DATA, f"timm_{name}_inputs.npy"))
    logits = np.load(os.path.join(DATA, f"timm_{name}_logits.npy"))
    return os.path.join(DATA, f"timm_{name}.safetensors"), state, inputs, logits


def tiny_model(name, **overrides):
    path = os.path.join(DATA, f"timm_{name}.safetensors")
    size = (32, 48) if name == "nonsquare" else None
    config = infer_config(path, num_heads=HEADS, image_size=size)
    config.update(overrides)
    return keras_vit.VisionTransformer(**config)


def predict(model, inputs):
    return keras.ops.convert_to_numpy(model(inputs, training=False))


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64"))))


# Writers of the other layouts, from the timm state dict (independent of keras_vit).


def timm_to_original(state, heads=HEADS, linen=False, prefix=""):
    names = (
        ("LayerNorm_0", "MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0")
        if linen
        else ("LayerNorm_0", "MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")
    )
    norm1, attention, norm2, mlp = names
    out = {
        "embedding/kernel": state["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
        "embedding/bias": state["patch_embed.proj.bias"],
        "Transformer/posembed_input/pos_embedding": state["pos_embed"],
        "Transformer/encoder_norm/scale": state["norm.weight"],
        "Transformer/encoder_norm/bias": state["norm.bias"],
    }
    if "cls_token" in state:
        out["cls"] = state["cls_token"]
    if "head.weight" in state:
        out["head/kernel"] = state["head.weight"].T
        out["head/bias"] = state["head.bias"]
    depth = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    for i in range(depth):
        b, t = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        dim = state[t + "norm1.weight"].shape[0]
        head_dim = dim // heads
        for ours, theirs in ((norm1, "norm1"), (norm2, "norm2")):
            out[f"{b}{ours}/scale"] = state[f"{t}{theirs}.weight"]
            out[f"{b}{ours}/bias"] = state[f"{t}{theirs}.bias"]
        qkv_w, qkv_b = state[t + "attn.qkv.weight"], state[t + "attn.qkv.bias"]
        for index, part in enumerate(("query", "key", "value")):
            rows = slice(index * dim, (index + 1) * dim)
            out[f"{b}{attention}/{part}/kernel"] = qkv_w[rows].T.reshape(dim, heads, head_dim)
            out[f"{b}{attention}/{part}/bias"] = qkv_b[rows].reshape(heads, head_dim)
        out[f"{b}{attention}/out/kernel"] = state[t + "attn.proj.weight"].T.reshape(
            heads, head_dim, dim
        )
        out[f"{b}{attention}/out/bias"] = state[t + "attn.proj.bias"]
        for ours, theirs in (("Dense_0", "fc1"), ("Dense_1", "fc2")):
            out[f"{b}{mlp}/{ours}/kernel"] = state[f"{t}mlp.{theirs}.weight"].T
            out[f"{b}{mlp}/{ours}/bias"] = state[f"{t}mlp.{theirs}.bias"]
    return {prefix + k: np.ascontiguousarray(v) for k, v in out.items()}


def timm_to_hf(state):
    out = {
        "vit.embeddings.cls_token": state["cls_token"],
        "vit.embeddings.position_embeddings": state["pos_embed"],
        "vit.embeddings.patch_embeddings.projection.weight": state["patch_embed.proj.weight"],
        "vit.embeddings.patch_embeddings.projection.bias": state["patch_embed.proj.bias"],
        "vit.layernorm.weight": state["norm.weight"],
        "vit.layernorm.bias": state["norm.bias"],
        "classifier.weight": state["head.weight"],
        "classifier.bias": state["head.bias"],
    }
    depth = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    for i in range(depth):
        h, t = f"vit.encoder.layer.{i}.", f"blocks.{i}."
        dim = state[t + "norm1.weight"].shape[0]
        for p in ("weight", "bias"):
            out[f"{h}layernorm_before.{p}"] = state[f"{t}norm1.{p}"]
            out[f"{h}layernorm_after.{p}"] = state[f"{t}norm2.{p}"]
            out[f"{h}attention.output.dense.{p}"] = state[f"{t}attn.proj.{p}"]
            out[f"{h}intermediate.dense.{p}"] = state[f"{t}mlp.fc1.{p}"]
            out[f"{h}output.dense.{p}"] = state[f"{t}mlp.fc2.{p}"]
            for index, part in enumerate(("query", "key", "value")):
                out[f"{h}attention.attention.{part}.{p}"] = state[f"{t}attn.qkv.{p}"][
                    index * dim : (index + 1) * dim
                ]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# An independent NumPy forward pass of the original layout, tanh GELU.


def np_layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-6) * scale + bias


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def np_original_forward(params, images, pooling="token"):
    p = {k: v.astype("float64") for k, v in params.items()}
    kernel = p["embedding/kernel"]
    ph, pw, c, d = kernel.shape
    b, height, width, _ = images.shape
    x = images.astype("float64").reshape(b, height // ph, ph, width // pw, pw, c)
    x = x.transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, ph * pw * c)
    x = x @ kernel.reshape(-1, d) + p["embedding/bias"]
    if pooling == "token":
        x = np.concatenate([np.broadcast_to(p["cls"], (b, 1, d)), x], axis=1)
    x = x + p["Transformer/posembed_input/pos_embedding"]
    i = 0
    while f"Transformer/encoderblock_{i}/LayerNorm_0/scale" in p:
        base = f"Transformer/encoderblock_{i}/"
        a = base + "MultiHeadDotProductAttention_1/"
        y = np_layer_norm(x, p[base + "LayerNorm_0/scale"], p[base + "LayerNorm_0/bias"])
        q, k, v = (
            np.einsum("btd,dhk->bthk", y, p[a + n + "/kernel"]) + p[a + n + "/bias"]
            for n in ("query", "key", "value")
        )
        logits = np.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(q.shape[-1])
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        y = np.einsum("bhqt,bthk->bqhk", weights, v)
        x = x + np.einsum("bqhk,hkd->bqd", y, p[a + "out/kernel"]) + p[a + "out/bias"]
        y = np_layer_norm(x, p[base + "LayerNorm_2/scale"], p[base + "LayerNorm_2/bias"])
        m = base + "MlpBlock_3/"
        y = np_gelu_tanh(y @ p[m + "Dense_0/kernel"] + p[m + "Dense_0/bias"])
        x = x + y @ p[m + "Dense_1/kernel"] + p[m + "Dense_1/bias"]
        i += 1
    x = np_layer_norm(x, p["Transformer/encoder_norm/scale"], p["Transformer/encoder_norm/bias"])
    x = x[:, 0] if pooling == "token" else x.mean(1)
    if "pre_logits/kernel" in p:
        x = np.tanh(x @ p["pre_logits/kernel"] + p["pre_logits/bias"])
    return x @ p["head/kernel"] + p["head/bias"]


# Parity with timm -------------------------------------------------------------


@pytest.mark.parametrize("name", ["square", "nonsquare", "gap", "classes7"])
def test_timm_safetensors_matches_timm_logits(name):
    path, _, inputs, logits = fixture(name)
    model = tiny_model(name)
    report = load_weights(model, path)
    assert report == {"format": "timm", "resized": None, "head": "loaded", "pre_logits": "absent"}
    assert max_diff(predict(model, inputs), logits) <= TOLERANCE


@pytest.mark.parametrize(
    "name, linen, prefix",
    [
        ("square", False, ""),
        ("nonsquare", True, ""),
        ("gap", False, "params/"),
        ("classes7", True, "params/"),
    ],
)
def test_original_npz_matches_timm_logits(tmp_path, name, linen, prefix):
    _, state, inputs, logits = fixture(name)
    path = str(tmp_path / "original.npz")
    np.savez(path, **timm_to_original(state, linen=linen, prefix=prefix))
    model = tiny_model(name)
    assert load_weights(model, path)["format"] == "original"
    assert max_diff(predict(model, inputs), logits) <= TOLERANCE


def test_big_vision_scanned_encoder_matches_timm_logits(tmp_path):
    _, state, inputs, logits = fixture("square")
    params = timm_to_original(state, linen=True)
    blocks = [k for k in params if k.startswith("Transformer/encoderblock_0/")]
    for key in blocks:
        rest = key[len("Transformer/encoderblock_0/") :]
        stacked = [params.pop(f"Transformer/encoderblock_{i}/{rest}") for i in range(2)]
        params["Transformer/encoderblock/" + rest] = np.stack(stacked)
    path = str(tmp_path / "scanned.npz")
    np.savez(path, **{"params/" + k: v for k, v in params.items()})
    model = tiny_model("square")
    load_weights(model, path)
    assert max_diff(predict(model, inputs), logits) <= TOLERANCE


def test_hugging_face_safetensors_matches_timm_logits(tmp_path):
    _, state, inputs, logits = fixture("square")
    path = str(tmp_path / "model.safetensors")
    save_file(timm_to_hf(state), path)
    model = tiny_model("square")
    assert load_weights(model, path)["format"] == "hf"
    assert max_diff(predict(model, inputs), logits) <= TOLERANCE


@pytest.mark.parametrize("name", ["square", "gap"])
def test_original_npz_with_tanh_gelu_matches_numpy_forward(tmp_path, name):
    _, state, inputs, _ = fixture(name)
    params = timm_to_original(state)
    path = str(tmp_path / "original.npz")
    np.savez(path, **params)
    model = tiny_model(name, approximate_gelu=True)
    load_weights(model, path)
    expected = np_original_forward(params, inputs, pooling="gap" if name == "gap" else "token")
    assert max_diff(predict(model, inputs), expected) <= TOLERANCE
    if name == "gap":
        return
    # The tanh and erf GELUs differ by more than the tolerance here (about 4e-4).
    exact = tiny_model(name)
    load_weights(exact, path)
    assert max_diff(predict(exact, inputs), expected) > 2 * TOLERANCE


def test_constructor_weights_argument_loads_a_file():
    path, _, inputs, logits = fixture("square")
    config = infer_config(path, num_heads=HEADS)
    model = keras_vit.VisionTransformer(**config, weights=path)
    assert max_diff(predict(model, inputs), logits) <= TOLERANCE


# Resolution change ---------------------------------------------------------------


def test_timm_resolution_change_matches_timm_resample_and_logits():
    path = os.path.join(DATA, "timm_square.safetensors")
    model = tiny_model("square", image_size=48)
    report = load_weights(model, path)
    assert report["resized"] == ((4, 4), (6, 6))
    golden = np.load(os.path.join(DATA, "timm_resample_posemb.npy"))
    encoder = model.get_layer("patch_encoder")
    ours = keras.ops.convert_to_numpy(encoder.position_embedding)
    assert max_diff(ours, golden) <= 1e-6
    inputs = np.load(os.path.join(DATA, "timm_resample_inputs.npy"))
    logits = np.load(os.path.join(DATA, "timm_resample_logits.npy"))
    assert max_diff(predict(model, inputs), logits) <= TOLERANCE


def test_dynamic_image_size_matches_timm_dynamic_img_size():
    """Images of other sizes than the model's: timm with dynamic_img_size=True is the golden."""
    path = os.path.join(DATA, "timm_square.safetensors")
    model = tiny_model("square", dynamic_image_size=True)
    assert model.input_shape == (None, None, None, 3)
    assert load_weights(model, path)["resized"] is None  # learned for 32x32, kept as it is
    golden = np.load(os.path.join(DATA, "timm_dynamic.npz"))
    sizes = [key[len("inputs_") :] for key in golden.files if key.startswith("inputs_")]
    assert len(sizes) >= 4 and "32x32" in sizes
    for size in sizes:
        inputs, logits = golden[f"inputs_{size}"], golden[f"logits_{size}"]
        assert max_diff(predict(model, inputs), logits) <= TOLERANCE, size
    # Keras' compiled predict function, without and with XLA: on TensorFlow its
    # trace has unknown image sizes, and the resize weights are built in the graph.
    for jit_compile in (False, True):
        model.compile(jit_compile=jit_compile)
        for size in sizes:
            inputs, logits = golden[f"inputs_{size}"], golden[f"logits_{size}"]
            assert max_diff(model.predict(inputs, verbose=0), logits) <= TOLERANCE, size


def test_resize_half_pixel_matches_timm_resample():
    state = load_file(os.path.join(DATA, "timm_square.safetensors"))
    golden = np.load(os.path.join(DATA, "timm_resample_posemb.npy"))
    ours = resize_position_embedding(state["pos_embed"], (4, 4), (6, 6), 1, method="half_pixel")
    assert max_diff(ours, golden) <= 1e-6


@pytest.mark.parametrize("source, target", [((4, 4), (6, 6)), ((4, 6), (7, 3)), ((5, 5), (2, 2))])
def test_resize_align_corners_matches_scipy_zoom(source, target):
    scipy_ndimage = pytest.importorskip("scipy.ndimage")
    rng = np.random.default_rng(1)
    posemb = rng.normal(size=(1, 1 + source[0] * source[1], 5)).astype("float32")
    ours = resize_position_embedding(posemb, source, target, 1)
    grid = posemb[0, 1:].reshape(*source, 5).astype("float64")
    zoom = (target[0] / source[0], target[1] / source[1], 1)
    expected = scipy_ndimage.zoom(grid, zoom, order=1).reshape(1, -1, 5)
    np.testing.assert_array_equal(ours[:, :1], posemb[:, :1])
    assert max_diff(ours[:, 1:], expected) <= 1e-6


def test_resize_is_exact_for_equal_grids_and_without_prefix():
    posemb = np.random.default_rng(2).normal(size=(1, 12, 3)).astype("float32")
    np.testing.assert_array_equal(resize_position_embedding(posemb, (3, 4), (3, 4), 0), posemb)
    assert resize_position_embedding(posemb, (3, 4), (6, 8), 0).shape == (1, 48, 3)


def test_resize_errors_name_the_argument():
    posemb = np.zeros((1, 11, 3))
    with pytest.raises(ValueError, match="source_grid=None"):
        resize_position_embedding(posemb, None, (4, 4), 1)
    with pytest.raises(ValueError, match=r"source_grid=\(3, 3\)"):
        resize_position_embedding(posemb, (3, 3), (4, 4), 1)
    with pytest.raises(ValueError, match="method='cubic'"):
        resize_position_embedding(np.zeros((1, 17, 3)), None, (4, 4), 1, method="cubic")


def test_npz_resolution_change_uses_the_original_zoom(tmp_path):
    scipy_ndimage = pytest.importorskip("scipy.ndimage")
    _, state, _, _ = fixture("square")
    path = str(tmp_path / "original.npz")
    np.savez(path, **timm_to_original(state))
    model = tiny_model("square", image_size=(40, 56))
    assert load_weights(model, path)["resized"] == ((4, 4), (5, 7))
    grid = state["pos_embed"][0, 1:].reshape(4, 4, -1).astype("float64")
    expected = scipy_ndimage.zoom(grid, (5 / 4, 7 / 4, 1), order=1).reshape(35, -1)
    ours = keras.ops.convert_to_numpy(model.get_layer("patch_encoder").position_embedding)[0]
    np.testing.assert_array_equal(ours[0], state["pos_embed"][0, 0])
    assert max_diff(ours[1:], expected) <= 1e-6


# Heads --------------------------------------------------------------------------


def test_other_num_classes_leaves_the_head_at_zeros_and_warns(caplog):
    path, _, inputs, _ = fixture("classes7")
    model = tiny_model("classes7", num_classes=5)
    with caplog.at_level(logging.WARNING, logger="keras_vit.weights"):
        report = load_weights(model, path)
    assert report["head"] == "reset"
    assert "head was not loaded" in caplog.text
    head = model.get_layer("head")
    assert not np.any(keras.ops.convert_to_numpy(head.kernel))
    assert not np.any(predict(model, inputs))


def test_pre_logits_kept_with_representation_size_else_dropped(tmp_path, caplog):
    _, state, inputs, _ = fixture("square")
    params = timm_to_original(state)
    rng = np.random.default_rng(3)
    params["pre_logits/kernel"] = rng.normal(size=(64, 64)).astype("float32") * 0.2
    params["pre_logits/bias"] = rng.normal(size=(64,)).astype("float32")
    path = str(tmp_path / "in21k.npz")
    np.savez(path, **params)
    with_pre = tiny_model("square", representation_size=64, approximate_gelu=True)
    assert load_weights(with_pre, path)["pre_logits"] == "loaded"
    assert max_diff(predict(with_pre, inputs), np_original_forward(params, inputs)) <= TOLERANCE
    without = tiny_model("square")
    with caplog.at_level(logging.WARNING, logger="keras_vit.weights"):
        report = load_weights(without, path)
    assert report["pre_logits"] == "dropped" and report["head"] == "reset"
    assert "pre-logits" in caplog.text
    features = tiny_model("square", num_classes=0)
    load_weights(features, path)  # pre-logits and head both dropped
    assert predict(features, inputs).shape == (2, 64)


# Strictness and bad files ----------------------------------------------------------


def weights_snapshot(model):
    return [keras.ops.convert_to_numpy(v).copy() for v in model.weights]


def assert_unchanged(model, before):
    for variable, value in zip(model.weights, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), value)


def test_unused_and_missing_keys_are_listed_and_nothing_is_loaded(tmp_path):
    _, state, _, _ = fixture("square")
    state = dict(state)
    del state["blocks.1.mlp.fc2.bias"]
    state["blocks.0.ls1.gamma"] = np.ones(64, "float32")
    path = str(tmp_path / "broken.safetensors")
    save_file(state, path)
    model = tiny_model("square")
    before = weights_snapshot(model)
    with pytest.raises(ValueError, match=r"Missing.*blocks\.1\.mlp\.fc2\.bias.*Unused.*ls1\.gamma"):
        load_weights(model, path)
    assert_unchanged(model, before)


def test_shape_mismatch_names_the_key_and_both_shapes(tmp_path):
    _, state, _, _ = fixture("square")
    params = timm_to_original(state)
    path = str(tmp_path / "original.npz")
    np.savez(path, **params)
    model = tiny_model("square", mlp_dim=96)
    before = weights_snapshot(model)
    with pytest.raises(
        ValueError, match=r"MlpBlock_3/Dense_0/kernel.*\(64, 128\).*expects \(64, 96\)"
    ):
        load_weights(model, path)
    assert_unchanged(model, before)
    deeper = tiny_model("square", num_layers=3)
    with pytest.raises(ValueError, match="2 transformer blocks.*num_layers=2"):
        load_weights(deeper, path)


def test_class_token_checkpoint_into_gap_model_is_rejected():
    path, _, _, _ = fixture("square")
    model = tiny_model("square", pooling="gap")
    with pytest.raises(ValueError, match="cls_token.*pooling='gap'"):
        load_weights(model, path)


def test_pickle_files_are_refused(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\x80\x04not read")
    with pytest.raises(ValueError, match="Convert it to safetensors"):
        load_weights(tiny_model("square"), str(path))


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_truncated_files_get_a_clear_error(tmp_path, suffix):
    source = os.path.join(DATA, "timm_square.safetensors")
    if suffix == ".npz":
        source = str(tmp_path / "full.npz")
        np.savez(source, **timm_to_original(fixture("square")[1]))
    data = open(source, "rb").read()
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"cut{suffix}.*truncated or corrupt"):
        load_weights(tiny_model("square"), str(path))


def test_unknown_layout_and_extension(tmp_path):
    path = str(tmp_path / "other.npz")
    np.savez(path, foo=np.zeros(3))
    with pytest.raises(ValueError, match="Unknown checkpoint layout.*foo"):
        load_weights(tiny_model("square"), path)
    text = tmp_path / "weights.h5"
    text.write_bytes(b"x")
    with pytest.raises(ValueError, match="expected a .npz or .safetensors"):
        load_weights(tiny_model("square"), str(text))


def test_infer_config_reads_the_original_layout(tmp_path):
    _, state, _, _ = fixture("gap")
    path = str(tmp_path / "gap.npz")
    np.savez(path, **timm_to_original(state))
    config = infer_config(path)
    assert config == dict(
        image_size=(32, 32),
        patch_size=(8, 8),
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        mlp_dim=128,
        num_classes=10,
        pooling="gap",
        representation_size=None,
        num_channels=3,
    )


# Presets -------------------------------------------------------------------------


class _Server:
    def __init__(self, directory):
        handler = functools.partial(_CountingHandler, directory=directory)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.requests = []
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @property
    def requests(self):
        return self.httpd.requests

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        self.server.requests.append(self.path)
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def served_preset(tmp_path, monkeypatch):
    import hashlib

    served = tmp_path / "served"
    served.mkdir()
    params = timm_to_original(fixture("square")[1])
    np.savez(served / "tiny.npz", **params)
    digest = hashlib.sha256((served / "tiny.npz").read_bytes()).hexdigest()
    (tmp_path / "keras_home").mkdir()
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    server = _Server(str(served))
    monkeypatch.setitem(
        weights_module.PRESETS,
        "test-tiny",
        dict(
            url=f"{server.url}/tiny.npz",
            constructor=None,
            image_size=32,
            num_classes=10,
            representation_size=None,
            sha256=digest,
        ),
    )
    yield server, digest, tmp_path
    server.close()


def test_preset_downloads_once_and_loads(served_preset):
    server, _, tmp_path = served_preset
    path = weights_module.resolve("test-tiny")
    assert path.startswith(str(tmp_path / "keras_home")) and os.path.isfile(path)
    assert server.requests == ["/tiny.npz"]
    again = weights_module.resolve("test-tiny")
    assert again == path and server.requests == ["/tiny.npz"]
    _, _, inputs, logits = fixture("square")
    model = tiny_model("square", weights="test-tiny")
    assert max_diff(predict(model, inputs), logits) <= TOLERANCE
    assert server.requests == ["/tiny.npz"]


def test_preset_with_a_wrong_hash_fails(served_preset, monkeypatch):
    server, _, _ = served_preset
    bad = dict(weights_module.PRESETS["test-tiny"], sha256="0" * 64)
    monkeypatch.setitem(weights_module.PRESETS, "test-tiny", bad)
    with pytest.raises(ValueError, match="(?i)hash"):
        weights_module.resolve("test-tiny")
    assert server.requests == ["/tiny.npz"]


def test_unknown_preset_lists_close_matches():
    with pytest.raises(ValueError, match=r"Close matches: ViT-B_16.*weights='ViT-B16'"):
        weights_module.resolve("ViT-B16")


def test_presets_are_plain_data_pointing_at_the_public_bucket():
    from keras_vit.models import VARIANTS

    for name in ("ViT-B_16", "ViT-B_32", "ViT-L_16", "ViT-B_16-224", "augreg_in21k_ft_in1k_B_16"):
        preset = weights_module.PRESETS[name]
        assert preset["url"].startswith("https://storage.googleapis.com/vit_models/")
        assert preset["constructor"] in VARIANTS
        assert set(preset) == {
            "url",
            "constructor",
            "image_size",
            "num_classes",
            "representation_size",
            "sha256",
        }


# keras-vit convert ------------------------------------------------------------------


def test_convert_command_end_to_end(tmp_path):
    from keras_vit import cli

    path, _, inputs, logits = fixture("square")
    destination = str(tmp_path / "tiny.keras")
    assert cli.main(["convert", path, destination, "--num-heads", "4"]) == 0
    model = keras.saving.load_model(destination, safe_mode=True)
    assert max_diff(predict(model, inputs), logits) <= TOLERANCE
    bigger = str(tmp_path / "tiny48.keras")
    assert (
        cli.main(
            [
                "convert",
                path,
                bigger,
                "--num-heads",
                "4",
                "--image-size",
                "48",
                "--num-classes",
                "3",
            ]
        )
        == 0
    )
    model = keras.saving.load_model(bigger, safe_mode=True)
    assert model.input_shape == (None, 48, 48, 3) and model.output_shape == (None, 3)


def test_convert_command_user_errors(tmp_path, capsys):
    from keras_vit import cli

    path = os.path.join(DATA, "timm_square.safetensors")
    assert cli.main(["convert", path, str(tmp_path / "x.h5")]) == 2
    assert "DST must end in .keras" in capsys.readouterr().err
    assert cli.main(["convert", path, str(tmp_path / "x.keras"), "--model", "ViT_X"]) == 2
    assert "--model must be one of" in capsys.readouterr().err
    assert cli.main(["convert", path, str(tmp_path / "x.keras"), "--model", "ViT_B16"]) == 2
    assert "Shape mismatch" in capsys.readouterr().err


# Real size ---------------------------------------------------------------------------


@pytest.mark.slow
def test_vit_b16_round_trips_a_full_size_original_npz(tmp_path):
    model = keras_vit.ViT_B16(image_size=224, num_classes=1000, approximate_gelu=True)
    rng = np.random.default_rng(0)
    for variable in model.weights:
        variable.assign(rng.normal(size=variable.shape).astype("float32") * 0.02)
    state = {}
    encoder = model.get_layer("patch_encoder")
    to_np = keras.ops.convert_to_numpy
    state["patch_embed.proj.weight"] = to_np(encoder.kernel).transpose(3, 2, 0, 1)
    state["patch_embed.proj.bias"] = to_np(encoder.bias)
    state["cls_token"] = to_np(encoder.cls_token)
    state["pos_embed"] = to_np(encoder.position_embedding)
    for i in range(12):
        block = model.get_layer(f"transformer_block_{i}")
        t = f"blocks.{i}."
        for name, layer in (("norm1", block.norm1), ("norm2", block.norm2)):
            state[t + name + ".weight"], state[t + name + ".bias"] = (
                to_np(layer.gamma),
                to_np(layer.beta),
            )
        for name, dense in (
            ("attn.qkv", block.attention.qkv),
            ("attn.proj", block.attention.proj),
            ("mlp.fc1", block.mlp.fc1),
            ("mlp.fc2", block.mlp.fc2),
        ):
            state[t + name + ".weight"] = to_np(dense.kernel).T
            state[t + name + ".bias"] = to_np(dense.bias)
    norm, head = model.get_layer("encoder_norm"), model.get_layer("head")
    state["norm.weight"], state["norm.bias"] = to_np(norm.gamma), to_np(norm.beta)
    state["head.weight"], state["head.bias"] = to_np(head.kernel).T, to_np(head.bias)
    params = timm_to_original(state, heads=12)
    path = str(tmp_path / "ViT-B_16.npz")
    np.savez(path, **params)
    images = rng.uniform(-1, 1, (1, 224, 224, 3)).astype("float32")
    fresh = keras_vit.ViT_B16(image_size=224, num_classes=1000, approximate_gelu=True, weights=path)
    assert max_diff(predict(fresh, images), np_original_forward(params, images)) <= TOLERANCE
    at_384 = keras_vit.ViT_B16(image_size=384, num_classes=10, weights=path)
    assert at_384.get_layer("patch_encoder").position_embedding.shape == (1, 577, 768)


def test_docstring_examples_run():
    import doctest

    from keras_vit.weights import resize

    result = doctest.testmod(resize)
    assert result.attempted >= 2 and result.failed == 0
