"""`keras-vit` on bad input: usage errors (exit status 2) that name the flag or
file, and nothing written or deleted before every argument has been checked.

The commands run in this process through keras_vit.cli.main, on tiny models
and data: most cases stop before any training.
"""

import argparse
import json
import os
import warnings

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import cli
from keras_vit.commands import train as train_command

pytestmark = pytest.mark.tensorflow_only

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
TINY = ["--model", "vit-test", "--image-size", "8", "--batch-size", "8", "--quiet"]


def run_cli(capsys, *argv):
    """(exit status, stdout, stderr) of `keras-vit ARGV`; an exception fails the test."""
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(result, *phrases):
    code, _, err = result
    assert code == 2, err
    assert "usage:" in err and "Traceback" not in err
    for phrase in phrases:
        assert phrase in err, (phrase, err)


@pytest.fixture
def npz(tmp_path):
    """40 training and 10 test images of 8 x 8, 3 classes."""
    rng = np.random.default_rng(0)
    y = np.arange(50) % 3
    x = rng.integers(0, 255, size=(50, 8, 8, 3)).astype("uint8")
    path = tmp_path / "tiny.npz"
    np.savez(path, x_train=x[:40], y_train=y[:40], x_test=x[40:], y_test=y[40:])
    return str(path)


def tiny_vit(image_size=8, num_classes=3, hidden_dim=16, **overrides):
    """The layout of `train --model vit-test` (patch 4, 1 block, 2 heads)."""
    config = dict(patch_size=4, num_layers=1, num_heads=2, mlp_dim=32, name="vision_transformer")
    config.update(overrides)
    return keras_vit.VisionTransformer(
        image_size=image_size, num_classes=num_classes, hidden_dim=hidden_dim, **config
    )


def saved(model, path):
    model.save(str(path))
    return str(path)


def write_run(folder, completed, **overrides):
    """A run.json as `keras-vit train` writes it (the defaults, with overrides)."""
    parser = cli.build_parser()
    args = parser.parse_args(["train", "--output", str(folder), *TINY])
    stored = {name: getattr(args, name) for name in train_command.STORED}
    stored.update(overrides)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, train_command.RUN_FILE), "w", encoding="utf-8") as file:
        json.dump({"args": stored, "completed": completed}, file)


def image_folder(root, counts, size=(12, 10)):
    """A folder of class sub-folders holding counts[i] PNGs each."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, count in enumerate(counts):
        os.makedirs(os.path.join(root, f"class{label}"), exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 255, size=(*size, 3)).astype("uint8")
            Image.fromarray(pixels).save(os.path.join(root, f"class{label}", f"{i}.png"))
    return str(root)


def png(path, size=(8, 8)):
    from PIL import Image

    Image.fromarray(np.full((*size, 3), 200, np.uint8)).save(path)
    return str(path)


# 1. train --weights FILE.keras: all or nothing -----------------------------------


def test_train_weights_of_another_width_are_refused(capsys, tmp_path, npz):
    other = saved(tiny_vit(hidden_dim=32), tmp_path / "other.keras")
    out = tmp_path / "run"
    result = run_cli(capsys, "train", "--data", npz, *TINY, "--weights", other, "--output", out)
    assert_usage_error(result, other, "transformer_block_0", "16", "32", "Nothing was loaded")
    assert not out.exists()


def test_train_weights_of_an_unrelated_model_are_refused(capsys, tmp_path, npz):
    inputs = keras.Input((8, 8, 3))
    outputs = keras.layers.Dense(3, name="dense")(keras.layers.Flatten()(inputs))
    unrelated = saved(keras.Model(inputs, outputs), tmp_path / "unrelated.keras")
    out = tmp_path / "run"
    result = run_cli(capsys, "train", "--data", npz, *TINY, "--weights", unrelated, "--output", out)
    assert_usage_error(result, unrelated, "patch_encoder", "dense")
    assert not out.exists()


def test_train_weights_keras_loads_all_but_a_head_of_another_size(capsys, tmp_path):
    """As keras_vit.load_weights: the head is reset, the position embedding resized."""
    source = tiny_vit(image_size=8, num_classes=3)
    for variable in source.weights:
        variable.assign(np.random.default_rng(1).normal(size=variable.shape))
    path = saved(source, tmp_path / "source.keras")
    model = tiny_vit(image_size=16, num_classes=5)
    train_command._load_keras_weights(model, path, "vit-test")
    out = capsys.readouterr().out
    assert "head was not loaded" in out and "position embedding" in out
    np.testing.assert_array_equal(model.get_layer("head").get_weights()[0], 0)
    for name in ("transformer_block_0", "encoder_norm"):
        for a, b in zip(model.get_layer(name).get_weights(), source.get_layer(name).get_weights()):
            np.testing.assert_array_equal(a, b)
    encoder, original = model.get_layer("patch_encoder"), source.get_layer("patch_encoder")
    expected = keras_vit.weights.resize_position_embedding(
        keras.ops.convert_to_numpy(original.position_embedding), (2, 2), (4, 4), 1
    )
    np.testing.assert_allclose(keras.ops.convert_to_numpy(encoder.position_embedding), expected)


# 2. train --overwrite --------------------------------------------------------------


def test_overwrite_checks_the_arguments_before_deleting(capsys, tmp_path):
    out = tmp_path / "run"
    write_run(out, completed=True)
    (out / "model.keras").write_text("the earlier run's model")
    result = run_cli(
        capsys, "train", "--output", out, "--overwrite", "--data", tmp_path / "missing.npz"
    )
    assert_usage_error(result, "--data", "missing.npz")
    assert (out / "model.keras").read_text() == "the earlier run's model"


def test_overwrite_refuses_a_folder_that_is_not_a_run(capsys, tmp_path, npz):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "chapter1.tex").write_text("precious")
    result = run_cli(capsys, "train", "--data", npz, *TINY, "--output", out, "--overwrite")
    assert_usage_error(result, "run.json", "chapter1.tex", "nothing was deleted")
    assert (out / "chapter1.tex").read_text() == "precious"


def test_overwrite_removes_the_runs_files_and_keeps_the_others(capsys, tmp_path):
    out = tmp_path / "run"
    write_run(out, completed=True, epochs=9)
    for name in ("model.keras", "best.keras", "history.csv", "notes.txt"):
        (out / name).write_text("x")
    (out / "backup").mkdir()
    (out / "backup" / "latest.weights.h5").write_text("x")
    args = argparse.Namespace(output=str(out), **{n: None for n in train_command.STORED})
    args.epochs = 1
    lock = train_command.OutputLock()
    train_command._commit_output(args, "overwrite", lock, existed=True)
    assert lock.held  # taken before anything is removed, kept while the run writes
    assert sorted(os.listdir(out)) == [train_command.LOCK_FILE, "notes.txt", "run.json"]
    lock.release()
    assert sorted(os.listdir(out)) == ["notes.txt", "run.json"]
    assert "notes.txt" in capsys.readouterr().out
    with open(out / "run.json", encoding="utf-8") as file:
        record = json.load(file)
    assert record["args"]["epochs"] == 1 and record["completed"] is False


# 3. Nothing written before the arguments are valid; --resume's flags ------------


def test_tensorboard_without_its_package_is_refused_before_anything_is_written(
    capsys, tmp_path, npz, monkeypatch
):
    # It trained until the first epoch's end, then TensorFlow's summary writer
    # raised TBNotInstalledError, with the run's folder half written.
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else find_spec(name, *a),
    )
    out = tmp_path / "run"
    result = run_cli(capsys, "train", "--data", npz, *TINY, "--tensorboard", "--output", out)
    assert_usage_error(result, "--tensorboard", "pip install tensorboard")
    assert not out.exists()
    with pytest.raises(ImportError, match="pip install tensorboard"):
        keras_vit.training.build_callbacks(str(tmp_path / "api"), tensorboard=True)
    assert not (tmp_path / "api").exists()


@pytest.mark.parametrize(
    "extra, phrase",
    [
        (["--dropout", "1.5"], "--dropout"),
        (["--label-smoothing", "1.5"], "--label-smoothing"),
        (["--weights", os.path.join(DATA, "timm_square.safetensors")], "--weights"),
    ],
)
def test_a_bad_argument_writes_nothing(capsys, tmp_path, npz, extra, phrase):
    out = tmp_path / "run"
    result = run_cli(capsys, "train", "--data", npz, *TINY, *extra, "--output", out)
    assert_usage_error(result, phrase)
    assert not out.exists()


@pytest.mark.parametrize("config", ["{bad", "{'cluster': {}}", "[1, 2]"])
def test_a_malformed_tf_config_is_named_and_nothing_is_written(
    capsys, tmp_path, npz, monkeypatch, config
):
    # A traceback from json, raised by the chief check, named neither TF_CONFIG nor
    # what it held.
    monkeypatch.setenv("TF_CONFIG", config)
    out = tmp_path / "run"
    result = run_cli(capsys, "train", "--data", npz, *TINY, "--output", out)
    assert_usage_error(result, "TF_CONFIG", config)
    assert not out.exists()


def test_a_tpu_strategy_without_a_tpu_is_named_once(capsys, tmp_path, npz):
    out = tmp_path / "run"
    result = run_cli(capsys, "train", "--data", npz, *TINY, "--strategy", "tpu", "--output", out)
    assert_usage_error(result, "--strategy tpu: no TPU found")
    assert result[2].count("--strategy tpu") == 1  # it was "--strategy tpu: --strategy tpu: ..."


@pytest.mark.parametrize("command", ["train", "evaluate"])
@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_a_seed_no_library_takes_is_a_usage_error(capsys, tmp_path, npz, command, seed):
    # A traceback from NumPy (train, once the data was read) or scikit-learn (evaluate).
    out = tmp_path / "run"
    where = ["--output", out] if command == "train" else ["--model", out]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        cli.main([str(a) for a in (command, "--data", npz, *where, "--seed", seed)])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "usage:" in err and "Traceback" not in err
    assert "--seed" in err and "2**32 - 1" in err
    assert not out.exists()


def test_resume_refuses_options_that_differ_from_the_run(capsys, tmp_path):
    out = tmp_path / "run"
    write_run(out, completed=False, epochs=2, dropout=0.0)
    result = run_cli(capsys, "train", "--output", out, "--resume", "--dropout", "0.1")
    assert_usage_error(result, "--dropout 0.1", "0.0")
    # Typed with its default value (30) is still typed: the run has 2 epochs.
    result = run_cli(capsys, "train", "--output", out, "--resume", "--epochs", "30")
    assert_usage_error(result, "--epochs 30", "2")
    result = run_cli(capsys, "train", "--output", out, "--resume", "--overwrite")
    assert_usage_error(result, "--resume", "--overwrite")
    assert sorted(os.listdir(out)) == ["run.json"]


def test_resume_of_a_finished_run_with_more_epochs_says_how_to_go_on(capsys, tmp_path):
    out = tmp_path / "run"
    write_run(out, completed=True, epochs=2)
    result = run_cli(capsys, "train", "--output", out, "--resume", "--epochs", "5")
    assert_usage_error(result, "--epochs 5", "--weights", "model.keras")
    # The same values as the run's are no contradiction.
    code, stdout, err = run_cli(capsys, "train", "--output", out, "--resume", "--epochs", "2")
    assert code == 0 and "already complete" in stdout, err


# 4. convert ------------------------------------------------------------------------

NONSQUARE = os.path.join(DATA, "timm_nonsquare.safetensors")


def test_convert_a_non_square_checkpoint_and_refuse_to_overwrite(capsys, tmp_path):
    destination = tmp_path / "nonsquare.keras"
    args = ["convert", NONSQUARE, destination, "--image-size", "32", "48", "--num-heads", "4"]
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    model = keras.models.load_model(destination)
    assert tuple(model.input_shape[1:3]) == (32, 48)
    inputs = np.load(os.path.join(DATA, "timm_nonsquare_inputs.npy"))
    logits = np.load(os.path.join(DATA, "timm_nonsquare_logits.npy"))
    np.testing.assert_allclose(model.predict(inputs, verbose=0), logits, atol=1e-4)
    before = destination.read_bytes()
    assert_usage_error(run_cli(capsys, *args), "--overwrite", str(destination))
    assert destination.read_bytes() == before
    code, _, err = run_cli(capsys, *args, "--overwrite")
    assert code == 0, err
    assert [name for name in os.listdir(tmp_path) if name.endswith(".keras")] == ["nonsquare.keras"]


def test_convert_says_which_head_count_it_assumed_for_a_timm_file(capsys, tmp_path):
    # timm files do not store it and any count loads: 1 head (hidden_dim / 64) was
    # assumed here without a word, where the checkpoint's model has 4.
    args = ["convert", NONSQUARE, tmp_path / "a.keras", "--image-size", "32", "48"]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "1 heads of 64 assumed" in out and "--num-heads" in out
    code, out, err = run_cli(capsys, *args[:2], tmp_path / "b.keras", *args[3:], "--num-heads", "4")
    assert code == 0 and "assumed" not in out, err


@pytest.mark.parametrize(
    "args, phrases",
    [
        (["nonexistent.npz", "x.keras"], ["SRC", "nonexistent.npz"]),
        ([NONSQUARE, "x.keras", "--config", '{"bogus": 1}'], ["--config", "bogus"]),
        ([NONSQUARE, "x.keras", "--config", "[1, 2]"], ["--config", "JSON object"]),
        ([NONSQUARE, "x.keras"], ["SRC", "pass --image-size H W"]),  # non-square: its size
        ([NONSQUARE, "{file}/x.keras", "--image-size", "32", "48"], ["DST", "{file}"]),
    ],
)
def test_convert_usage_errors(capsys, tmp_path, args, phrases):
    file = tmp_path / "a_file"
    file.write_text("")
    args = [a.replace("{file}", str(file)) for a in args]
    phrases = [p.replace("{file}", str(file)) for p in phrases]
    result = run_cli(capsys, "convert", *args)
    assert_usage_error(result, *phrases)
    assert "`weights`" not in result[2]


# 5. evaluate a non-square model ----------------------------------------------------


def test_evaluate_a_non_square_model(capsys, tmp_path):
    model = tiny_vit(image_size=(8, 12), num_classes=2)
    path = saved(model, tmp_path / "wide.keras")
    data = image_folder(tmp_path / "images", [3, 3])
    code, out, err = run_cli(capsys, "evaluate", "--model", path, "--data", data)
    assert code == 0, err
    assert "1 images: loss" in out


# 6. Unreadable class names, .keras files, outputs and data sets --------------------


@pytest.fixture
def run_folder(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    saved(tiny_vit(), folder / "model.keras")
    return folder


@pytest.mark.parametrize(
    "content, phrase",
    [
        (b"{'a', 'b'", "not valid JSON"),
        (b'["\xff\xfe"]', "not UTF-8"),
        (b'["only one", "two"]', "lists 2 class names"),  # the model has 3 classes
    ],
)
@pytest.mark.parametrize("command", ["predict", "explain", "export"])
def test_bad_class_name_files_are_usage_errors(
    capsys, tmp_path, run_folder, content, phrase, command
):
    (run_folder / "classes.json").write_bytes(content)
    image = png(tmp_path / "x.png")
    args = {
        "predict": ["predict", image, "--model", run_folder],
        "explain": ["explain", image, "--model", run_folder, "--output", tmp_path / "ex"],
        "export": ["export", "--model", run_folder, "--output", tmp_path / "sm"],
    }[command]
    assert_usage_error(run_cli(capsys, *args), "classes.json", phrase)


def test_export_class_names_file_is_checked(capsys, tmp_path, run_folder):
    names = tmp_path / "names.json"
    names.write_text("[not json")
    result = run_cli(
        capsys, "export", "--model", run_folder, "--output", tmp_path / "sm",
        "--class-names", names,
    )  # fmt: skip
    assert_usage_error(result, "--class-names", "names.json", "not valid JSON")


def test_a_corrupt_keras_file_is_a_usage_error(capsys, tmp_path):
    corrupt = tmp_path / "corrupt.keras"
    corrupt.write_bytes(b"PK\x03\x04 truncated")
    image = png(tmp_path / "x.png")
    result = run_cli(capsys, "predict", image, "--model", corrupt)
    assert_usage_error(result, "corrupt.keras", "not a readable .keras file")
    assert "File not found" not in result[2]


def test_explain_output_that_is_a_file(capsys, tmp_path, run_folder):
    image = png(tmp_path / "x.png")
    result = run_cli(capsys, "explain", image, "--model", run_folder, "--output", image)
    assert_usage_error(result, "--output", "x.png")


def test_predict_files_with_too_few_class_names(tmp_path):
    from keras_vit.commands.predict import predict_files

    with pytest.raises(ValueError, match="class_names"):
        predict_files(tiny_vit(), [png(tmp_path / "x.png")], class_names=["a"])


def test_train_unknown_tfds_dataset(capsys, tmp_path):
    out = tmp_path / "run"
    result = run_cli(capsys, "train", "--data", "tfds:nonexistent_xyz", *TINY, "--output", out)
    assert_usage_error(result, "--data", "nonexistent_xyz")
    assert not out.exists()


# 7. Too few classes or images ------------------------------------------------------


@pytest.mark.parametrize(
    "counts, phrases",
    [([2], ["1 class", "2 or more"]), ([1], ["--data", "at least 2 readable images"])],
)
def test_train_data_too_small_is_refused_before_training(capsys, tmp_path, counts, phrases):
    data = image_folder(tmp_path / "images", counts)
    out = tmp_path / "run"
    args = ["train", "--data", data, *TINY, "--batch-size", "2", "--output", out]
    assert_usage_error(run_cli(capsys, *args), *phrases)
    assert not out.exists()


def test_train_says_when_the_batch_is_larger_than_the_training_set(capsys, tmp_path):
    """It trains (each batch repeats images) and says so, with the --batch-size that
    would not; Keras' warning about `shuffle=True` with a Dataset is not shown."""
    data = image_folder(tmp_path / "images", [4, 4])  # 6 train / 2 validation images
    args = ["train", "--data", data, *TINY, "--batch-size", "16", "--epochs", "1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = run_cli(capsys, *args, "--output", tmp_path / "run")
    assert code == 0, err
    assert "Note: the global batch of 16 is larger than the 6 training images" in out
    assert "a --batch-size of at most 6 does not" in out
    assert not [w for w in caught if "shuffle" in str(w.message)], caught
    assert os.path.exists(tmp_path / "run" / "model.keras")
    code, out, err = run_cli(
        capsys, *args[:-4], "--batch-size", "6", "--epochs", "1", "--output", tmp_path / "run6"
    )
    assert code == 0, err
    assert "Note:" not in out


# 8. export: options of the other format --------------------------------------------


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--format", "tflite", "--no-preprocessing"], "--no-preprocessing"),
        (["--format", "tflite", "--top-k", "3"], "--top-k"),
        (["--format", "saved_model", "--quantization", "float16"], "--quantization"),
    ],
)
def test_export_refuses_options_of_the_other_format(capsys, tmp_path, run_folder, args, flag):
    output = tmp_path / "out"
    assert_usage_error(
        run_cli(capsys, "export", "--model", run_folder, "--output", output, *args), flag
    )
    assert not output.exists()


# 9. --jit-compile's help -----------------------------------------------------------


def test_jit_compile_help_says_where_evaluation_leaves_xla(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    help_text = text[text.rindex("--jit-compile {") :]  # the option's entry, not the usage
    help_text = help_text[: help_text.index("--remat")]
    assert "Intel" in help_text and "plan_xla" in help_text
    assert "machine with AVX-512 evaluation" not in help_text


# The CLI's rule for TypeErrors ------------------------------------------------------


def test_only_typeerrors_that_keras_vit_raises_are_usage_errors():
    from keras_vit import export
    from keras_vit.commands.predict import predict_files

    with pytest.raises(TypeError) as raised:
        export.load_trained(3)
    assert cli.is_user_error(raised.value)
    with pytest.raises(TypeError) as bug:  # Python's, in keras_vit: a bug, not a usage error
        predict_files(tiny_vit(), None)
    assert not cli.is_user_error(bug.value)


# predict reads images and scores classes as explain does --------------------------


def with_random_head(model):
    """`model` with a random head: the ViT head starts at zero, which scores every image alike."""
    head = model.get_layer("head")
    rng = np.random.default_rng(7)
    head.set_weights([rng.normal(0, 1, w.shape).astype("float32") for w in head.get_weights()])
    return model


def test_predict_reads_16_bit_grayscale_images_at_their_range(tmp_path):
    from PIL import Image

    from keras_vit.commands.predict import predict_files

    rng = np.random.default_rng(3)
    wide = rng.integers(0, 65536, size=(8, 8)).astype(np.uint16)
    Image.fromarray(wide).save(tmp_path / "wide.png")  # PIL mode I;16
    narrow = np.round(wide / 257.0).astype(np.uint8)  # the same picture in 8 bits
    Image.fromarray(np.repeat(narrow[..., None], 3, axis=-1)).save(tmp_path / "narrow.png")
    model = with_random_head(tiny_vit())
    ((_, wide_best),) = predict_files(model, [str(tmp_path / "wide.png")], top_k=3)
    ((_, narrow_best),) = predict_files(model, [str(tmp_path / "narrow.png")], top_k=3)
    assert [name for name, _ in wide_best] == [name for name, _ in narrow_best]
    np.testing.assert_allclose(
        [p for _, p in wide_best], [p for _, p in narrow_best], rtol=1e-6, atol=1e-7
    )


def test_predict_does_not_apply_softmax_twice(tmp_path):
    from keras_vit.commands.predict import predict_files

    model = with_random_head(tiny_vit(classifier_activation="softmax"))
    image = png(tmp_path / "x.png")
    ((_, best),) = predict_files(model, [image], top_k=3)
    scaled = np.full((1, 8, 8, 3), 200 / 127.5 - 1.0, np.float32)
    expected = np.asarray(model.predict(scaled, verbose=0))[0]
    np.testing.assert_allclose(
        sorted((p for _, p in best), reverse=True), np.sort(expected)[::-1], rtol=1e-5
    )


def test_predict_scores_wrapped_models_and_final_softmax_layers_once(tmp_path):
    from keras_vit.commands import _common
    from keras_vit.commands.predict import predict_files

    inputs = keras.Input((8, 8, 3))
    ending_in_softmax = keras.Model(
        inputs, keras.layers.Softmax()(with_random_head(tiny_vit())(inputs))
    )
    wrapped_softmax_head = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Identity(),
            with_random_head(tiny_vit(classifier_activation="softmax")),
        ]
    )
    scaled = np.full((1, 8, 8, 3), 200 / 127.5 - 1.0, np.float32)
    image = png(tmp_path / "x.png")
    for model in (ending_in_softmax, wrapped_softmax_head):
        assert _common.num_classes(model) == 3
        expected = np.asarray(model.predict(scaled, verbose=0))[0]
        assert expected.max() - expected.min() > 1e-3  # the scores tell the classes apart
        ((_, best),) = predict_files(model, [image], top_k=3)
        np.testing.assert_allclose(
            sorted((p for _, p in best), reverse=True), np.sort(expected)[::-1], rtol=1e-5
        )
    headless = keras.Sequential([keras.Input((8, 8, 3)), tiny_vit(num_classes=0)])
    assert _common.num_classes(headless) is None
    with pytest.raises(cli.UsageError, match="no classification head"):
        _common.class_probabilities(headless, scaled)


def test_python_m_keras_vit_cli_reports_usage_errors(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "keras_vit.cli", "predict", str(tmp_path / "missing.png"),
         "--model", str(tmp_path / "nothing")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "--model" in result.stderr


def test_cpu_streams_auto_sets_threads_only_in_a_process_of_its_own(monkeypatch):
    """--cpu-streams auto: the recommended streams where the command owns its process
    and trains on one replica; explicit counts are configured or refused as before."""
    from types import SimpleNamespace

    from keras_vit import streams

    configured = []

    def configure(count):
        configured.append(count)
        return 1

    monkeypatch.setattr(streams, "configure_cpu_streams", configure)
    monkeypatch.setattr(streams, "recommended_cpu_streams", lambda: 2)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("TPU_NAME", raising=False)

    def run(cpu_streams, own, strategy="auto"):
        args = SimpleNamespace(cpu_streams=cpu_streams, _own_process=own, strategy=strategy)
        return train_command._configure_cpu_streams(args)

    assert run("auto", own=False) == 1 and configured == []  # cli.main([...]) from a program
    assert run("auto", own=True, strategy="mirrored") == 1 and configured == []
    assert run("auto", own=True) == 2 and configured == [2]
    assert run("auto", own=True, strategy="default") == 2 and configured == [2, 2]
    workers = {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(workers))
    assert run("auto", own=True) == 1 and configured == [2, 2]
    monkeypatch.delenv("TF_CONFIG")
    assert run(1, own=True) == 1 and configured == [2, 2]
    assert run(2, own=False) == 2 and configured == [2, 2, 2]

    def started(count):
        raise RuntimeError("must run before TensorFlow runs its first operation")

    monkeypatch.setattr(streams, "configure_cpu_streams", started)
    assert run("auto", own=True) == 1  # TensorFlow already runs: left as it is
    with pytest.raises(cli.UsageError, match="--cpu-streams: must run before"):
        run(2, own=True)
    monkeypatch.setattr(streams, "recommended_cpu_streams", lambda: 1)
    assert run("auto", own=True) == 1
