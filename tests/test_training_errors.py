"""What goes wrong for a user of keras_vit.data, keras_vit.training and `keras-vit
train / evaluate`: odd image folders, checkpoints cut short by a kill, a run that
diverges, what --resume reads and checks, evaluation data whose classes or split
are not the model's."""

import contextlib
import io
import json
import os
import shutil

import keras
import numpy as np
import pytest
from PIL import Image

from keras_vit import data, training
from keras_vit.cli import main

pytestmark = pytest.mark.tensorflow_only

RNG = np.random.default_rng(0)
PIXELS = RNG.integers(0, 256, size=(16, 16, 3), dtype=np.uint8)
TINY_RUN = ["--model", "vit-test", "--image-size", "16", "--batch-size", "16", "--quiet"]


def _save(path, image, **kwargs):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    image.save(path, **kwargs)


def _tiny_model(num_classes=3):
    import keras_vit

    return keras_vit.VisionTransformer(
        image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
        num_classes=num_classes,
    )  # fmt: skip


def _npz(path, labels, class_names=None):
    """Images whose class is their label (brightness), stored with `labels` renamed."""
    y = np.arange(48) % 3
    x = (
        np.random.default_rng(0).integers(0, 60, size=(48, 16, 16, 3)) + y[:, None, None, None] * 90
    ).astype("uint8")
    arrays = dict(x_train=x, y_train=labels[y], x_test=x[:24], y_test=labels[y[:24]])
    if class_names is not None:
        arrays["class_names"] = np.array(class_names)
    np.savez(path, **arrays)
    return str(path)


# Image folders ---------------------------------------------------------------------


def test_folder_leaves_out_hidden_files_and_folders(tmp_path):
    """macOS's ._name.jpg and .DS_Store, Jupyter's .ipynb_checkpoints: not classes, not images."""
    for name in ("a", "b"):
        _save(str(tmp_path / name / "0.png"), Image.fromarray(PIXELS))
    _save(str(tmp_path / ".ipynb_checkpoints" / "0.png"), Image.fromarray(PIXELS))
    _save(str(tmp_path / "a" / ".ipynb_checkpoints" / "0-checkpoint.png"), Image.fromarray(PIXELS))
    (tmp_path / "a" / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (tmp_path / "a" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    paths, labels, names, skipped = data.list_image_folder(str(tmp_path))
    assert names == ["a", "b"]
    assert sorted(os.path.relpath(p, tmp_path) for p in paths) == ["a/0.png", "b/0.png"]
    assert list(labels[np.argsort(paths)]) == [0, 1] and skipped == []


def test_folder_says_which_files_it_leaves_out_as_not_images(tmp_path, capsys):
    # TIFFs (which predict reads, but TensorFlow's decoder cannot) were left out of
    # training without a word; hidden files still are.
    for name in ("a", "b"):
        _save(str(tmp_path / name / "0.png"), Image.fromarray(PIXELS))
    _save(str(tmp_path / "a" / "1.tif"), Image.fromarray(PIXELS))
    _save(str(tmp_path / "b" / "2.TIFF"), Image.fromarray(PIXELS))
    (tmp_path / "b" / "notes.txt").write_text("labels checked")
    (tmp_path / "b" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    capsys.readouterr()
    paths, _, _, _ = data.list_image_folder(str(tmp_path))
    assert len(paths) == 2
    printed = capsys.readouterr().out
    assert "3 file(s)" in printed and ".tif, .tiff, .txt" in printed and ".DS_Store" not in printed
    for name in ("1.tif", "2.TIFF", "notes.txt"):
        for folder in ("a", "b"):
            if (tmp_path / folder / name).exists():
                os.remove(tmp_path / folder / name)
    data.list_image_folder(str(tmp_path))
    assert capsys.readouterr().out == ""  # nothing left out, nothing said


def test_folder_order_and_so_split_are_those_of_earlier_versions(tmp_path):
    """Images by folder, then by name, as before hidden entries were left out: the
    validation split of a run trained earlier stays the one `keras-vit evaluate` takes."""
    for name in ("a/z.png", "a/sub/x.png", "a/b.png", "b/0.png"):
        _save(str(tmp_path / name), Image.fromarray(PIXELS))
    paths, _, _, _ = data.list_image_folder(str(tmp_path))
    assert [os.path.relpath(p, tmp_path) for p in paths] == [
        "a/b.png",
        "a/z.png",
        "a/sub/x.png",
        "b/0.png",
    ]


def test_folder_reads_every_extension_in_any_case_and_every_pixel_format(tmp_path):
    """Upper-case extensions, .jpeg, .webp, CMYK JPEG, 16-bit, palette, RGBA, LA and
    animated images, a class name with spaces and accents, nested folders: all are read
    by the pipeline, as RGB of `image_size`."""
    image = Image.fromarray(PIXELS)
    files = {
        "café au lait/A.JPG": (image, dict(format="JPEG")),
        "café au lait/b.jpeg": (image.convert("CMYK"), dict(format="JPEG")),
        "café au lait/deeper/still/c.WEBP": (image, dict(format="WEBP")),
        "plain/d.PNG": (Image.fromarray(PIXELS[..., 0].astype("uint16") * 257), {}),
        "plain/e.png": (image.convert("P"), {}),
        "plain/f.png": (image.convert("RGBA"), {}),
        "plain/g.png": (image.convert("LA"), {}),
        "plain/h.gif": (image.convert("P"), dict(save_all=True, append_images=[image])),
        "plain/i.bmp": (image, {}),
    }
    for name, (picture, kwargs) in files.items():
        _save(str(tmp_path / name), picture, **kwargs)
    loaded = data.load(str(tmp_path), image_size=8, validation_fraction=0.2)
    assert loaded.class_names == ["café au lait", "plain"]
    assert loaded.train_size + loaded.validation_size == len(files)
    images = [x for x, _ in data.eval_pipeline(loaded, 4, split="train")] + [
        x for x, _ in data.eval_pipeline(loaded, 4)
    ]
    assert sum(len(x) for x in images) == len(files)
    assert all(tuple(x.shape[1:]) == (8, 8, 3) for x in images)


def test_folder_file_that_only_pillow_reads_is_named(tmp_path):
    """A TIFF named .png and a 1-bit BMP open in Pillow but not in TensorFlow's decoder,
    which the pipeline runs: named at load time (not a crash in the middle of training),
    or skipped and counted with skip_corrupt=True."""
    for name in ("a", "b"):
        _save(str(tmp_path / name / "ok.png"), Image.fromarray(PIXELS))
    _save(str(tmp_path / "a" / "tiff.png"), Image.fromarray(PIXELS), format="TIFF")
    _save(str(tmp_path / "b" / "mono.bmp"), Image.fromarray(PIXELS).convert("1"))
    with pytest.raises(ValueError, match=r"Cannot read the image .*tiff\.png.*skip_corrupt"):
        data.list_image_folder(str(tmp_path))
    paths, _, _, skipped = data.list_image_folder(str(tmp_path), skip_corrupt=True)
    assert sorted(os.path.basename(p) for p in skipped) == ["mono.bmp", "tiff.png"]
    assert sorted(os.path.relpath(p, tmp_path) for p in paths) == ["a/ok.png", "b/ok.png"]


def test_folder_class_without_images_is_refused(tmp_path):
    """An empty class sub-folder (or one of .tif files only) would be a class never seen."""
    for name in ("a", "b"):
        _save(str(tmp_path / name / "0.png"), Image.fromarray(PIXELS))
    (tmp_path / "empty").mkdir()
    _save(str(tmp_path / "tiffs" / "0.tif"), Image.fromarray(PIXELS))
    with pytest.raises(
        ValueError, match=r"2 class\(es\) without a readable one: \['empty', 'tiffs'\]"
    ):
        data.list_image_folder(str(tmp_path))


# Checkpoints cut short ---------------------------------------------------------------


class _Killed(Exception):
    """Stands for a SIGKILL in the middle of writing a file."""


def _cut_short(*args, **kwargs):
    path = kwargs.get("filepath", args[0] if args else None)
    with open(path, "wb") as file:
        file.write(b"\x89HDF\r\n\x1a\n truncated")  # what a killed write leaves
    raise _Killed


def _compiled_model():
    model = _tiny_model()
    training.compile_model(model, total_steps=4, jit_compile=False, streams=1)
    return model


def _callback(kind, output, model):
    """The callback of class `kind` among build_callbacks(output)'s, set to `model`."""
    callback = next(c for c in training.build_callbacks(str(output)) if isinstance(c, kind))
    callback.set_model(model)
    return callback


def test_backup_killed_while_written_keeps_the_previous_one(tmp_path, monkeypatch):
    model = _compiled_model()
    callback = _callback(keras.callbacks.BackupAndRestore, tmp_path, model)
    callback._save_model()
    path = tmp_path / "backup" / "latest.weights.h5"
    before = path.read_bytes()
    monkeypatch.setattr(model, "save_weights", _cut_short)
    with pytest.raises(_Killed):
        callback._save_model()
    assert path.read_bytes() == before
    monkeypatch.undo()
    model.load_weights(str(path))  # still a whole backup


def test_best_model_killed_while_written_keeps_the_previous_one(tmp_path, monkeypatch):
    model = _compiled_model()
    callback = _callback(keras.callbacks.ModelCheckpoint, tmp_path, model)
    callback.on_epoch_end(0, {"val_accuracy": 0.5})
    path = tmp_path / "best.keras"
    before = path.read_bytes()
    monkeypatch.setattr(model, "save", _cut_short)
    with pytest.raises(_Killed):
        callback.on_epoch_end(1, {"val_accuracy": 0.75})
    assert path.read_bytes() == before
    monkeypatch.undo()
    keras.models.load_model(str(path))


def test_weights_made_nan_by_a_step_are_not_checkpointed(tmp_path):
    """An update can turn the weights NaN while the step's loss, computed before it, is
    still finite: neither the backup nor best.keras takes such weights."""
    model = _compiled_model()
    backup = _callback(keras.callbacks.BackupAndRestore, tmp_path, model)
    best = _callback(keras.callbacks.ModelCheckpoint, tmp_path, model)
    backup._save_model()
    best.on_epoch_end(0, {"loss": 1.0, "val_accuracy": 0.5})
    saved = [(tmp_path / name).read_bytes() for name in ("backup/latest.weights.h5", "best.keras")]
    variable = model.trainable_variables[0]
    variable.assign(np.full(variable.shape, np.nan, "float32"))
    backup._save_model()
    best.on_epoch_end(1, {"loss": 1.0, "val_accuracy": 0.75})
    assert [
        (tmp_path / name).read_bytes() for name in ("backup/latest.weights.h5", "best.keras")
    ] == saved


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
    return _npz(tmp_path_factory.mktemp("npz") / "tiny.npz", np.arange(3))


def _stored_args(output):
    """The arguments of the run in `output`, as `keras-vit train --resume` takes them."""
    import argparse

    from keras_vit.commands import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--output", output])
    with open(os.path.join(output, "run.json"), encoding="utf-8") as file:
        for name, value in json.load(file)["args"].items():
            setattr(args, name, value)
    return args


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(backup_steps=-3), "backup_steps.*non-negative integer.*-3"),
        (dict(backup_steps=2.5), "backup_steps.*2.5"),
        (dict(output=""), "output.*folder path.*''"),
        (dict(output=None), "output.*None"),
    ],
)
def test_build_callbacks_checks_its_arguments(kwargs, match, tmp_path):
    """A negative backup_steps was taken as "a backup after every step"."""
    with pytest.raises(ValueError, match=match):
        training.build_callbacks(**(dict(output=str(tmp_path)) | kwargs))


def test_resumed_run_keeps_a_better_best_model(tiny_npz, tmp_path):
    """A resumed run replaces best.keras only with a model better than the best of the
    epochs before the kill (history.csv), not with whatever its first epoch gives."""
    from keras_vit.commands import train

    out = tmp_path / "run"
    argv = ["train", "--data", tiny_npz, *TINY_RUN, "--epochs", "2", "--output", str(out)]
    assert main(argv) == 0
    # As if killed in epoch 2, after a first epoch that reached 1.0 (no better one exists).
    rows = (out / "history.csv").read_text().splitlines()
    first = rows[1].split(",")
    first[rows[0].split(",").index("val_accuracy")] = "1.0"
    (out / "history.csv").write_text(rows[0] + "\n" + ",".join(first) + "\n")
    before = (out / "best.keras").read_bytes()
    loaded = data.load(tiny_npz, image_size=16)
    validation = data.eval_pipeline(loaded, 16)
    model = train.build_model("vit-test", 16, 3)
    training.compile_model(model, total_steps=6, jit_compile=False, streams=1)
    # Epoch 2 (3 steps of 16 images) after the 3 steps of epoch 1.
    train._fit(model, loaded, _stored_args(str(out)), str(out), 3, 1, 2, 3, validation, 0)
    assert (out / "best.keras").read_bytes() == before


def _kill_when_complete(monkeypatch):
    """Makes `keras-vit train` stop as if killed just before run.json records it complete."""
    from keras_vit.commands import train

    write = train._write_run_file

    def killed_when_complete(args, completed, extra=None):
        if completed:
            raise _Killed
        return write(args, completed, extra)

    monkeypatch.setattr(train, "_write_run_file", killed_when_complete)


def test_kill_after_training_before_the_run_is_recorded_complete(tiny_npz, tmp_path, monkeypatch):
    """The backup goes only once run.json says complete: a kill in between leaves a run
    that --resume finishes (not one that trains again from step 0), and a backup that
    cannot be read is a usage error that deletes nothing."""
    out = tmp_path / "run"
    _kill_when_complete(monkeypatch)
    argv = ["train", "--data", tiny_npz, *TINY_RUN, "--epochs", "1", "--output", str(out)]
    argv += ["--backup-steps", "1"]
    with pytest.raises(_Killed):
        main(argv)
    monkeypatch.undo()
    assert json.loads((out / "run.json").read_text())["completed"] is False
    assert (out / "backup" / "latest.weights.h5").is_file()

    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    (broken / "backup" / "latest.weights.h5").write_bytes(b"\x89HDF\r\n\x1a\n truncated")
    listing = sorted(os.listdir(broken))
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        assert main(["train", "--output", str(broken), "--resume", "--quiet"]) == 2
    assert "backup" in stderr.getvalue() and "latest.weights.h5" in stderr.getvalue()
    assert sorted(os.listdir(broken)) == listing

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["train", "--output", str(out), "--resume", "--quiet"]) == 0
    assert "resuming at step 3" in stdout.getvalue()  # 1 epoch of 48 images in batches of 16
    assert json.loads((out / "run.json").read_text())["completed"] is True
    assert not (out / "backup").exists()


def test_stop_while_a_resumed_run_exports_keeps_the_earlier_saved_model(
    tiny_npz, tmp_path, monkeypatch
):
    """A run stopped after its export and resumed exports again at its end: stopped
    (Ctrl-C) in the middle of that second export, it still has the first SavedModel."""
    import tensorflow as tf

    from keras_vit import export

    out = tmp_path / "run"
    _kill_when_complete(monkeypatch)
    argv = ["train", "--data", tiny_npz, *TINY_RUN, "--epochs", "1", "--output", str(out)]
    with pytest.raises(_Killed):
        main(argv)
    monkeypatch.undo()
    (out / "saved_model" / "notes.txt").write_text("mine")
    before = (out / "saved_model" / "saved_model.pb").read_bytes()

    archive = export._saved_model_archive

    def stopped_while_writing(*args, **kwargs):
        archive(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "_saved_model_archive", stopped_while_writing)
    assert main(["train", "--output", str(out), "--resume", "--quiet"]) == 130
    monkeypatch.undo()
    assert (out / "saved_model" / "saved_model.pb").read_bytes() == before
    assert (out / "saved_model" / "notes.txt").read_text() == "mine"
    served = tf.saved_model.load(str(out / "saved_model")).signatures["serving_default"]
    assert "probabilities" in served.structured_outputs

    assert main(["train", "--output", str(out), "--resume", "--quiet"]) == 0
    assert json.loads((out / "run.json").read_text())["completed"] is True
    assert (out / "saved_model" / "notes.txt").read_text() == "mine"
    assert sorted(n for n in os.listdir(out) if n.startswith(".")) == []


def test_history_skips_rows_cut_short(tmp_path):
    """A kill while CSVLogger wrote a row leaves it cut short, and the resumed run's
    first row is appended to it: the run's end (history.json, curves.png) skips it."""
    from keras_vit.commands.train import _history_from_csv

    path = tmp_path / "history.csv"
    path.write_text(
        "epoch,accuracy,loss,val_accuracy,val_loss\n"
        "0,0.5,1.0,0.5,1.0\n"
        "1,0.6,0.9,0.6,0.9\n"
        "2,0.72,2,0.7,0.8,0.7,0.8,0.7,0.8\n"  # "2,0.7" cut short, then the resumed row
        "\n"
        "x\n"
    )
    history = _history_from_csv(str(path))
    assert history == {
        "epoch": [0.0, 1.0],
        "accuracy": [0.5, 0.6],
        "loss": [1.0, 0.9],
        "val_accuracy": [0.5, 0.6],
        "val_loss": [1.0, 0.9],
    }


def test_resume_from_a_backup_needs_no_weights_file(tiny_npz, tmp_path, monkeypatch):
    """A run started from --weights and interrupted resumes from its backup, which holds
    every weight: the checkpoint file may be gone by then (a cleaned /tmp, a moved file)."""
    from keras_vit.commands import train

    checkpoint = tmp_path / "start.keras"
    train.build_model("vit-test", 16, 3).save(str(checkpoint))
    out = tmp_path / "run"
    _kill_when_complete(monkeypatch)
    argv = ["train", "--data", tiny_npz, *TINY_RUN, "--epochs", "1", "--output", str(out)]
    with pytest.raises(_Killed):
        main([*argv, "--backup-steps", "1", "--weights", str(checkpoint)])
    monkeypatch.undo()
    checkpoint.unlink()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["train", "--output", str(out), "--resume", "--quiet"]) == 0
    assert "resuming at step 3" in stdout.getvalue()
    assert json.loads((out / "run.json").read_text())["completed"] is True


def _finite_h5(path):
    import h5py

    arrays = []

    def collect(_, item):
        if isinstance(item, h5py.Dataset):
            arrays.append(item[()])

    with h5py.File(path, "r") as file:
        file.visititems(collect)
    return bool(arrays) and all(np.all(np.isfinite(a)) for a in arrays if a.dtype.kind == "f")


def test_diverged_run_is_a_usage_error_that_keeps_the_good_weights(tiny_npz, tmp_path, capsys):
    """--lr far too high: the loss becomes NaN. The run is not recorded complete with a NaN
    model.keras; the backup and best.keras keep weights from before the NaN step."""
    out = tmp_path / "run"
    argv = ["train", "--data", tiny_npz, *TINY_RUN, "--epochs", "2", "--output", str(out)]
    assert main([*argv, "--backup-steps", "1", "--lr", "1e9"]) == 2
    err = capsys.readouterr().err
    assert "diverged" in err and "--lr 1e9" in err.replace("1000000000.0", "1e9")
    assert "Traceback" not in err
    assert not (out / "model.keras").exists()
    assert json.loads((out / "run.json").read_text())["completed"] is False
    assert _finite_h5(str(out / "backup" / "latest.weights.h5"))
    if (out / "best.keras").exists():
        model = keras.models.load_model(str(out / "best.keras"))
        assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_class_names_are_written_before_training(tmp_path, monkeypatch):
    """classes.json is there from the start: best.keras of a run killed mid-training is
    evaluated and predicted with its class names (it was written only at the end)."""
    from keras_vit.commands import train

    def killed(*args, **kwargs):
        raise _Killed

    monkeypatch.setattr(train, "_fit", killed)
    npz = _npz(tmp_path / "data.npz", np.arange(3), ["cat", "dog", "fox"])
    out = tmp_path / "run"
    with pytest.raises(_Killed):
        main(["train", "--data", npz, *TINY_RUN, "--epochs", "1", "--output", str(out)])
    assert json.loads((out / "classes.json").read_text()) == ["cat", "dog", "fox"]


def test_resume_refuses_data_that_changed(tmp_path, monkeypatch, capsys):
    """--data given more images (or other classes) since the run started: another
    schedule and other batches, which a resumed run would mix with the first ones."""
    npz = _npz(tmp_path / "data.npz", np.arange(3), ["cat", "dog", "fox"])
    out = tmp_path / "run"
    _kill_when_complete(monkeypatch)
    argv = ["train", "--data", npz, *TINY_RUN, "--epochs", "1", "--output", str(out)]
    with pytest.raises(_Killed):
        main([*argv, "--backup-steps", "1"])
    monkeypatch.undo()
    _npz(tmp_path / "data.npz", np.arange(3), ["cat", "dog", "emu"])
    listing = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert main(["train", "--output", str(out), "--resume", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "class_names 3 (cat, dog, fox) then, 3 (cat, dog, emu) now" in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == listing


def test_second_worker_resumes_with_the_run_arguments(tmp_path, monkeypatch):
    """`keras-vit train --output DIR --resume` on every worker of a two-worker run: the
    second worker took its defaults (another model) instead of the run's arguments, and
    both workers failed on a collective op of mismatched shapes."""
    from keras_vit.commands import train

    stored = dict(model="vit-test", data="digits", image_size=16, batch_size=16, epochs=2)
    (tmp_path / "run.json").write_text(json.dumps({"args": stored, "completed": False}))
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"index": 1}}))
    calls = []
    monkeypatch.setattr(train, "train", lambda args, **kwargs: calls.append((args, kwargs)) or 0)
    assert main(["train", "--output", str(tmp_path), "--resume", "--quiet"]) == 0
    ((args, kwargs),) = calls
    assert {name: getattr(args, name) for name in stored} == stored
    assert kwargs == {"resume": True}
    (tmp_path / "run.json").write_text(json.dumps({"args": stored, "completed": True}))
    assert main(["train", "--output", str(tmp_path), "--resume", "--quiet"]) == 0
    assert len(calls) == 1  # a complete run: nothing to train


@pytest.mark.parametrize(
    "missing, hint",
    [
        ("tensorflow_datasets", "pip install tensorflow-datasets"),
        (
            "importlib_resources",
            "cannot import importlib_resources (pip install importlib_resources)",
        ),
    ],
)
def test_tfds_import_error_names_what_to_install(missing, hint, monkeypatch):
    """TensorFlow Datasets installed but missing one of its own imports: pip install
    tensorflow-datasets, which is there already, was the hint."""
    from keras_vit.cli import UsageError
    from keras_vit.commands._common import load_data

    def load(*args, **kwargs):
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    monkeypatch.setattr(data, "load", load)
    with pytest.raises(UsageError, match="--data 'tfds:mnist' needs") as error:
        load_data("tfds:mnist", (16, 16))
    assert hint in str(error.value)


# keras-vit evaluate: the data's classes and the model's ------------------------------


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory):
    """A tiny model with a random (not zero) head and its classes.json."""
    folder = tmp_path_factory.mktemp("trained")
    model = _tiny_model()
    head = model.get_layer("head")
    head.set_weights([np.random.default_rng(1).normal(size=w.shape) for w in head.get_weights()])
    model.save(str(folder / "model.keras"))
    (folder / "classes.json").write_text(json.dumps(["cat", "dog", "fox"]))
    return str(folder)


def _evaluate(folder, npz, capsys):
    code = main(["evaluate", "--model", folder, "--data", npz])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_evaluate_matches_classes_by_name(trained_folder, tmp_path, capsys):
    """The same images and classes, stored in another order: the same loss and accuracy."""
    same = _npz(tmp_path / "same.npz", np.arange(3), ["cat", "dog", "fox"])
    reordered = _npz(tmp_path / "reordered.npz", np.array([2, 0, 1]), ["dog", "fox", "cat"])
    code, expected, err = _evaluate(trained_folder, same, capsys)
    assert code == 0, err
    code, found, err = _evaluate(trained_folder, reordered, capsys)
    assert code == 0, err
    assert found.splitlines()[-1] == expected.splitlines()[-1]
    assert "matched to the model's 3 by name" in found


def test_evaluate_refuses_classes_the_model_has_not(trained_folder, tmp_path, capsys):
    other = _npz(tmp_path / "other.npz", np.arange(3), ["cat", "emu", "fox"])
    code, _, err = _evaluate(trained_folder, other, capsys)
    assert code == 2 and "--data" in err and "'emu'" in err and "Traceback" not in err


def test_evaluate_splits_a_folder_with_the_run_seed(trained_folder, tmp_path, monkeypatch):
    """A run trained with --seed 5 held out another 20% of a folder than seed 0 does:
    evaluating with seed 0 would score images it trained on."""
    from keras_vit.commands import _common

    run = tmp_path / "run"
    shutil.copytree(trained_folder, run)
    (run / "run.json").write_text(json.dumps({"args": {"seed": 5}, "completed": True}))
    seeds = []
    load_data = _common.load_data

    def recording(*args, **kwargs):
        seeds.append(kwargs.get("seed"))
        return load_data(*args, **kwargs)

    monkeypatch.setattr(_common, "load_data", recording)
    npz = _npz(tmp_path / "d.npz", np.arange(3), ["cat", "dog", "fox"])
    assert main(["evaluate", "--model", str(run), "--data", npz]) == 0
    assert main(["evaluate", "--model", str(run / "model.keras"), "--data", npz]) == 0
    assert main(["evaluate", "--model", str(run), "--data", npz, "--seed", "2"]) == 0
    assert main(["evaluate", "--model", trained_folder, "--data", npz]) == 0  # no run.json
    assert seeds == [5, 5, 2, 0]
