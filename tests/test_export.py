"""Export: SavedModel reloaded in a fresh TensorFlow-only process, TFLite, the
`keras-vit export` command, and `.keras` round trips with safe_mode=True.

References are computed here from the Keras model itself on inputs prepared
with `tf.image.resize` in this file (not with keras_vit's serving code): the
exported artefacts must reproduce the Keras model.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import export_saved_model, export_tflite
from keras_vit.cli import main as cli_main
from keras_vit.export import load_trained, resize_and_scale

pytestmark = pytest.mark.tensorflow_only

tf = pytest.importorskip("tensorflow")

CLASS_NAMES = [f"class_{index}" for index in range(10)]
# Batches of uint8 images of unusual sizes for the uint8 signature.
UINT8_SHAPES = {
    "model_size": (2, 32, 32, 3),
    "one_pixel": (1, 1, 1, 3),
    "tall": (1, 1000, 37, 3),
    "wide_batch": (3, 20, 90, 3),
}
# Tolerances of each TFLite mode against the Keras model (the test model's
# logits are of order 1): (logits, probabilities), absolute.
TFLITE_TOLERANCE = {None: (1e-4, 1e-4), "float16": (2e-3, 5e-4), "dynamic": (5e-2, 5e-3)}


def tiny_model(tiny_config, seed=0, **kwargs):
    """The tiny ViT with a random head (the head is zero-initialised)."""
    model = keras_vit.VisionTransformer(**{**tiny_config, **kwargs})
    rng = np.random.default_rng(seed)
    if kwargs.get("num_classes", tiny_config["num_classes"]):
        for weight in model.get_layer("head").weights:
            weight.assign(rng.normal(0, 0.05, size=weight.shape).astype("float32"))
    return model


def resized(images, size=(32, 32)):
    """What the uint8 signature documents: bilinear antialiased resize, x/127.5 - 1."""
    images = tf.image.resize(tf.cast(images, tf.float32), size, method="bilinear", antialias=True)
    return (images / 127.5 - 1.0).numpy()


def softmax(logits):
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


# A fresh process with TensorFlow alone ---------------------------------------

FRESH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tensorflow as tf

    saved_model, inputs, outputs = sys.argv[1:4]
    loaded = tf.saved_model.load(saved_model)
    data = dict(np.load(inputs))
    results, report = {}, {"signatures": sorted(loaded.signatures.keys())}
    for key, images in data.items():
        signature = "serving_default" if images.dtype == np.uint8 else "serving_float"
        output = loaded.signatures[signature](images=tf.constant(images))
        for name, value in output.items():
            value = value.numpy()
            results[f"{key}/{name}"] = value.astype(str) if value.dtype == object else value
        report[f"{key}/dtypes"] = {name: value.dtype.name for name, value in output.items()}

    def error(call):
        try:
            call()
        except Exception as exception:
            return [type(exception).__name__, str(exception)[:2000]]
        return None

    float_images = tf.zeros((1, 32, 32, 3), tf.float32)
    four_channels = tf.zeros((1, 32, 32, 4), tf.uint8)
    report["errors"] = {
        "float_into_uint8_method": error(lambda: loaded.serving_default(float_images)),
        "float_into_uint8_signature": error(
            lambda: loaded.signatures["serving_default"](images=float_images)
        ),
        "four_channels_method": error(lambda: loaded.serving_default(four_channels)),
        "four_channels_signature": error(
            lambda: loaded.signatures["serving_default"](images=four_channels)
        ),
        "wrong_size_float_signature": error(
            lambda: loaded.signatures["serving_float"](images=tf.zeros((1, 16, 16, 3)))
        ),
        "empty_image": error(
            lambda: loaded.signatures["serving_default"](images=tf.zeros((1, 0, 5, 3), tf.uint8))
        ),
        "one_image_without_batch_axis": error(
            lambda: loaded.signatures["serving_default"](images=tf.zeros((20, 30, 3), tf.uint8))
        ),
    }
    report["imported_keras_vit"] = "keras_vit" in sys.modules
    np.savez(outputs, **results)
    with open(outputs + ".json", "w") as file:
        json.dump(report, file)
    """
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Exports the tiny model, runs it in a fresh process, returns both sides."""
    config = dict(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)
    config["num_classes"] = 10
    keras.utils.set_random_seed(1)
    model = tiny_model(config)
    directory = tmp_path_factory.mktemp("export")
    path = str(directory / "saved_model")
    export_saved_model(model, path, class_names=CLASS_NAMES, top_k=3)

    rng = np.random.default_rng(0)
    inputs = {
        key: rng.integers(0, 256, size=shape, dtype=np.uint8) for key, shape in UINT8_SHAPES.items()
    }
    inputs["float"] = rng.uniform(-1, 1, size=(2, 32, 32, 3)).astype("float32")
    inputs["float_one"] = rng.uniform(-1, 1, size=(1, 32, 32, 3)).astype("float32")
    expected = {}
    for key, images in inputs.items():
        ready = resized(images) if images.dtype == np.uint8 else images
        expected[key] = keras.ops.convert_to_numpy(model(ready, training=False))
    np.savez(directory / "inputs.npz", **inputs)

    outputs = str(directory / "outputs.npz")
    script = directory / "fresh.py"
    script.write_text(FRESH_SCRIPT)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("PYTHONPATH", None)
    completed = subprocess.run(
        [sys.executable, str(script), path, str(directory / "inputs.npz"), outputs],
        capture_output=True,
        text=True,
        cwd=str(directory),
        env=env,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    with open(outputs + ".json") as file:
        report = json.load(file)
    return dict(
        path=path,
        inputs=inputs,
        expected=expected,
        results=dict(np.load(outputs)),
        report=report,
    )


def test_fresh_process_used_tensorflow_alone(served):
    assert served["report"]["imported_keras_vit"] is False
    assert served["report"]["signatures"] == ["serving_default", "serving_float"]


@pytest.mark.parametrize("key", sorted(UINT8_SHAPES))
def test_uint8_signature_matches_keras_on_resized_images(served, key):
    logits = served["results"][f"{key}/logits"]
    expected = served["expected"][key]
    assert logits.shape == (UINT8_SHAPES[key][0], 10)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(
        served["results"][f"{key}/probabilities"], softmax(expected), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("key", ["float", "float_one"])
def test_float_signature_matches_keras(served, key):
    np.testing.assert_allclose(
        served["results"][f"{key}/logits"], served["expected"][key], rtol=0, atol=1e-5
    )


def test_top_k_and_class_names(served):
    expected = softmax(served["expected"]["wide_batch"])
    indices = served["results"]["wide_batch/top_k_indices"]
    order = np.argsort(-expected, axis=-1)[:, :3]
    np.testing.assert_array_equal(indices, order)
    np.testing.assert_allclose(
        served["results"]["wide_batch/top_k_probabilities"],
        np.take_along_axis(expected, order, axis=-1),
        rtol=1e-5,
        atol=1e-6,
    )
    names = served["results"]["wide_batch/top_k_class_names"].astype(str)
    np.testing.assert_array_equal(names, np.array(CLASS_NAMES)[order])


def test_output_dtypes(served):
    dtypes = served["report"]["model_size/dtypes"]
    assert dtypes == {
        "logits": "float32",
        "probabilities": "float32",
        "top_k_indices": "int32",
        "top_k_probabilities": "float32",
        "top_k_class_names": "string",
    }


def test_wrong_dtype_and_channels_get_clear_errors(served):
    errors = served["report"]["errors"]
    kind, message = errors["float_into_uint8_method"]
    assert kind == "TypeError" and "uint8" in message and "float32" in message
    kind, message = errors["float_into_uint8_signature"]
    assert kind == "InvalidArgumentError" and "uint8" in message
    kind, message = errors["four_channels_method"]
    assert kind == "TypeError" and "(None, None, None, 3)" in message
    kind, message = errors["four_channels_signature"]
    assert kind == "InvalidArgumentError" and "`images` must have 3 channels" in message
    kind, message = errors["wrong_size_float_signature"]
    assert kind == "InvalidArgumentError" and "`images` must be 32x32" in message
    kind, message = errors["empty_image"]
    assert kind == "InvalidArgumentError" and "non-zero height and width" in message
    kind, message = errors["one_image_without_batch_axis"]
    assert kind == "InvalidArgumentError" and "images_must_be_of_rank_4" in message
    assert "[20,30,3] is not compatible with expected shape [?,?,?,?]" in message


def _saved_model_cli():
    executable = shutil.which("saved_model_cli")
    if executable is None:
        return [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
    return [executable]


def test_saved_model_cli_lists_the_signatures(served):
    command = _saved_model_cli() + ["show", "--all", "--dir", served["path"]]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    text = completed.stdout
    start = text.index("signature_def['serving_default']")
    default = text[start : text.index("signature_def['serving_float']")]
    floats = text[text.index("signature_def['serving_float']") :]
    assert "dtype: DT_UINT8" in default and "shape: (-1, -1, -1, 3)" in default
    assert "dtype: DT_FLOAT" in floats and "shape: (-1, 32, 32, 3)" in floats
    for output in ("logits", "probabilities", "top_k_indices", "top_k_class_names"):
        assert f"outputs['{output}']" in default


# SavedModel variants, in process ---------------------------------------------


def _load(path):
    return tf.saved_model.load(path)


def test_softmax_head_gives_pre_activation_logits(tiny_config, tmp_path, images):
    model = tiny_model(tiny_config, classifier_activation="softmax")
    path = export_saved_model(model, str(tmp_path / "sm"), preprocessing=False)
    outputs = _load(path).signatures["serving_default"](images=tf.constant(images))
    probabilities = keras.ops.convert_to_numpy(model(images))
    np.testing.assert_allclose(outputs["probabilities"], probabilities, rtol=1e-5, atol=1e-6)
    # Pre-activation logits, recomputed independently from the head's weights.
    features = keras.Model(model.inputs[0], model.get_layer("head").input)(images)
    kernel, bias = (keras.ops.convert_to_numpy(w) for w in model.get_layer("head").weights)
    logits = keras.ops.convert_to_numpy(features) @ kernel + bias
    np.testing.assert_allclose(outputs["logits"], logits, rtol=1e-5, atol=1e-5)
    assert "top_k_class_names" not in outputs


def test_features_model_exports_features(tiny_config, tmp_path, images):
    model = tiny_model(tiny_config, num_classes=0)
    path = export_saved_model(model, str(tmp_path / "sm"))
    outputs = _load(path).signatures["serving_float"](images=tf.constant(images))
    assert sorted(outputs) == ["features"]
    np.testing.assert_allclose(outputs["features"], model(images), rtol=1e-5, atol=1e-5)


def test_mixed_precision_outputs_float32(tiny_config, tmp_path, images):
    model = tiny_model(tiny_config, dtype="mixed_bfloat16")
    path = export_saved_model(model, str(tmp_path / "sm"), top_k=20)
    loaded = _load(path)
    outputs = loaded.signatures["serving_float"](images=tf.constant(images))
    assert all(outputs[key].dtype == tf.float32 for key in ("logits", "probabilities"))
    assert outputs["top_k_indices"].shape == (2, 10)  # top_k is capped at the classes
    # A graph fuses each bfloat16 matmul with its bias and GELU (rounding once, not
    # after each op), so the SavedModel matches the model run as a graph exactly
    # and eager execution to bfloat16 precision.
    graph = keras.ops.convert_to_numpy(tf.function(model)(tf.constant(images)))
    np.testing.assert_allclose(outputs["logits"], graph, rtol=1e-5, atol=1e-5)
    eager = keras.ops.convert_to_numpy(model(images))
    np.testing.assert_allclose(outputs["logits"], eager, rtol=0, atol=3e-2)


def test_model_built_under_a_distribution_strategy(tiny_config, tmp_path, images):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = tiny_model(tiny_config)
    expected = keras.ops.convert_to_numpy(model(images))
    outside = export_saved_model(model, str(tmp_path / "outside"))
    with strategy.scope():
        inside = export_saved_model(model, str(tmp_path / "inside"))
    for path in (outside, inside):
        outputs = _load(path).signatures["serving_float"](images=tf.constant(images))
        np.testing.assert_allclose(outputs["logits"], expected, rtol=1e-5, atol=1e-5)


def test_export_time_validation(tiny_config, tmp_path):
    model = tiny_model(tiny_config)
    path = str(tmp_path / "sm")
    with pytest.raises(ValueError, match=r"`class_names` must have one name per class \(10\)"):
        export_saved_model(model, path, class_names=["a", "b"])
    with pytest.raises(TypeError, match="`class_names` must be a list of strings"):
        export_saved_model(model, path, class_names="abc")
    with pytest.raises(ValueError, match="`top_k` must be a positive integer. Received: top_k=0"):
        export_saved_model(model, path, top_k=0)
    with pytest.raises(TypeError, match="`preprocessing` must be True or False"):
        export_saved_model(model, path, preprocessing="yes")
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        export_saved_model(object(), path)
    with pytest.raises(ValueError, match="`quantization` must be one of"):
        export_tflite(model, str(tmp_path / "m.tflite"), quantization="int4")
    free_size = keras.Model(*_free_size_model())
    with pytest.raises(ValueError, match="images of a fixed size"):
        export_saved_model(free_size, path)
    with pytest.raises(ValueError, match="dynamic_image_size=True"):
        export_saved_model(free_size, path)
    features = tiny_model(tiny_config, num_classes=0)
    with pytest.raises(ValueError, match="`class_names` needs a model with a classification head"):
        export_saved_model(features, path, class_names=CLASS_NAMES)
    assert not os.path.exists(path)


def test_export_refuses_to_overwrite_unless_asked(tiny_config, tmp_path):
    model = tiny_model(tiny_config)
    images = np.random.default_rng(5).uniform(-1, 1, (1, 32, 32, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(images))
    # A directory of the user's: refused, untouched.
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"already exists.*overwrite=True"):
        export_saved_model(model, str(folder))
    assert sorted(os.listdir(folder)) == ["notes.txt"]
    # With overwrite=True: the SavedModel is written, the other files stay.
    export_saved_model(model, str(folder), overwrite=True)
    assert {"notes.txt", "saved_model.pb", "variables"} <= set(os.listdir(folder))
    assert (folder / "notes.txt").read_text() == "keep me"
    # A SavedModel replaced by another one.
    other = tiny_model(tiny_config, seed=1)
    with pytest.raises(FileExistsError, match="already exists"):
        export_saved_model(other, str(folder))
    outputs = _load(str(folder)).signatures["serving_float"](images=tf.constant(images))
    np.testing.assert_allclose(outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    export_saved_model(other, str(folder), overwrite=True)
    outputs = _load(str(folder)).signatures["serving_float"](images=tf.constant(images))
    expected_other = keras.ops.convert_to_numpy(other(images))
    np.testing.assert_allclose(outputs["logits"], expected_other, rtol=1e-5, atol=1e-5)
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]  # no leftovers
    # An empty directory is written without overwrite=True.
    (tmp_path / "empty").mkdir()
    export_saved_model(model, str(tmp_path / "empty"))
    # TFLite: an existing file is kept unless overwrite=True.
    lite = tmp_path / "model.tflite"
    lite.write_text("keep me")
    with pytest.raises(FileExistsError, match=r"model.tflite.*overwrite=True"):
        export_tflite(model, str(lite))
    assert lite.read_text() == "keep me"
    export_tflite(model, str(lite), overwrite=True)
    np.testing.assert_allclose(_run_tflite(str(lite), images)["logits"], expected, atol=1e-4)
    # A file where a directory goes, or the reverse: refused even with overwrite=True.
    with pytest.raises(ValueError, match="must be a directory to write the SavedModel in"):
        export_saved_model(model, str(lite), overwrite=True)
    with pytest.raises(ValueError, match="must be the .tflite file to write"):
        export_tflite(model, str(folder), overwrite=True)
    with pytest.raises(TypeError, match="`overwrite` must be True or False"):
        export_saved_model(model, str(tmp_path / "new"), overwrite="yes")


def test_cli_export_overwrite_replaces_the_output(tiny_config, tmp_path):
    model = tiny_model(tiny_config)
    model.save(tmp_path / "model.keras")
    output = tmp_path / "served"
    arguments = ["export", "--model", str(tmp_path / "model.keras"), "--output", str(output)]
    assert cli_main(arguments) == 0
    assert cli_main(arguments + ["--overwrite"]) == 0


def test_a_dynamic_model_serves_float_images_of_any_size_it_takes(tiny_config, tmp_path):
    dynamic = tiny_model(tiny_config, dynamic_image_size=True)
    path = export_saved_model(dynamic, str(tmp_path / "sm"), class_names=CLASS_NAMES)
    loaded = _load(path)
    rng = np.random.default_rng(3)
    for height, width in [(32, 32), (24, 40), (8, 16)]:
        images = rng.uniform(-1, 1, (2, height, width, 3)).astype("float32")
        outputs = loaded.signatures["serving_float"](images=tf.constant(images))
        expected = keras.ops.convert_to_numpy(dynamic(images))
        np.testing.assert_allclose(outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"multiples of \(8, 8\)"):
        loaded.signatures["serving_float"](images=tf.zeros((1, 30, 32, 3)))
    # uint8 images of any size are resized to the size the model was built for.
    photos = rng.integers(0, 256, (1, 50, 70, 3), dtype=np.uint8)
    outputs = loaded.signatures["serving_default"](images=tf.constant(photos))
    resized = keras.ops.convert_to_numpy(resize_and_scale(photos, (32, 32)))
    expected = keras.ops.convert_to_numpy(dynamic(resized))
    np.testing.assert_allclose(outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    # TFLite: at that size.
    lite = export_tflite(dynamic, str(tmp_path / "m.tflite"))
    images = rng.uniform(-1, 1, (1, 32, 32, 3)).astype("float32")
    np.testing.assert_allclose(
        _run_tflite(lite, images)["logits"],
        keras.ops.convert_to_numpy(dynamic(images)),
        rtol=0,
        atol=TFLITE_TOLERANCE[None][0],
    )


def test_other_backend_gets_a_clear_error(tiny_config, tmp_path, monkeypatch):
    model = tiny_model(tiny_config)
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ValueError, match="Export needs the TensorFlow backend.*'jax'"):
        export_saved_model(model, str(tmp_path / "sm"))


def _free_size_model():
    inputs = keras.Input((None, None, 3))
    return inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(inputs))


# TFLite -----------------------------------------------------------------------


def _run_tflite(path, images):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf.lite.Interpreter's deprecation notice
        interpreter = tf.lite.Interpreter(model_path=path)
    interpreter.resize_tensor_input(interpreter.get_input_details()[0]["index"], images.shape)
    interpreter.allocate_tensors()
    return interpreter.get_signature_runner("serving_default")(images=images)


def test_tflite_agrees_with_keras_per_quantization(tiny_config, tmp_path):
    model = tiny_model(tiny_config)
    images = np.random.default_rng(3).uniform(-1, 1, size=(3, 32, 32, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(images))
    sizes = {}
    for quantization, (logits_tolerance, probabilities_tolerance) in TFLITE_TOLERANCE.items():
        path = export_tflite(model, str(tmp_path / f"{quantization}.tflite"), quantization)
        sizes[quantization] = os.path.getsize(path)
        outputs = _run_tflite(path, images)
        np.testing.assert_allclose(outputs["logits"], expected, rtol=0, atol=logits_tolerance)
        np.testing.assert_allclose(
            outputs["probabilities"], softmax(expected), rtol=0, atol=probabilities_tolerance
        )
        one = _run_tflite(path, images[:1])  # a batch of one
        np.testing.assert_allclose(one["logits"], expected[:1], rtol=0, atol=logits_tolerance)
    # The quantised files are smaller: int8 weights < float16 weights < float32.
    assert sizes["dynamic"] < sizes["float16"] < sizes[None]


def test_saved_model_keeps_the_per_head_core_and_tflite_the_batched_one(
    tiny_config, tmp_path, images, per_head_calls
):
    from keras_vit.layers.attention import batched_core_only

    model = tiny_model(tiny_config)
    with batched_core_only():
        expected = keras.ops.convert_to_numpy(model(images))
    assert not per_head_calls
    path = export_saved_model(model, str(tmp_path / "sm"), preprocessing=False)
    assert per_head_calls  # the serving graph runs the per-head loop
    outputs = _load(path).signatures["serving_default"](images=tf.constant(images))
    np.testing.assert_allclose(outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    count = len(per_head_calls)
    path = export_tflite(model, str(tmp_path / "model.tflite"))
    assert len(per_head_calls) == count
    np.testing.assert_allclose(_run_tflite(path, images)["logits"], expected, rtol=0, atol=1e-4)


def test_tflite_of_a_mixed_precision_model(tiny_config, tmp_path, images):
    model = tiny_model(tiny_config, dtype="mixed_bfloat16")
    path = export_tflite(model, str(tmp_path / "mixed.tflite"))
    float32_model = tiny_model(tiny_config)
    float32_model.set_weights(model.get_weights())
    outputs = _run_tflite(path, images)
    # The TFLite file computes in float32: it matches the float32 model.
    np.testing.assert_allclose(
        outputs["logits"], float32_model(images), rtol=0, atol=TFLITE_TOLERANCE[None][0]
    )


def test_hybrid_exports_to_saved_model_and_tflite(tiny_config, tmp_path, images):
    model = tiny_model(tiny_config, resnet_layers=(1,), patch_size=1)
    expected = keras.ops.convert_to_numpy(model(images))
    path = export_saved_model(model, str(tmp_path / "sm"))
    outputs = _load(path).signatures["serving_float"](images=tf.constant(images))
    np.testing.assert_allclose(outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    tflite = export_tflite(model, str(tmp_path / "hybrid.tflite"))
    outputs = _run_tflite(tflite, images)
    np.testing.assert_allclose(outputs["logits"], expected, rtol=0, atol=TFLITE_TOLERANCE[None][0])


# Reloading and the command line -------------------------------------------------


def test_load_trained_folder_and_file(tiny_config, tmp_path, images):
    model = tiny_model(tiny_config)
    model.save(tmp_path / "model.keras")
    (tmp_path / "classes.json").write_text(json.dumps(CLASS_NAMES))
    loaded, names = load_trained(str(tmp_path))
    assert names == CLASS_NAMES
    np.testing.assert_allclose(loaded(images), model(images), rtol=0, atol=0)
    loaded, names = load_trained(str(tmp_path / "model.keras"))
    assert names == CLASS_NAMES
    (tmp_path / "classes.json").unlink()
    (tmp_path / "class_names.json").write_text(json.dumps({"class_names": CLASS_NAMES}))
    assert load_trained(str(tmp_path))[1] == CLASS_NAMES
    (tmp_path / "class_names.json").write_text(json.dumps({"classes": 3}))
    with pytest.raises(ValueError, match="must hold a JSON list of class names"):
        load_trained(str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="No model.keras in the folder"):
        load_trained(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="No such file or folder"):
        load_trained(str(tmp_path / "missing.keras"))


def test_cli_export_saved_model_and_tflite(tiny_config, tmp_path, capsys):
    model = tiny_model(tiny_config)
    run = tmp_path / "run"
    run.mkdir()
    model.save(run / "model.keras")
    (run / "classes.json").write_text(json.dumps(CLASS_NAMES))
    output = tmp_path / "served"
    assert cli_main(["export", "--model", str(run), "--output", str(output), "--top-k", "2"]) == 0
    images = np.random.default_rng(4).integers(0, 256, size=(2, 45, 30, 3), dtype=np.uint8)
    outputs = _load(str(output)).signatures["serving_default"](images=tf.constant(images))
    expected = keras.ops.convert_to_numpy(model(resized(images)))
    np.testing.assert_allclose(outputs["logits"], expected, rtol=1e-5, atol=1e-5)
    best = np.argsort(-expected, axis=-1)[:, :2]
    np.testing.assert_array_equal(
        outputs["top_k_class_names"].numpy().astype(str), np.array(CLASS_NAMES)[best]
    )
    tflite = tmp_path / "model.tflite"
    arguments = ["export", "--model", str(run / "model.keras"), "--format", "tflite"]
    assert cli_main(arguments + ["--output", str(tflite), "--quantization", "float16"]) == 0
    float_images = resized(images)
    np.testing.assert_allclose(
        _run_tflite(str(tflite), float_images)["logits"], expected, rtol=0, atol=2e-3
    )
    capsys.readouterr()
    # Errors: exit status 2 and a message naming the problem.
    assert cli_main(arguments + ["--output", str(tflite)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["export", "--model", str(tmp_path / "nope"), "--output", "x"]) == 2
    assert "no such file or folder" in capsys.readouterr().err.lower()
    assert (
        cli_main(["export", "--model", str(run), "--output", "y", "--quantization", "dynamic"]) == 2
    )
    assert "--quantization applies to --format tflite only" in capsys.readouterr().err


# .keras round trips with safe_mode=True and no custom_objects ----------------


def _round_trip(model, path, images):
    model.save(path)
    reloaded = keras.models.load_model(path, safe_mode=True)
    np.testing.assert_allclose(reloaded(images), model(images), rtol=0, atol=0)
    assert [w.shape for w in reloaded.weights] == [w.shape for w in model.weights]
    return reloaded


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"pooling": "gap", "representation_size": 16, "classifier_activation": "softmax"},
        {"resnet_layers": (), "patch_size": 1, "num_classes": 0},
    ],
    ids=["token", "gap_pre_logits_softmax", "hybrid_stem_features"],
)
def test_keras_file_loads_with_safe_mode(tiny_config, tmp_path, images, kwargs):
    model = tiny_model(tiny_config, **kwargs)
    _round_trip(model, str(tmp_path / "model.keras"), images)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(keras_vit.VARIANTS))
def test_every_variant_keras_file_loads_with_safe_mode(variant, tmp_path):
    architecture = keras_vit.VARIANTS[variant]
    # The smallest image the variant accepts (the hybrid's ResNet has stride 16).
    size = 32 if architecture.get("resnet_layers") else 2 * architecture["patch_size"]
    model = getattr(keras_vit, variant)(image_size=size, num_classes=10)
    images = np.random.default_rng(0).uniform(-1, 1, size=(1, size, size, 3)).astype("float32")
    _round_trip(model, str(tmp_path / f"{variant}.keras"), images)
