"""Export as a user gets it wrong: class names that cannot be mapped to
classes, models without a known input or ending in their own softmax, paths
under a file, an overwrite that fails half-way (on the local file system and
on TensorFlow's in-memory one, standing for gs://), and the `keras-vit export`
command's checks of --output and --class-names.

Expected values come from the Keras model itself (the contract of a
SavedModel is to reproduce it) or are written out here.
"""

import json
import os
import posixpath
import uuid
import warnings

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import export_saved_model, export_tflite
from keras_vit.cli import main as cli_main

pytestmark = pytest.mark.tensorflow_only

tf = pytest.importorskip("tensorflow")

# Smaller than conftest's TINY: these tests are about the errors, not the model.
TINY = dict(
    image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=5
)
NAMES = ["cat", "dog", "fish", "bird", "frog"]


def tiny_model(**kwargs):
    """The tiny ViT with a random head (it is zero-initialised)."""
    model = keras_vit.VisionTransformer(**{**TINY, **kwargs})
    if kwargs.get("num_classes", TINY["num_classes"]):
        rng = np.random.default_rng(0)
        for weight in model.get_layer("head").weights:
            weight.assign(rng.normal(0, 0.5, size=weight.shape).astype("float32"))
    return model


def float_images(count=2, size=32, seed=1):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, size=(count, size, size, 3)).astype("float32")


def serve_float(path, images):
    outputs = tf.saved_model.load(path).signatures["serving_float"](images=tf.constant(images))
    return {name: value.numpy() for name, value in outputs.items()}


# Class names ------------------------------------------------------------------


@pytest.mark.parametrize(
    "class_names",
    [set(NAMES), dict.fromkeys(NAMES, 0), (name for name in NAMES), 5],
    ids=["set", "dict", "generator", "int"],
)
def test_class_names_without_an_order_are_refused(class_names, tmp_path):
    # A set or a dict has no index order (a set's changes from run to run), and a
    # generator was used up by the check; an int is not names at all.
    kind = type(class_names).__name__
    with pytest.raises(
        TypeError, match=rf"`class_names` must be a list of strings.*of type {kind}"
    ):
        export_saved_model(tiny_model(), str(tmp_path / "sm"), class_names=class_names)
    assert not os.path.exists(tmp_path / "sm")


def test_repeated_class_names_are_refused(tmp_path):
    names = ["cat", "dog", "cat", "bird", "dog"]
    with pytest.raises(ValueError, match=r"name each class once.*\['cat', 'dog'\] more than once"):
        export_saved_model(tiny_model(), str(tmp_path / "sm"), class_names=names)
    assert not os.path.exists(tmp_path / "sm")


@pytest.mark.parametrize(
    "class_names", [tuple(NAMES), np.array(NAMES)], ids=["tuple", "numpy_array"]
)
def test_ordered_class_names_other_than_a_list_are_taken(class_names, tmp_path):
    model = tiny_model()
    images = float_images()
    path = export_saved_model(model, str(tmp_path / "sm"), class_names=class_names, top_k=2)
    outputs = serve_float(path, images)
    best = np.argsort(-keras.ops.convert_to_numpy(model(images)), axis=-1)[:, :2]
    np.testing.assert_array_equal(outputs["top_k_class_names"].astype(str), np.array(NAMES)[best])


# Models -----------------------------------------------------------------------


def test_a_model_without_a_known_input_gets_a_clear_error(tmp_path):
    class Subclassed(keras.Model):
        def call(self, images):
            return images

    unbuilt = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(3)])
    for model, kind in ((unbuilt, "Sequential"), (Subclassed(), "Subclassed")):
        message = rf"`model` must be a functional.*type {kind}"
        with pytest.raises(ValueError, match=message):
            export_saved_model(model, str(tmp_path / "sm"))
        with pytest.raises(ValueError, match=message):
            export_tflite(model, str(tmp_path / "m.tflite"))
    assert os.listdir(tmp_path) == []


def _dense_then(layer):
    """A plain functional model: Flatten, Dense (the logits), then `layer`."""
    inputs = keras.Input((8, 8, 3))
    logits = keras.layers.Dense(4, name="logits")(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, layer(logits)), keras.Model(inputs, logits)


@pytest.mark.parametrize(
    "layer",
    [lambda: keras.layers.Softmax(), lambda: keras.layers.Activation("softmax")],
    ids=["Softmax", "Activation"],
)
def test_a_final_softmax_layer_is_not_softmaxed_again(layer, tmp_path):
    model, logits_model = _dense_then(layer())
    images = float_images(size=8)
    probabilities = keras.ops.convert_to_numpy(model(images))
    logits = keras.ops.convert_to_numpy(logits_model(images))
    outputs = serve_float(export_saved_model(model, str(tmp_path / "sm")), images)
    np.testing.assert_allclose(outputs["probabilities"], probabilities, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outputs["logits"], logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outputs["probabilities"].sum(axis=-1), 1.0, rtol=1e-5)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf.lite.Interpreter's deprecation notice
        interpreter = tf.lite.Interpreter(
            model_path=export_tflite(model, str(tmp_path / "m.tflite"))
        )
    interpreter.resize_tensor_input(0, images.shape)
    interpreter.allocate_tensors()
    lite = interpreter.get_signature_runner("serving_default")(images=images)
    np.testing.assert_allclose(lite["probabilities"], probabilities, atol=1e-5)


def _wrapped(vit, kind):
    """`vit` behind a layer that scales 0..255 images, or alone in a Sequential."""
    if kind == "sequential":
        return keras.Sequential([keras.Input((32, 32, 3)), vit])
    inputs = keras.Input((32, 32, 3))
    return keras.Model(inputs, vit(keras.layers.Rescaling(1 / 127.5, offset=-1)(inputs)))


@pytest.mark.parametrize("kind", ["rescaling", "sequential"])
def test_a_vit_called_inside_another_model_keeps_its_head(kind, tmp_path):
    images = np.random.default_rng(2).uniform(0, 255, size=(2, 32, 32, 3)).astype("float32")
    # A softmax head: its output is the probabilities, its pre-activation the logits.
    vit = tiny_model(classifier_activation="softmax")
    model = _wrapped(vit, kind)
    outputs = serve_float(export_saved_model(model, str(tmp_path / "softmax")), images)
    np.testing.assert_allclose(outputs["probabilities"], model(images), rtol=1e-5, atol=1e-6)
    scaled = images / 127.5 - 1 if kind == "rescaling" else images
    features = keras.Model(vit.inputs[0], vit.get_layer("head").input)(scaled)
    kernel, bias = (keras.ops.convert_to_numpy(w) for w in vit.get_layer("head").weights)
    logits = keras.ops.convert_to_numpy(features) @ kernel + bias
    np.testing.assert_allclose(outputs["logits"], logits, rtol=1e-4, atol=1e-5)
    # No head (num_classes=0): features, not logits with a softmax of them.
    model = _wrapped(tiny_model(num_classes=0), kind)
    outputs = serve_float(export_saved_model(model, str(tmp_path / "features")), images)
    assert sorted(outputs) == ["features"]
    np.testing.assert_allclose(outputs["features"], model(images), rtol=1e-5, atol=1e-5)


def test_tflite_of_a_mixed_precision_vit_inside_another_model(tmp_path):
    # TFLite has no bfloat16 kernels: the float32 copy must reach the inner model's layers.
    model = _wrapped(tiny_model(dtype="mixed_bfloat16"), "rescaling")
    float32_model = _wrapped(tiny_model(), "rescaling")
    float32_model.set_weights(model.get_weights())
    images = np.random.default_rng(3).uniform(0, 255, size=(2, 32, 32, 3)).astype("float32")
    path = export_tflite(model, str(tmp_path / "mixed.tflite"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf.lite.Interpreter's deprecation notice
        interpreter = tf.lite.Interpreter(model_path=path)
    interpreter.resize_tensor_input(0, images.shape)
    interpreter.allocate_tensors()
    outputs = interpreter.get_signature_runner("serving_default")(images=images)
    expected = keras.ops.convert_to_numpy(float32_model(images))
    np.testing.assert_allclose(outputs["logits"], expected, rtol=0, atol=1e-4)


# Paths -------------------------------------------------------------------------


def test_a_path_under_a_file_is_refused_before_exporting(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    model = tiny_model()
    message = r"'.*notes.txt/vit[^']*' cannot be written: '.*notes.txt' is a file, not a folder"
    with pytest.raises(ValueError, match="`path` " + message):
        export_saved_model(model, str(tmp_path / "notes.txt" / "vit"))
    with pytest.raises(ValueError, match="`path` " + message):
        export_tflite(model, str(tmp_path / "notes.txt" / "vit" / "m.tflite"))
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    # A .tflite path ending in a separator names a folder.
    with pytest.raises(ValueError, match=r"must be the .tflite file to write; .* ends in a path"):
        export_tflite(model, str(tmp_path / "m.tflite") + os.sep)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


class _Failure(Exception):
    """Stands for an export stopped while the new SavedModel was moved in."""


def test_a_failed_overwrite_keeps_the_previous_export(tmp_path, monkeypatch):
    folder = tmp_path / "served"
    folder.mkdir()
    (folder / "README.txt").write_text("keep me")
    images = float_images()
    old, new = tiny_model(), tiny_model(num_layers=2)
    expected = keras.ops.convert_to_numpy(old(images))
    export_saved_model(old, str(folder), overwrite=True)

    rename, failed = os.rename, []

    def failing_rename(source, target):
        # Once: the first move of a variables folder into `folder`, which the
        # old SavedModel's variables have been moved out of.
        into_folder = os.path.dirname(target) == str(folder)
        if os.path.basename(source) == "variables" and into_folder and not failed:
            failed.append(source)
            raise _Failure("stopped while moving the new variables in")
        rename(source, target)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(_Failure):
        export_saved_model(new, str(folder), overwrite=True)
    monkeypatch.undo()

    np.testing.assert_allclose(serve_float(str(folder), images)["logits"], expected, atol=1e-5)
    assert (folder / "README.txt").read_text() == "keep me"
    leftovers = [name for name in os.listdir(folder) if name.startswith(".")]
    assert leftovers == []
    assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []


def test_an_overwrite_never_pairs_a_graph_with_other_variables(tmp_path, monkeypatch):
    # A process killed between two steps leaves the folder as that step left it:
    # after each step, a saved_model.pb must sit beside the variables of its own
    # export (or be absent, so the folder does not look like a SavedModel).
    folder = tmp_path / "served"
    export_saved_model(tiny_model(), str(folder))
    old = {name: os.stat(folder / name).st_ino for name in ("saved_model.pb", "variables")}
    rename = os.rename
    states = []

    def recording_rename(source, target):
        rename(source, target)
        names = os.listdir(folder)
        if "saved_model.pb" in names:
            same = [os.stat(folder / name).st_ino == old[name] for name in old if name in names]
            states.append((len(same), len(set(same))))

    new = tiny_model(num_layers=2)
    monkeypatch.setattr(os, "rename", recording_rename)
    export_saved_model(new, str(folder), overwrite=True)
    monkeypatch.undo()
    assert states, "the overwrite moved nothing into the folder"
    # Both entries there, and both of one export.
    assert all(state == (2, 1) for state in states), states
    images = float_images()
    expected = keras.ops.convert_to_numpy(new(images))
    np.testing.assert_allclose(serve_float(str(folder), images)["logits"], expected, atol=1e-5)


KILLED_EXPORT = r"""
import os, signal, sys
import keras_vit
from keras_vit import export
model = keras_vit.VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2,
                                    hidden_dim=16, mlp_dim=32, num_classes=5)
# Killed once the new SavedModel is written aside, before it is moved in.
export._move_in = lambda staging, path: os.kill(os.getpid(), signal.SIGKILL)
export.export_saved_model(model, sys.argv[1], overwrite=True)
"""


def test_what_killed_exports_left_is_removed_by_the_next_export(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "served"
    model = tiny_model()
    export_saved_model(model, str(folder))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow", PYTHONPATH=root)
    killed = subprocess.Popen([sys.executable, "-c", KILLED_EXPORT, str(folder)], env=env)
    assert killed.wait(timeout=240) == -9
    dead = killed.pid
    tag = keras_vit._leftovers.owner().split("-")[1]  # this host's
    (partial,) = [name for name in os.listdir(folder) if name.startswith(".partial-")]
    assert partial.startswith(f".partial-{dead}-{tag}-")
    assert (folder / partial / "saved_model.pb").exists()  # a whole export, left hidden
    left = [  # what other dead exports of this host leave: the old entries, a new target
        folder / f".previous-{dead}-{tag}-0123456789ab" / "variables",
        tmp_path / f".served.partial-{dead}-{tag}-0123456789ab" / "variables",
    ]
    kept = [  # a live process's, another host's, and an older version's names
        folder / f".partial-{os.getpid()}-{tag}-0123456789ab",
        folder / f".partial-{dead}-0badc0de-0123456789ab",
        folder / ".previous-0123456789ab",
        tmp_path / f".served2.partial-{dead}-{tag}-0123456789ab",
    ]
    for path in left + kept:
        path.mkdir(parents=True)
    export_saved_model(model, str(folder), overwrite=True)
    assert not (folder / partial).exists()
    assert [path for path in left if path.parent.exists()] == []
    assert all(path.exists() for path in kept)
    images = float_images()
    expected = keras.ops.convert_to_numpy(model(images))
    np.testing.assert_allclose(serve_float(str(folder), images)["logits"], expected, atol=1e-5)


# Remote file systems: TensorFlow's in-memory ram:// stands for gs:// ----------


def remote_root():
    """A new folder on TensorFlow's in-memory file system, which keras_vit reaches
    through tf.io.gfile, as it does gs://, s3:// and hdfs:// paths."""
    root = f"ram://keras_vit_test/{uuid.uuid4().hex}"
    tf.io.gfile.makedirs(root)
    return root


def hidden(folder):
    return [name for name in tf.io.gfile.listdir(folder) if name.startswith(".")]


def test_a_remote_overwrite_moves_the_saved_model_in_entry_by_entry(monkeypatch):
    # On Cloud Storage a folder's rename copies each file: not one step. So a
    # remote export moves entries, and whenever saved_model.pb is in the
    # target folder, the variables beside it are those of its own export.
    root = remote_root()
    path = f"{root}/models/served"  # models/ does not exist yet
    images = float_images()
    old, new = tiny_model(), tiny_model(num_layers=2)
    assert export_saved_model(old, path) == path
    np.testing.assert_allclose(
        serve_float(path, images)["logits"], keras.ops.convert_to_numpy(old(images)), atol=1e-5
    )
    assert hidden(f"{root}/models") == [] and hidden(path) == []
    with tf.io.gfile.GFile(f"{path}/notes.txt", "w") as file:
        file.write("keep me")

    rename, moved_in, moved_out, states = tf.io.gfile.rename, set(), set(), []

    def entry(file):  # the SavedModel entry `file` is or lies in, if it is in `path`
        inside = file.startswith(f"{path}/") and not file.startswith(f"{path}/.")
        return file[len(path) + 1 :].split("/")[0] if inside else None

    def recording_rename(source, target, overwrite=False):  # called for each file
        rename(source, target, overwrite)
        moved_in.update([entry(target)] if entry(target) else [])
        moved_out.update([entry(source)] if entry(source) else [])
        names = [name.rstrip("/") for name in tf.io.gfile.listdir(path)]
        if "saved_model.pb" in names:
            old_pair = not moved_in and "variables" not in moved_out
            states.append(old_pair or {"saved_model.pb", "variables"} <= moved_in)

    monkeypatch.setattr(tf.io.gfile, "rename", recording_rename)
    with pytest.raises(FileExistsError, match="already exists"):
        export_saved_model(new, path)
    export_saved_model(new, path, overwrite=True)
    monkeypatch.undo()
    assert {"saved_model.pb", "variables"} <= moved_in and "saved_model.pb" in moved_out
    assert states and all(states), states
    np.testing.assert_allclose(
        serve_float(path, images)["logits"], keras.ops.convert_to_numpy(new(images)), atol=1e-5
    )
    with tf.io.gfile.GFile(f"{path}/notes.txt") as file:
        assert file.read() == "keep me"
    assert hidden(f"{root}/models") == [] and hidden(path) == []


def test_a_failed_remote_overwrite_keeps_the_previous_export(monkeypatch):
    root = remote_root()
    path = f"{root}/served"
    images = float_images()
    old = tiny_model()
    expected = keras.ops.convert_to_numpy(old(images))
    export_saved_model(old, path)
    rename, failed = tf.io.gfile.rename, []

    def failing_rename(source, target, overwrite=False):
        # Once: the new variables' move into the folder the old ones have left.
        if target.startswith(f"{path}/variables/") and "/.partial-" in source and not failed:
            failed.append(source)
            raise _Failure("stopped while moving the new variables in")
        rename(source, target, overwrite)

    monkeypatch.setattr(tf.io.gfile, "rename", failing_rename)
    with pytest.raises(_Failure):
        export_saved_model(tiny_model(num_layers=2), path, overwrite=True)
    monkeypatch.undo()
    assert failed
    np.testing.assert_allclose(serve_float(path, images)["logits"], expected, atol=1e-5)
    assert hidden(path) == [] and hidden(root) == []


def test_a_remote_tflite_file_is_written_aside_and_renamed(monkeypatch):
    root = remote_root()
    path = f"{root}/lite/model.tflite"
    model = tiny_model()
    images = float_images()
    renames = []
    rename = tf.io.gfile.rename

    def recording_rename(source, target, overwrite=False):
        assert not tf.io.gfile.exists(target) or overwrite
        renames.append((posixpath.basename(source), target))
        rename(source, target, overwrite)

    monkeypatch.setattr(tf.io.gfile, "rename", recording_rename)
    export_tflite(model, path)
    with pytest.raises(FileExistsError, match=r"model.tflite.*overwrite=True"):
        export_tflite(model, path)
    export_tflite(model, path, overwrite=True)
    monkeypatch.undo()
    assert [target for _, target in renames] == [path, path]
    assert all(source.startswith(".model.tflite.partial-") for source, _ in renames)
    assert hidden(f"{root}/lite") == []
    with tf.io.gfile.GFile(path, "rb") as file, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf.lite.Interpreter's deprecation notice
        interpreter = tf.lite.Interpreter(model_content=file.read())
    runner = interpreter.get_signature_runner()
    np.testing.assert_allclose(
        runner(images=images[:1])["logits"],
        keras.ops.convert_to_numpy(model(images[:1])),
        atol=1e-4,
    )


def test_what_dead_remote_exports_left_is_removed_by_the_next_export():
    import subprocess
    import sys

    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait(timeout=60)
    tag = keras_vit._leftovers.owner().split("-")[1]  # this host's
    root = remote_root()
    path = f"{root}/served"
    left = [  # a dead process's staging folders, inside the target and beside it
        f"{path}/.partial-{ended.pid}-{tag}-0123456789ab",
        f"{path}/.previous-{ended.pid}-{tag}-0123456789ab",
        f"{root}/.served.partial-{ended.pid}-{tag}-0123456789ab",
    ]
    kept = [  # a live process's and another host's
        f"{path}/.partial-{os.getpid()}-{tag}-0123456789ab",
        f"{path}/.partial-{ended.pid}-0badc0de-0123456789ab",
    ]
    for folder in left + kept:
        tf.io.gfile.makedirs(f"{folder}/variables")
    export_saved_model(tiny_model(), path, overwrite=True)
    assert [folder for folder in left if tf.io.gfile.exists(folder)] == []
    assert all(tf.io.gfile.exists(folder) for folder in kept)


# The command line ---------------------------------------------------------------


def cli_error(capsys):
    """The error line `keras-vit export` printed to stderr (after its usage)."""
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if line.startswith("keras-vit export: error: ")]
    assert len(errors) == 1, lines
    return errors[0]


def test_cli_output_checks_match_the_api(tmp_path, capsys):
    model = tiny_model()
    model.save(tmp_path / "model.keras")
    base = ["export", "--model", str(tmp_path / "model.keras")]
    # An empty folder is written without --overwrite, as by export_saved_model.
    (tmp_path / "empty").mkdir()
    assert cli_main(base + ["--output", str(tmp_path / "empty")]) == 0
    images = float_images()
    expected = keras.ops.convert_to_numpy(model(images))
    logits = serve_float(str(tmp_path / "empty"), images)["logits"]
    np.testing.assert_allclose(logits, expected, atol=1e-5)
    capsys.readouterr()
    # A folder for a .tflite file: --overwrite would not help, so it is not suggested.
    command = base + ["--format", "tflite", "--output", str(tmp_path / "empty")]
    assert cli_main(command) == 2
    error = cli_error(capsys)
    assert "must be the .tflite file to write" in error and "--overwrite" not in error
    # A non-empty folder: --overwrite named, and what it replaces.
    assert cli_main(base + ["--output", str(tmp_path / "empty")]) == 2
    error = cli_error(capsys)
    assert "already exists: a folder that is not empty. Pass --overwrite" in error
    # A path under a file, for either format: refused before the model is read.
    (tmp_path / "notes.txt").write_text("keep me")
    for output_format in ("saved_model", "tflite"):
        command = base + ["--format", output_format, "--output", str(tmp_path / "notes.txt" / "m")]
        assert cli_main(command) == 2
        error = cli_error(capsys)
        assert "error: `--output` '" in error and "notes.txt' is a file, not a folder" in error


def test_cli_class_names_and_a_model_without_a_head(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    features = tiny_model(num_classes=0)
    features.save(run / "model.keras")
    (run / "classes.json").write_text(json.dumps(NAMES))
    # A classes.json beside a features model has no classes to name: not used.
    assert cli_main(["export", "--model", str(run), "--output", str(tmp_path / "sm")]) == 0
    images = float_images()
    outputs = serve_float(str(tmp_path / "sm"), images)
    assert sorted(outputs) == ["features"]
    expected = keras.ops.convert_to_numpy(features(images))
    np.testing.assert_allclose(outputs["features"], expected, atol=1e-5)
    capsys.readouterr()
    # Named on the command line, they are refused, the flag named.
    command = ["export", "--model", str(run), "--output", str(tmp_path / "other")]
    assert cli_main(command + ["--class-names", str(run / "classes.json")]) == 2
    assert "--class-names needs a model with a classification head" in cli_error(capsys)
    assert not os.path.exists(tmp_path / "other")


def test_cli_output_the_system_refuses_is_a_usage_error(tmp_path, monkeypatch, capsys):
    model = tiny_model()
    model.save(tmp_path / "model.keras")
    mkdir = os.mkdir

    def refusing_mkdir(path, *args, **kwargs):
        if str(tmp_path / "locked") in os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        mkdir(path, *args, **kwargs)

    (tmp_path / "locked").mkdir()
    monkeypatch.setattr(os, "mkdir", refusing_mkdir)
    output = str(tmp_path / "locked" / "vit")
    assert cli_main(["export", "--model", str(tmp_path / "model.keras"), "--output", output]) == 2
    error = cli_error(capsys)
    assert f"--output {output!r} cannot be written: Permission denied" in error
    assert os.listdir(tmp_path / "locked") == []


def test_cli_output_in_folders_not_made_yet(tmp_path):
    # As export_saved_model does: missing folders above --output are made.
    model = tiny_model()
    model.save(tmp_path / "model.keras")
    output = tmp_path / "exported" / "vit" / "1"
    assert (
        cli_main(["export", "--model", str(tmp_path / "model.keras"), "--output", str(output)]) == 0
    )
    images = float_images()
    expected = keras.ops.convert_to_numpy(model(images))
    np.testing.assert_allclose(serve_float(str(output), images)["logits"], expected, atol=1e-5)
