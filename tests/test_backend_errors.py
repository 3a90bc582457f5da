"""The public Python API under tf.distribute, in mixed precision and on the JAX backend.

- MirroredStrategy on 2 logical CPUs (one subprocess): a model built outside
  the strategy's scope, or under another strategy, or an optimizer made
  outside it, is refused by name; a model built in the scope compiles
  outside it; a global batch the replicas share unevenly trains and
  evaluates as on one device; remat plus dynamic_image_size, mixed_float16,
  load_weights and a .keras round trip under the strategy.
- mixed_float16: compile_model and compile_fast scale the loss (gradients
  that underflow float16 otherwise), and the scaling survives a .keras round
  trip.
- JAX (one subprocess with KERAS_BACKEND=jax): what README says works there
  (load_weights, fit, .keras save/load, dynamic sizes) does, and the
  TensorFlow-only parts (tf.distribute strategies, CPU streams, export) say so.
- training.build_callbacks makes its output folder.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32)

# Shared by both subprocesses: record what a call returns or raises.
PRELUDE = r"""
import json, os, sys
import numpy as np

RESULTS = {}


def check(name, function):
    try:
        RESULTS[name] = {"value": function()}
    except Exception as error:  # recorded, asserted by the test
        RESULTS[name] = {"error": type(error).__name__, "message": str(error)}


TINY = dict(image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
            num_classes=3)
rng = np.random.default_rng(0)
x = rng.uniform(-1, 1, (10, 16, 16, 3)).astype("float32")
y = np.eye(3, dtype="float32")[np.arange(10) % 3]
DATA = os.path.join(os.getcwd(), "tests", "data")
SQUARE = os.path.join(DATA, "timm_square.safetensors")
square_inputs = np.load(os.path.join(DATA, "timm_square_inputs.npy"))
square_logits = np.load(os.path.join(DATA, "timm_square_logits.npy"))
SQUARE_CONFIG = dict(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64,
                     mlp_dim=128, num_classes=10)


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64"))))
"""

MIRRORED = (
    r"""
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
"""
    + PRELUDE
    + r"""
import keras, keras_vit
from keras_vit import training

devices = ["/cpu:0", "/cpu:1"]
mirrored = tf.distribute.MirroredStrategy(devices)
one_device = tf.distribute.get_strategy()


def build(strategy, **overrides):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        return keras_vit.VisionTransformer(**{**TINY, **overrides})


def recipe(model):
    return training.compile_model(
        model, total_steps=4, learning_rate=1e-2, warmup_steps=1, jit_compile=False
    )


def weights(model):
    return [w.numpy() for w in model.weights]


def built_outside():
    model = build(one_device)
    with mirrored.scope():
        recipe(model)


def other_strategy():
    model = build(mirrored)
    with tf.distribute.MirroredStrategy(devices).scope():
        recipe(model)


def optimizer_outside():
    optimizer = keras.optimizers.Adam()
    model = build(mirrored)
    with mirrored.scope():
        training.compile_fast(model, optimizer, "categorical_crossentropy")


def compiled_outside():
    model = recipe(build(mirrored))
    model.fit(x[:8], y[:8], batch_size=4, epochs=1, verbose=0)
    plain = recipe(build(one_device))
    plain.fit(x[:8], y[:8], batch_size=4, epochs=1, verbose=0)
    return max(max_diff(a, b) for a, b in zip(weights(model), weights(plain)))


def uneven_batches():
    # Batches of 5 on 2 replicas (3 and 2 images), then of 3 (2 and 1).
    plain = recipe(build(one_device))
    loss, accuracy = plain.evaluate(x, y, batch_size=10, verbose=0)
    plain_logits = plain.predict(x, verbose=0)
    with mirrored.scope():
        model = recipe(build(mirrored))
    evaluated = model.evaluate(x, y, batch_size=5, verbose=0)
    logits = model.predict(x, batch_size=3, verbose=0)
    # The first step's loss is computed before its update: the initial weights' loss.
    history = model.fit(x[:5], y[:5], batch_size=5, epochs=1, verbose=0).history
    first = plain.evaluate(x[:5], y[:5], verbose=0)[0]
    more = model.fit(x, y, batch_size=3, epochs=1, verbose=0).history
    return {
        "evaluate": max_diff(evaluated, [loss, accuracy]),
        "predict": max_diff(logits, plain_logits),
        "fit_loss": max_diff(history["loss"][0], first),
        "finite": bool(np.isfinite(more["loss"][0])
                       and all(np.isfinite(w).all() for w in weights(model))),
    }


def remat_dynamic():
    data = tf.data.Dataset.from_tensor_slices((x[:8], y[:8])).batch(4)
    trained = []
    for strategy in (one_device, mirrored):
        model = build(strategy, remat=True, dynamic_image_size=True)
        with strategy.scope():
            recipe(model)
        model.fit(data, epochs=1, verbose=0)
        trained.append(weights(model))
    return max(max_diff(a, b) for a, b in zip(*trained))


def float16():
    model = build(mirrored, dtype="mixed_float16")
    with mirrored.scope():
        recipe(model)
    history = model.fit(x[:8], y[:8], batch_size=4, epochs=1, verbose=0).history
    return [type(model.optimizer).__name__, bool(np.isfinite(history["loss"][0]))]


def load_weights_in_scope():
    with mirrored.scope():
        model = keras_vit.VisionTransformer(**SQUARE_CONFIG)
        keras_vit.load_weights(model, SQUARE)
        built = keras_vit.VisionTransformer(**SQUARE_CONFIG, weights=SQUARE)
    return [max_diff(model.predict(square_inputs, verbose=0), square_logits),
            max_diff(built.predict(square_inputs, verbose=0), square_logits)]


def keras_round_trip():
    path = os.path.join(sys.argv[1], "mirrored.keras")
    with mirrored.scope():
        model = recipe(build(mirrored))
    model.fit(x[:8], y[:8], batch_size=4, epochs=1, verbose=0)
    model.save(path)
    with mirrored.scope():
        loaded = keras.models.load_model(path)
    same = max_diff(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    steps = int(loaded.optimizer.iterations.numpy())
    loaded.fit(x[:8], y[:8], batch_size=4, epochs=1, verbose=0)
    model.fit(x[:8], y[:8], batch_size=4, epochs=1, verbose=0)
    return [same, steps, max(max_diff(a, b) for a, b in zip(weights(loaded), weights(model)))]


check("built_outside", built_outside)
check("other_strategy", other_strategy)
check("optimizer_outside", optimizer_outside)
check("compiled_outside", compiled_outside)
check("uneven_batches", uneven_batches)
check("remat_dynamic", remat_dynamic)
check("float16", float16)
check("load_weights_in_scope", load_weights_in_scope)
check("keras_round_trip", keras_round_trip)
print(json.dumps(RESULTS))
"""
)

JAX = (
    PRELUDE
    + r"""
import keras, keras_vit
from keras_vit import streams, training

assert keras.backend.backend() == "jax"


def tf_scope():
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        training.compile_model(keras_vit.VisionTransformer(**TINY), total_steps=2)


check("tf_scope", tf_scope)

check("configure_cpu_streams", lambda: streams.configure_cpu_streams(2))
check("get_strategy_mirrored", lambda: str(training.get_strategy("mirrored")))
check("get_strategy_auto", lambda: training.get_strategy("auto").num_replicas_in_sync)


def cli_mirrored():
    import contextlib, io
    from keras_vit.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", "--strategy", "mirrored", "--model", "vit-test", "--epochs", "1",
                     "--output", os.path.join(sys.argv[1], "cli-run")])
    return [code, err.getvalue().strip().splitlines()[-1]]


check("cli_mirrored", cli_mirrored)


def float16():
    model = keras_vit.VisionTransformer(**TINY, dtype="mixed_float16")
    training.compile_model(model, total_steps=2)
    history = model.fit(x[:4], y[:4], batch_size=2, verbose=0).history
    return [type(model.optimizer).__name__, bool(np.isfinite(history["loss"][0]))]


check("float16", float16)


def timm_parity():
    model = keras_vit.VisionTransformer(**SQUARE_CONFIG)
    report = keras_vit.load_weights(model, SQUARE)
    dynamic = keras_vit.VisionTransformer(**SQUARE_CONFIG, weights=SQUARE, dynamic_image_size=True)
    return [report["format"], max_diff(model.predict(square_inputs, verbose=0), square_logits),
            max_diff(dynamic.predict(square_inputs, verbose=0), square_logits),
            list(dynamic.predict(np.zeros((1, 24, 40, 3), "float32"), verbose=0).shape)]


check("timm_parity", timm_parity)


def fit_save_load():
    path = os.path.join(sys.argv[1], "jax.keras")
    model = keras_vit.VisionTransformer(**TINY)
    training.compile_model(model, total_steps=4, learning_rate=1e-2, warmup_steps=1)
    before = [np.array(w) for w in model.get_weights()]
    model.fit(x[:8], y[:8], batch_size=4, epochs=1, verbose=0)
    moved = max(max_diff(a, b) for a, b in zip(before, model.get_weights()))
    model.save(path)
    loaded = keras.models.load_model(path)
    return [moved, max_diff(loaded.predict(x, verbose=0), model.predict(x, verbose=0)),
            int(loaded.optimizer.iterations)]


check("fit_save_load", fit_save_load)
check("export", lambda: keras_vit.export_saved_model(keras_vit.VisionTransformer(**TINY),
                                                     os.path.join(sys.argv[1], "saved")))
print(json.dumps(RESULTS))
"""
)


def _run(script, tmp_path, backend, timeout):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND=backend, PYTHONPATH=ROOT)
    env.pop("TF_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _value(results, name):
    assert "value" in results[name], (name, results[name])
    return results[name]["value"]


def _error(results, name, kind="ValueError"):
    assert results[name].get("error") == kind, (name, results[name])
    return results[name]["message"]


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    return _run(MIRRORED, tmp_path_factory.mktemp("mirrored"), "tensorflow", 300)


@pytest.fixture(scope="module")
def jax_results(tmp_path_factory):
    return _run(JAX, tmp_path_factory.mktemp("jax"), "jax", 300)


# tf.distribute: MirroredStrategy on 2 logical CPUs -----------------------------


@pytest.mark.tensorflow_only
def test_model_built_outside_the_scope_is_refused_by_name(mirrored):
    message = _error(mirrored, "built_outside")
    assert "`model` was built outside" in message and "'patch_encoder/kernel'" in message
    assert "MirroredStrategy of 2 replica(s)" in message and len(message) < 500


@pytest.mark.tensorflow_only
def test_model_built_under_another_strategy_is_refused_by_name(mirrored):
    message = _error(mirrored, "other_strategy")
    assert "`model` was built under another tf.distribute strategy" in message


@pytest.mark.tensorflow_only
def test_optimizer_made_outside_the_scope_is_refused_by_name(mirrored):
    message = _error(mirrored, "optimizer_outside")
    assert "`optimizer` was created under _DefaultDistributionStrategy" in message
    assert len(message) < 500


@pytest.mark.tensorflow_only
def test_model_built_in_the_scope_compiles_outside_it(mirrored):
    assert _value(mirrored, "compiled_outside") < 1e-5  # as trained on one device


@pytest.mark.tensorflow_only
def test_batches_shared_unevenly_by_the_replicas(mirrored):
    value = _value(mirrored, "uneven_batches")
    assert value["evaluate"] < 1e-6 and value["predict"] < 1e-5, value
    assert value["fit_loss"] < 1e-6 and value["finite"], value


@pytest.mark.tensorflow_only
def test_remat_and_dynamic_image_size_under_the_strategy_match_one_device(mirrored):
    assert _value(mirrored, "remat_dynamic") < 1e-5


@pytest.mark.tensorflow_only
def test_mixed_float16_under_the_strategy_scales_the_loss(mirrored):
    assert _value(mirrored, "float16") == ["LossScaleOptimizer", True]


@pytest.mark.tensorflow_only
def test_load_weights_in_the_scope_matches_timm(mirrored):
    assert max(_value(mirrored, "load_weights_in_scope")) < 1e-4


@pytest.mark.tensorflow_only
def test_keras_file_saved_under_the_strategy_resumes_in_its_scope(mirrored):
    same, steps, resumed = _value(mirrored, "keras_round_trip")
    assert same < 1e-6 and steps == 2 and resumed < 1e-6


# mixed_float16 -----------------------------------------------------------------


def _tiny_loss(labels, logits):
    """Cross-entropy times 2**-20: float16 gradients underflow without loss scaling."""
    loss = keras.losses.categorical_crossentropy(labels, logits, from_logits=True)
    return keras.ops.mean(loss) * 2.0**-20


@pytest.mark.tensorflow_only
def test_mixed_float16_gradients_match_float32_with_loss_scaling():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (4, 16, 16, 3)).astype("float32")
    y = np.eye(3, dtype="float32")[np.arange(4) % 3]
    head = rng.normal(0, 0.5, (16, 3)).astype("float32")  # a zero head passes no gradient
    steps = []
    for dtype in ("float32", "mixed_float16"):
        model = keras_vit.VisionTransformer(**TINY, num_classes=3, dtype=dtype)
        if dtype == "float32":
            model.get_layer("head").kernel.assign(head)
            start = model.get_weights()
        model.set_weights(start)
        training.compile_fast(model, keras.optimizers.SGD(2.0**20), _tiny_loss, jit_compile=False)
        model.train_on_batch(x, y)
        steps.append(model.get_layer("patch_encoder").get_weights()[0] - start[0])
    exact, half = steps
    assert np.abs(exact).max() > 0.1
    assert np.abs(half - exact).max() <= 0.02 * np.abs(exact).max()


@pytest.mark.tensorflow_only
def test_mixed_float16_loss_scaling_survives_a_keras_round_trip(tmp_path):
    x = np.random.default_rng(0).uniform(-1, 1, (4, 16, 16, 3)).astype("float32")
    y = np.eye(3, dtype="float32")[np.arange(4) % 3]
    model = keras_vit.VisionTransformer(**TINY, num_classes=3, dtype="mixed_float16")
    training.compile_model(model, total_steps=4, jit_compile=False)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    model.fit(x, y, batch_size=2, verbose=0)
    model.save(tmp_path / "f16.keras")
    loaded = keras.models.load_model(tmp_path / "f16.keras")
    assert isinstance(loaded.optimizer, keras.optimizers.LossScaleOptimizer)
    assert int(loaded.optimizer.iterations.numpy()) == 2
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# The recipe's optimizer in a .keras file ---------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_reloaded_recipe_keeps_its_weight_decay_exclusions(tmp_path, optimizer):
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (4, 16, 16, 3)).astype("float32")
    y = np.eye(3, dtype="float32")[np.arange(4) % 3]
    model = keras_vit.VisionTransformer(**TINY, num_classes=3)
    # Non-zero biases and norms, which a decay would shrink.
    model.set_weights(
        [w + rng.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()]
    )
    training.compile_model(
        model,
        total_steps=4,
        learning_rate=0.5,
        optimizer=optimizer,
        weight_decay=0.5,
        jit_compile=False,
    )
    model.fit(x, y, batch_size=4, verbose=0)
    model.save(tmp_path / "recipe.keras")
    loaded = keras.models.load_model(tmp_path / "recipe.keras")
    assert loaded.optimizer.get_config()["weight_decay"] == 0.5
    for trained in (model, loaded):
        trained.fit(x, y, batch_size=4, verbose=0)
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.path)


# build_callbacks ---------------------------------------------------------------


def test_build_callbacks_makes_its_output_folder(tmp_path):
    output = tmp_path / "new" / "run"
    x = np.zeros((2, 16, 16, 3), "float32")
    y = np.eye(3, dtype="float32")[[0, 1]]
    model = training.compile_model(
        keras_vit.VisionTransformer(**TINY, num_classes=3), total_steps=2, jit_compile=False
    )
    callbacks = training.build_callbacks(str(output), backup_steps=1)
    model.fit(x, y, batch_size=1, validation_data=(x, y), callbacks=callbacks, verbose=0)
    assert (output / "history.csv").read_text().startswith("epoch,")
    assert (output / "best.keras").is_file()


# JAX backend (a subprocess) ----------------------------------------------------


def test_jax_streams_and_strategies_say_they_need_tensorflow(jax_results):
    assert "Streams need the TensorFlow backend" in _error(jax_results, "configure_cpu_streams")
    message = _error(jax_results, "get_strategy_mirrored")
    assert "`strategy='mirrored'` needs the TensorFlow backend" in message and "'jax'" in message
    assert _value(jax_results, "get_strategy_auto") == 1
    code, line = _value(jax_results, "cli_mirrored")  # a usage error, not a traceback
    assert code == 2 and line.startswith("keras-vit train: error: --strategy mirrored:"), line
    message = _error(jax_results, "tf_scope")
    assert "need the TensorFlow backend" in message and "2 replica(s)" in message
    assert "Export needs the TensorFlow backend" in _error(jax_results, "export")


def test_jax_mixed_float16_scales_the_loss(jax_results):
    assert _value(jax_results, "float16") == ["LossScaleOptimizer", True]


def test_jax_load_weights_fit_save_and_load(jax_results):
    layout, fixed, dynamic, shape = _value(jax_results, "timm_parity")
    assert layout == "timm" and fixed < 1e-4 and dynamic < 1e-4 and shape == [1, 10]
    moved, reloaded, steps = _value(jax_results, "fit_save_load")
    assert moved > 0 and reloaded < 1e-6 and steps == 2
