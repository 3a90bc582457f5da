"""Plots and `keras-vit explain`: PNGs written, decodable, of the expected size."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit.cli import main as cli_main
from keras_vit.visualize import attention_overlay, upsample_map

RNG = np.random.default_rng(11)


def tiny_model(tiny_config, **overrides):
    model = keras_vit.VisionTransformer(**{**tiny_config, **overrides})
    for weight in model.weights:
        weight.assign(RNG.normal(0, 0.3, weight.shape).astype("float32"))
    return model


def decoded_size(path):
    from PIL import Image

    with Image.open(path) as picture:
        assert picture.format == "PNG"
        picture.load()
        return picture.size


def test_overlay_blends_the_upsampled_map():
    image = RNG.integers(0, 256, (24, 40, 3), dtype=np.uint8)
    attention = np.arange(6, dtype="float32").reshape(2, 3)
    heat = upsample_map(attention, (24, 40))
    assert heat.shape == (24, 40) and heat.min() == 0.0 and heat.max() == 1.0
    np.testing.assert_array_equal(attention_overlay(image, attention, alpha=0.0), image)
    import matplotlib

    colours = matplotlib.colormaps["inferno"](heat)[..., :3] * 255
    full = attention_overlay(image, attention, alpha=1.0)
    assert full.shape == image.shape and full.dtype == np.uint8
    np.testing.assert_allclose(full, colours, atol=1.0)
    # Float images in [-1, 1] (what the models take) are mapped back to uint8.
    floats = image.astype("float32") / 127.5 - 1.0
    np.testing.assert_allclose(attention_overlay(floats, attention, alpha=0.0), image, atol=1)


def test_plots_write_pngs_and_return_figures(tmp_path, tiny_config, images):
    import matplotlib.figure

    model = tiny_model(tiny_config)
    maps = keras_vit.attention_maps(model, images)
    rollout = keras_vit.attention_rollout(maps)
    paths = {name: os.path.join(tmp_path, f"{name}.png") for name in ("overlay", "pos", "dist")}
    figures = [
        keras_vit.plot_attention(images[0], rollout[0], path=paths["overlay"], title="c3"),
        keras_vit.plot_position_embedding_similarity(model, path=paths["pos"]),
        keras_vit.plot_mean_attention_distance(model, images, path=paths["dist"]),
    ]
    assert all(isinstance(figure, matplotlib.figure.Figure) for figure in figures)
    for path in paths.values():
        width, height = decoded_size(path)
        assert 150 < width < 1000 and 150 < height < 1000
    # The scatter shows one point per (layer, head), at the computed distances.
    offsets = np.concatenate([c.get_offsets() for c in figures[2].axes[0].collections])
    assert offsets.shape == (2 * 2, 2)
    np.testing.assert_allclose(
        np.sort(offsets[:, 1]),
        np.sort(keras_vit.mean_attention_distance(model, None, maps=maps).ravel()),
        rtol=1e-6,
    )
    assert figures[1].axes[0].images[0].get_array().shape == (4 * 5, 4 * 5)  # 4x4 tiles + gaps


def test_position_embedding_similarity_equals_cosine_of_the_weights(tiny_config):
    model = tiny_model(tiny_config)
    embedding = keras.ops.convert_to_numpy(
        model.get_layer("patch_encoder").position_embedding
    ).astype("float64")[0, 1:]
    got = keras_vit.position_embedding_similarity(model)
    for a in (0, 5, 15):
        for b in (0, 3, 10):
            u, v = embedding[a], embedding[b]
            cosine = u @ v / np.sqrt((u @ u) * (v @ v))
            np.testing.assert_allclose(got[a // 4, a % 4, b // 4, b % 4], cosine, atol=1e-6)


def test_plot_bad_inputs_get_clear_errors(tiny_config):
    with pytest.raises(ValueError, match=r"image.shape=\(1, 32, 32, 3\)"):
        keras_vit.plot_attention(np.zeros((1, 32, 32, 3)), np.zeros((4, 4)))
    with pytest.raises(ValueError, match="must be 2-D"):
        keras_vit.plot_attention(np.zeros((32, 32, 3)), np.zeros((1, 4, 4)))
    with pytest.raises(ValueError, match="alpha"):
        attention_overlay(np.zeros((32, 32, 3)), np.zeros((4, 4)), alpha=2)
    dense = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="PatchEncoder"):
        keras_vit.plot_position_embedding_similarity(dense)


def save_run_folder(folder, model, class_names):
    os.makedirs(folder, exist_ok=True)
    model.save(os.path.join(folder, "model.keras"))
    with open(os.path.join(folder, "classes.json"), "w") as handle:
        json.dump(class_names, handle)


def write_image(path, shape):
    from PIL import Image

    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(RNG.integers(0, 255, shape, dtype=np.uint8)).save(path)


def test_explain_in_process(tmp_path, capsys, tiny_config):
    model = tiny_model(tiny_config, pooling="gap", classifier_activation="softmax")
    run = os.path.join(tmp_path, "run")
    save_run_folder(run, model, [f"class{i}" for i in range(10)])
    first, second = os.path.join(tmp_path, "a", "x.jpg"), os.path.join(tmp_path, "b", "x.png")
    write_image(first, (50, 70, 3))
    write_image(second, (32, 32, 3))
    out = os.path.join(tmp_path, "out")
    argv = ["explain", first, second, "--model", run, "--output", out, "--top-k", "4"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    # Top-4 probabilities, from an independent softmax-free reading of the head's output.
    from PIL import Image

    inputs = np.stack(
        [
            np.asarray(Image.open(p).convert("RGB").resize((32, 32), Image.BILINEAR))
            for p in (first, second)
        ]
    )
    probs = keras.ops.convert_to_numpy(model(inputs.astype("float32") / 127.5 - 1.0))
    best = np.argsort(-probs[0])[:4]
    line = next(text for text in printed.splitlines() if text.startswith(first))
    assert line.split(": ", 1)[1].split(", ")[0] == f"class{best[0]} {probs[0, best[0]]:.3f}"
    assert line.count("class") == 4
    assert decoded_size(os.path.join(out, "x_attention.png")) == (70, 50)
    assert decoded_size(os.path.join(out, "x_1_attention.png")) == (32, 32)  # same stem
    assert min(decoded_size(os.path.join(out, "x_explain.png"))) > 150
    # A model that takes any size explains at the size it was built for, as the fixed one.
    dynamic = keras_vit.VisionTransformer(
        **{**tiny_config, "pooling": "gap", "classifier_activation": "softmax"},
        dynamic_image_size=True,
    )
    dynamic.set_weights(model.get_weights())
    save_run_folder(os.path.join(tmp_path, "dynamic"), dynamic, [f"class{i}" for i in range(10)])
    dynamic_out = os.path.join(tmp_path, "dynamic_out")
    argv = [
        "explain", first, "--model", os.path.join(tmp_path, "dynamic"),
        "--output", dynamic_out, "--top-k", "4",
    ]  # fmt: skip
    assert cli_main(argv) == 0
    assert line in capsys.readouterr().out.splitlines()
    np.testing.assert_array_equal(
        np.asarray(Image.open(os.path.join(dynamic_out, "x_attention.png"))),
        np.asarray(Image.open(os.path.join(out, "x_attention.png"))),
    )
    assert cli_main(["explain", first, "--model", run, "--output", out, "--top-k", "0"]) == 2
    assert cli_main(["explain", first, "--model", first, "--output", out]) == 2
    assert "--top-k must be a positive integer" in capsys.readouterr().err


def test_explain_in_chunks_writes_what_one_pass_writes(tmp_path, capsys, tiny_config, monkeypatch):
    # Images are explained a few at a time (their originals and attention maps are
    # large); the chunks' outputs are those of one pass over all the images.
    from PIL import Image

    from keras_vit.commands import explain

    model = tiny_model(tiny_config)
    run = os.path.join(tmp_path, "run")
    save_run_folder(run, model, [f"class{i}" for i in range(10)])
    paths = [os.path.join(tmp_path, f"{i}.png") for i in range(5)]
    for i, path in enumerate(paths):
        write_image(path, (32 + 8 * i, 40, 3))
    outputs = {}
    for chunk in (2, 8):
        monkeypatch.setattr(explain, "EXPLAIN_CHUNK", chunk)
        out = os.path.join(tmp_path, f"out{chunk}")
        assert cli_main(["explain", *paths, "--model", run, "--output", out]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert [line.split(":")[0] for line in printed[::2]] == paths
        files = sorted(os.listdir(out))
        assert len(files) == 10
        images = [np.asarray(Image.open(os.path.join(out, f))) for f in files if "attention" in f]
        outputs[chunk] = (printed, images)
    assert outputs[2][0] == [line.replace("out8", "out2") for line in outputs[8][0]]
    for a, b in zip(outputs[2][1], outputs[8][1], strict=True):
        np.testing.assert_array_equal(a, b)


def test_explain_end_to_end_on_a_saved_keras_file(tmp_path, tiny_config):
    model = tiny_model(tiny_config)
    model_file = os.path.join(tmp_path, "tiny.keras")
    model.save(model_file)
    image_path = os.path.join(tmp_path, "photo.png")
    write_image(image_path, (60, 45, 3))
    out = os.path.join(tmp_path, "explained")
    command = [sys.executable, "-m", "keras_vit", "explain"]
    options = ["--model", model_file, "--output", out]
    result = subprocess.run(
        [*command, image_path, *options, "--top-k", "3"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{image_path}: ") and result.stdout.count(", ") == 2
    assert decoded_size(os.path.join(out, "photo_attention.png")) == (45, 60)
    missing = subprocess.run([*command, "nope.png", *options], capture_output=True, text=True)
    assert missing.returncode == 2 and "no such image file" in missing.stderr
    assert "Traceback" not in missing.stderr
