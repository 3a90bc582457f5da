"""Checkpoint loading under user mistakes: clear errors, all or nothing, no corrupt cache."""

import functools
import http.server
import json
import logging
import os
import tempfile
import threading

import keras
import numpy as np
import pytest
from test_weights import assert_unchanged, weights_snapshot

import keras_vit
from keras_vit import weights as weights_module
from keras_vit.weights import load_weights

DIM, HEADS, MLP, LAYERS, PATCH, SIZE, CLASSES = 32, 2, 64, 2, 8, 32, 10
GRID = SIZE // PATCH


def tiny_model(**overrides):
    config = dict(
        image_size=SIZE,
        patch_size=PATCH,
        num_layers=LAYERS,
        num_heads=HEADS,
        hidden_dim=DIM,
        mlp_dim=MLP,
        num_classes=CLASSES,
    )
    config.update(overrides)
    return keras_vit.VisionTransformer(**config)


def original_params(seed=0, classes=CLASSES):
    """A checkpoint in the original (pre-linen) npz layout, random values, from the key names."""
    rng = np.random.default_rng(seed)

    def r(*shape):
        return rng.normal(0, 0.02, shape).astype("float32")

    head_dim = DIM // HEADS
    params = {
        "embedding/kernel": r(PATCH, PATCH, 3, DIM),
        "embedding/bias": r(DIM),
        "cls": r(1, 1, DIM),
        "Transformer/posembed_input/pos_embedding": r(1, 1 + GRID * GRID, DIM),
        "Transformer/encoder_norm/scale": r(DIM),
        "Transformer/encoder_norm/bias": r(DIM),
        "head/kernel": r(DIM, classes),
        "head/bias": r(classes),
    }
    for i in range(LAYERS):
        b = f"Transformer/encoderblock_{i}/"
        for norm in ("LayerNorm_0", "LayerNorm_2"):
            params[f"{b}{norm}/scale"] = r(DIM)
            params[f"{b}{norm}/bias"] = r(DIM)
        a = b + "MultiHeadDotProductAttention_1/"
        for part in ("query", "key", "value"):
            params[f"{a}{part}/kernel"] = r(DIM, HEADS, head_dim)
            params[f"{a}{part}/bias"] = r(HEADS, head_dim)
        params[a + "out/kernel"] = r(HEADS, head_dim, DIM)
        params[a + "out/bias"] = r(DIM)
        params[b + "MlpBlock_3/Dense_0/kernel"] = r(DIM, MLP)
        params[b + "MlpBlock_3/Dense_0/bias"] = r(MLP)
        params[b + "MlpBlock_3/Dense_1/kernel"] = r(MLP, DIM)
        params[b + "MlpBlock_3/Dense_1/bias"] = r(DIM)
    return params


def save(tmp_path, params, name="ckpt.npz"):
    path = str(tmp_path / name)
    np.savez(path, **params)
    return path


def test_the_writer_fits_the_tiny_model(tmp_path):
    # The helper's checkpoint loads: the failures below come from the one change each makes.
    params = original_params()
    model = tiny_model()
    assert load_weights(model, save(tmp_path, params))["head"] == "loaded"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(model.get_layer("head").bias), params["head/bias"]
    )


# Files ----------------------------------------------------------------------------


def test_a_folder_is_named_as_a_folder(tmp_path):
    with pytest.raises(ValueError, match="not a folder.*Received: path=.*(a folder)"):
        load_weights(tiny_model(), str(tmp_path))
    with pytest.raises(ValueError, match="weights=.*a folder, not a checkpoint file"):
        tiny_model(weights=str(tmp_path))


def test_a_corrupt_compressed_npz_is_named_and_nothing_is_loaded(tmp_path):
    # zlib's own error escaped, naming neither the file nor what was wrong with it.
    path = str(tmp_path / "ckpt.npz")
    params = original_params()
    np.savez_compressed(path, **{key: np.zeros_like(value) for key, value in params.items()})
    data = bytearray(open(path, "rb").read())
    # Garble the first member's deflated bytes, past its local header, name and extra field.
    name, extra = (int.from_bytes(data[at : at + 2], "little") for at in (26, 28))
    start = 30 + name + extra + 4
    data[start : start + 64] = bytes(range(64))
    with open(path, "wb") as file:
        file.write(data)
    model = tiny_model()
    before = weights_snapshot(model)
    with pytest.raises(ValueError, match="Cannot read the checkpoint .*ckpt.npz.*corrupt"):
        load_weights(model, path)
    assert_unchanged(model, before)


# Array contents: refused before anything is assigned ---------------------------------


def test_an_array_of_strings_is_refused_and_nothing_is_loaded(tmp_path):
    params = original_params()
    params["embedding/bias"] = np.array(["0.5"] * DIM)
    model = tiny_model()
    before = weights_snapshot(model)
    with pytest.raises(ValueError, match="'embedding/bias'.*real numbers.*dtype <U3"):
        load_weights(model, save(tmp_path, params))
    assert_unchanged(model, before)


def test_nan_or_infinite_values_are_refused_and_nothing_is_loaded(tmp_path):
    params = original_params()
    params["Transformer/encoderblock_1/MlpBlock_3/Dense_1/bias"][:3] = [np.nan, np.inf, -np.inf]
    model = tiny_model()
    before = weights_snapshot(model)
    with pytest.raises(ValueError, match=r"encoderblock_1/MlpBlock_3/Dense_1/bias.*3 NaN"):
        load_weights(model, save(tmp_path, params))
    assert_unchanged(model, before)


# The head ----------------------------------------------------------------------------


def test_a_missing_head_bias_is_listed_as_missing(tmp_path):
    params = original_params()
    del params["head/bias"]
    model = tiny_model()
    before = weights_snapshot(model)
    with pytest.raises(ValueError, match="Missing checkpoint keys: head/bias.*unfilled: head/bias"):
        load_weights(model, save(tmp_path, params))
    assert_unchanged(model, before)


def test_a_head_of_another_class_count_is_reset_but_not_one_of_another_width(tmp_path, caplog):
    params = original_params(classes=7)
    model = tiny_model()
    with caplog.at_level(logging.WARNING, logger="keras_vit.weights"):
        assert load_weights(model, save(tmp_path, params))["head"] == "reset"
    assert "head was not loaded" in caplog.text
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(model.get_layer("encoder_norm").gamma),
        params["Transformer/encoder_norm/scale"],
    )
    # A head that reads another width is not the model's head with other classes.
    params = original_params()
    params["head/kernel"] = params["head/kernel"][: DIM // 2]
    model = tiny_model()
    before = weights_snapshot(model)
    with pytest.raises(ValueError, match=r"'head/kernel'.*\(16, 10\).*expects \(32, 10\)"):
        load_weights(model, save(tmp_path, params, "narrow.npz"))
    assert_unchanged(model, before)


# The position embedding ------------------------------------------------------------


def test_a_position_embedding_without_grid_tokens_is_named(tmp_path):
    params = original_params()
    params["Transformer/posembed_input/pos_embedding"] = np.zeros((1, 1, DIM), "float32")
    with pytest.raises(ValueError, match="pos_embedding' has no grid tokens"):
        load_weights(tiny_model(), save(tmp_path, params))


def test_a_missing_class_token_is_suggested_by_the_grid_error(tmp_path):
    params = original_params()
    del params["cls"]
    with pytest.raises(ValueError, match="17 grid tokens.*the class token is missing"):
        load_weights(tiny_model(), save(tmp_path, params))


# Presets: download and cache ----------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    """/full.npz whole; /cut.npz half, no Content-Length, then closed; anything else 404."""

    def do_GET(self):
        self.server.requests.append(self.path)
        data = self.server.data
        if self.path == "/full.npz":
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/cut.npz":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    path = save(tmp_path, original_params(), "served.npz")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.data = open(path, "rb").read()
    httpd.requests = []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "home"))
    # The fallback of an unwritable cache stays inside the test's folder.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    httpd.preset = functools.partial(_preset, monkeypatch, url)
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _preset(monkeypatch, url, path, sha256=None):
    monkeypatch.setitem(
        weights_module.PRESETS,
        "test-tiny",
        dict(
            url=url + path,
            constructor=None,
            image_size=SIZE,
            num_classes=CLASSES,
            representation_size=None,
            sha256=sha256,
        ),
    )


def cached_files(tmp_path):
    return sorted(
        os.path.relpath(os.path.join(root, name), tmp_path)
        for folder in ("home", os.path.join("tmp", ".keras"))
        for root, _, names in os.walk(tmp_path / folder)
        for name in names
    )


def test_a_download_cut_short_is_refused_and_not_cached(server, tmp_path):
    server.preset("/cut.npz")
    for _ in range(2):  # the second call downloads again: nothing was left to trust
        with pytest.raises(OSError, match="'test-tiny' from http.*/cut.npz is incomplete"):
            weights_module.resolve("test-tiny")
        assert cached_files(tmp_path) == []
    assert server.requests == ["/cut.npz", "/cut.npz"]


def test_an_incomplete_cached_file_is_downloaded_again(server, tmp_path):
    server.preset("/full.npz")
    path = weights_module.resolve("test-tiny")
    with open(path, "r+b") as handle:  # as left by an older version or a killed process
        handle.truncate(len(server.data) // 3)
    assert weights_module.resolve("test-tiny") == path
    assert open(path, "rb").read() == server.data
    assert server.requests == ["/full.npz", "/full.npz"]


def test_what_killed_downloads_left_is_removed_by_the_next(server, tmp_path):
    import subprocess
    import sys

    from keras_vit import _leftovers

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead, tag = int(ended.stdout), _leftovers.owner().split("-")[1]
    cache = tmp_path / "home" / "keras_vit"
    cache.mkdir(parents=True)
    left = cache / f".part-{dead}-{tag}-test-tiny-full.npz"  # as a killed download leaves it
    kept = [
        cache / f".part-{os.getppid()}-{tag}-test-tiny-full.npz",  # a live process's download
        cache / f".part-{dead}-0badc0de-test-tiny-full.npz",  # another host's
        cache / f".part-{dead}-test-tiny-full.npz",  # an older version's name
    ]
    for path in (left, *kept):
        path.write_bytes(server.data[:100])
    server.preset("/full.npz")
    path = weights_module.resolve("test-tiny")
    assert open(path, "rb").read() == server.data
    assert not left.exists() and all(path.exists() for path in kept)


def test_train_fine_tunes_from_a_preset_name(server, tmp_path, monkeypatch, capsys):
    """keras-vit train --weights PRESET: downloaded once, loaded whole (the head aside)."""
    from keras_vit import cli
    from keras_vit.commands import train as train_command

    config = dict(patch_size=PATCH, num_layers=LAYERS, num_heads=HEADS, hidden_dim=DIM,
                  mlp_dim=MLP)  # fmt: skip
    monkeypatch.setitem(train_command.PRESETS, "vit-served", config)
    server.preset("/full.npz")
    y = np.arange(24) % 3
    x = np.random.default_rng(0).integers(0, 256, (24, SIZE, SIZE, 3)).astype("uint8")
    data = tmp_path / "data.npz"
    np.savez(data, x_train=x, y_train=y, x_test=x[:6], y_test=y[:6])
    common = ["train", "--data", str(data), "--model", "vit-served", "--image-size", str(SIZE),
              "--epochs", "1", "--batch-size", "8", "--quiet"]  # fmt: skip
    status = cli.main([*common, "--weights", "test-tiyn", "--output", str(tmp_path / "typo")])
    assert status == 2 and "close matches: test-tiny" in capsys.readouterr().err
    assert server.requests == [] and not (tmp_path / "typo").exists()
    out = tmp_path / "run"
    status = cli.main([*common, "--weights", "test-tiny", "--lr", "1e-12", "--output", str(out)])
    assert status == 0, capsys.readouterr().err
    assert server.requests == ["/full.npz"]
    model = keras.models.load_model(out / "model.keras")
    params = original_params()
    np.testing.assert_allclose(  # the checkpoint's, moved by no more than lr 1e-12 can
        model.get_layer("patch_encoder").position_embedding.numpy(),
        params["Transformer/posembed_input/pos_embedding"],
        atol=1e-6,
    )
    assert json.loads((out / "run.json").read_text())["args"]["weights"] == "test-tiny"


def test_http_errors_name_the_preset_and_url_and_cache_nothing(server, tmp_path):
    server.preset("/missing.npz")
    with pytest.raises(OSError, match=r"preset 'test-tiny' from http://127\.0\.0\.1:\d+/missing"):
        weights_module.resolve("test-tiny")
    assert cached_files(tmp_path) == []


def test_a_wrong_hash_caches_nothing(server, tmp_path):
    server.preset("/full.npz", sha256="0" * 64)
    with pytest.raises(ValueError, match="does not match its recorded sha256"):
        weights_module.resolve("test-tiny")
    assert cached_files(tmp_path) == []


def test_an_unwritable_cache_falls_back_to_a_temporary_folder_with_a_warning(
    server, tmp_path, monkeypatch, caplog
):
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("KERAS_HOME", str(blocker / "home"))  # cannot be created
    server.preset("/full.npz")
    with caplog.at_level(logging.WARNING, logger="keras_vit.weights"):
        path = weights_module.resolve("test-tiny")
    assert "cannot be written" in caplog.text and str(blocker) in caplog.text
    assert path == str(tmp_path / "tmp" / ".keras" / "keras_vit" / "test-tiny-full.npz")
    assert open(path, "rb").read() == server.data
    assert weights_module.resolve("test-tiny") == path and len(server.requests) == 1


def test_convert_reports_a_failed_download_without_a_traceback(server, tmp_path, capsys):
    from keras_vit import cli

    server.preset("/missing.npz")
    assert cli.main(["convert", "test-tiny", str(tmp_path / "out.keras")]) == 2
    error = capsys.readouterr().err
    assert "SRC 'test-tiny'" in error and "404" in error
    assert cli.main(["convert", str(tmp_path), str(tmp_path / "out.keras")]) == 2
    assert "a folder, not a checkpoint file" in capsys.readouterr().err
