"""keras_vit.streams: batches cut into parts that run side by side give the same results."""

import os
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import streams, training

pytestmark = pytest.mark.tensorflow_only
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(tiny_config, jit_compile):
    keras.utils.set_random_seed(3)
    model = keras_vit.VisionTransformer(**{**tiny_config, "num_classes": 5})
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.05, global_clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    return model


def _data(count):
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (count, 32, 32, 3)).astype("float32")
    return x, rng.integers(0, 5, count)


# Graph mode with two parts, XLA with three (uneven parts, and a last batch
# with fewer rows than parts); XLA with two parts adds no other path.
@pytest.mark.parametrize("jit_compile, parts", [(False, 2), (True, 3)])
def test_streamed_fit_predict_evaluate_match_one_stream(tiny_config, jit_compile, parts):
    # 11 images in batches of 4: parts of 2+2 / 2+1+1, a last batch of 3 (uneven
    # parts, or fewer rows than 3 parts: one part), sample weights on the last fit.
    x, y = _data(11)
    weights = np.linspace(0.5, 1.5, 11).astype("float32")
    plain = _model(tiny_config, jit_compile)
    cut = streams.use_streams(_model(tiny_config, jit_compile), parts)
    histories = []
    for model in (plain, cut):
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
        history["weighted"] = model.fit(
            x, y, sample_weight=weights, batch_size=4, shuffle=False, verbose=0
        ).history["loss"]
        histories.append(history)
    for key in ("loss", "accuracy", "weighted"):
        np.testing.assert_allclose(histories[0][key], histories[1][key], rtol=1e-4, atol=1e-6)
    for a, b in zip(plain.get_weights(), cut.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
    assert int(cut.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 9
    for batch_size in (4, 1):  # 1: a batch smaller than the parts
        np.testing.assert_allclose(
            plain.predict(x, batch_size=batch_size, verbose=0),
            cut.predict(x, batch_size=batch_size, verbose=0),
            rtol=1e-4,
            atol=1e-5,
        )
    np.testing.assert_allclose(
        plain.evaluate(x, y, batch_size=4, verbose=0),
        cut.evaluate(x, y, batch_size=4, verbose=0),
        rtol=1e-4,
        atol=1e-6,
    )


def _batch_mixing_model():
    # A model whose output mixes the samples of its batch (the batch mean) shows
    # the parts: the one thing streams must not be used for.
    inputs = keras.Input((1,))
    outputs = keras.layers.Lambda(lambda t: t * 0 + keras.ops.mean(t, axis=0, keepdims=True))(
        inputs
    )
    return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(outputs))


def test_streamed_steps_really_cut_the_batch():
    model = _batch_mixing_model()
    model.compile(optimizer="sgd", loss="mse")
    x = np.array([[1.0], [2.0], [3.0], [4.0], [6.0]], "float32")
    np.testing.assert_allclose(model.predict(x, verbose=0)[:, 0], [3.2] * 5, rtol=1e-6)
    streams.use_streams(model, 2)
    np.testing.assert_allclose(model.predict(x, verbose=0)[:, 0], [2, 2, 2, 5, 5], rtol=1e-6)
    np.testing.assert_allclose(model.predict(x[:1], verbose=0)[:, 0], [1], rtol=1e-6)


def test_use_streams_one_undoes_and_recompile_resets(tiny_config):
    model = streams.use_streams(_model(tiny_config, True), 2)
    assert "train_step" in vars(model)
    streams.use_streams(model, 1)
    assert "train_step" not in vars(model) and "make_train_function" not in vars(model)
    x, y = _data(4)
    assert np.isfinite(model.train_on_batch(x, y)[0])


def test_use_streams_one_restores_the_overrides_it_replaced(tiny_config, monkeypatch):
    # compile_model on a CPU-only Intel machine with AVX-512 predicts in graph mode
    # (inference_without_xla); streams and their undo must not lose that.
    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "graph_mode_predicts_faster", lambda: True)
    model = keras_vit.VisionTransformer(**{**tiny_config, "num_classes": 5})
    training.compile_model(model, total_steps=4)
    graph_predict = vars(model)["make_predict_function"]
    streams.use_streams(model, 2)
    streams.use_streams(model, 2)  # again, as after a recompile
    assert vars(model)["make_predict_function"] is not graph_predict
    streams.use_streams(model, 1)
    assert vars(model)["make_predict_function"] is graph_predict
    assert "predict_step" not in vars(model)


@pytest.mark.parametrize("native", [True, False])
def test_use_streams_warns_of_bfloat16_without_cpu_instructions(tiny_config, monkeypatch, native):
    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "native_bfloat16", lambda: native)
    model = keras_vit.VisionTransformer(**tiny_config, dtype="mixed_bfloat16")
    model.compile(optimizer="adamw", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        streams.use_streams(model, 2)
    assert any("bfloat16" in str(w.message) for w in caught) is not native
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        streams.use_streams(_model(tiny_config, False), 2)  # float32
    assert not any("bfloat16" in str(w.message) for w in caught)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_bad_streams_are_refused(tiny_config, value):
    with pytest.raises(ValueError, match="streams"):
        streams.use_streams(_model(tiny_config, False), value)
    with pytest.raises(ValueError, match="streams"):
        streams.configure_cpu_streams(value)


def test_use_streams_needs_a_compiled_model(tiny_config):
    with pytest.raises(ValueError, match="keras.Model"):
        streams.use_streams("model.keras", 2)
    model = keras_vit.VisionTransformer(**{**tiny_config, "num_classes": 5})
    with pytest.raises(ValueError, match="Compile"):
        streams.use_streams(model, 2)


def test_configure_refuses_more_streams_than_cores():
    with pytest.raises(ValueError, match="cores"):
        streams.configure_cpu_streams(3, cores=2)


def test_compile_model_uses_configured_streams_only_when_asked(tiny_config):
    model = keras_vit.VisionTransformer(**{**tiny_config, "num_classes": 5})
    training.compile_model(model, total_steps=4)
    assert "train_step" not in vars(model)  # "auto" without configure_cpu_streams
    training.compile_model(model, total_steps=4, streams=2)
    assert "train_step" in vars(model)
    x = _data(4)[0]
    y = keras.utils.to_categorical(_data(4)[1], 5)
    assert np.isfinite(model.fit(x, y, batch_size=4, verbose=0).history["loss"][0])


def test_compile_fast_predicts_in_two_xla_parts_without_configured_streams(monkeypatch):
    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "cpu_only_tensorflow", lambda: True)
    monkeypatch.setattr(_cpu, "graph_mode_predicts_faster", lambda: False)  # XLA inference
    x = np.array([[1.0], [2.0], [3.0], [4.0], [6.0]], "float32")
    y = np.zeros((5, 1), "float32")
    whole, cut = [3.2] * 5, [2, 2, 2, 5, 5]  # the batch mean, of all rows or of each part
    model = _batch_mixing_model()
    training.compile_fast(model, keras.optimizers.SGD(0.0), "mse")
    assert streams.parts(model) == (1, streams.INFERENCE_PARTS) == (1, 2)
    np.testing.assert_allclose(model.predict(x, verbose=0)[:, 0], cut, rtol=1e-6)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), np.mean(np.square(cut)), rtol=1e-6)
    # The train step stays whole (one XLA program).
    np.testing.assert_allclose(model.train_on_batch(x, y), 3.2**2, rtol=1e-6)
    # Not cut: graph-mode inference, streams=1 asked for, jit_compile=False.
    for patch, kwargs in ((True, {}), (False, {"streams": 1}), (False, {"jit_compile": False})):
        monkeypatch.setattr(_cpu, "graph_mode_predicts_faster", lambda patch=patch: patch)
        training.compile_fast(model, keras.optimizers.SGD(0.0), "mse", **kwargs)
        assert streams.parts(model) == (1, 1)
        np.testing.assert_allclose(model.predict(x, verbose=0)[:, 0], whole, rtol=1e-6)
    # An evaluation-only compile is cut too; a later compile with streams=2
    # cuts training, and one with streams=1 undoes it (model.compile keeps them).
    training.compile_fast(model, None, "mse")
    assert streams.parts(model) == (1, 2)
    training.compile_fast(model, keras.optimizers.SGD(0.0), "mse", streams=2)
    assert streams.parts(model) == (2, 2)
    training.compile_fast(model, keras.optimizers.SGD(0.0), "mse", streams=1)
    assert streams.parts(model) == (1, 1)
    assert "train_step" not in vars(model)
    np.testing.assert_allclose(model.train_on_batch(x, y), 3.2**2, rtol=1e-6)


def _batch_mixing_attention_model(tokens):
    # The batch mean of each image's first value, with a keras_vit attention
    # layer of `tokens` tokens in the model (its output is multiplied by 0).
    from keras_vit.layers import MultiHeadSelfAttention

    inputs = keras.Input((tokens, 2))
    attended = MultiHeadSelfAttention(num_heads=1)(inputs)
    first = keras.layers.Lambda(lambda t: t[:, 0, :1])(inputs)
    mean = keras.layers.Lambda(lambda t: t * 0 + keras.ops.mean(t, axis=0, keepdims=True))(first)
    ignored = keras.layers.Lambda(lambda t: 0 * t[:, 0, :1])(attended)
    return keras.Model(inputs, keras.layers.Add()([mean, ignored]))


def _part_means(rows, sizes):
    values = np.arange(1.0, rows + 1)
    cuts = np.cumsum([0, *sizes])
    return np.concatenate([[values[a:b].mean()] * (b - a) for a, b in zip(cuts, cuts[1:])])


@pytest.mark.parametrize(
    "rows, sizes",
    [
        (1, [1]),  # fewer rows than 2 parts: whole
        (3, [2, 1]),  # 12 tokens: 2 parts (the fewest), though a part then holds 8
        (4, [2, 2]),  # 16 tokens: 2 parts of 8
        (5, [2, 1, 1, 1]),  # 20 tokens: 4 parts
        (8, [2, 2, 2, 2]),
        (9, [2, 1, 1, 1, 1, 1, 1, 1]),  # 36 tokens: 8 parts (4 would hold 12 tokens)
        (20, [3, 3, 3, 3, 2, 2, 2, 2]),  # 80 tokens: 8 parts, the most
    ],
)
def test_part_tokens_cut_larger_batches_in_more_parts(rows, sizes):
    from keras_vit.layers.attention import tokens_per_image

    model = _batch_mixing_attention_model(tokens=4)
    assert tokens_per_image(model) == 4
    model.compile(loss="mse", jit_compile=False)
    streams.use_streams(model, 2, train=False, part_tokens=8)  # at most 2 rows of 4 tokens
    assert streams.parts(model) == (1, 2) and streams.part_tokens(model) == 8
    x = np.zeros((rows, 4, 2), "float32")
    x[:, 0, 0] = np.arange(1.0, rows + 1)
    expected = _part_means(rows, sizes)
    np.testing.assert_allclose(model.predict(x, batch_size=rows, verbose=0)[:, 0], expected)
    loss = model.evaluate(x, np.zeros((rows, 1)), batch_size=rows, verbose=0)
    np.testing.assert_allclose(loss, np.mean(np.square(expected)), rtol=1e-6)


def test_part_tokens_need_a_keras_vit_model_of_known_size(tiny_config):
    # No attention layer, or one built for any image size: the fixed parts.
    x = np.array([[1.0], [2.0], [3.0], [4.0], [6.0]], "float32")
    model = _batch_mixing_model()
    model.compile(loss="mse")
    streams.use_streams(model, 2, train=False, part_tokens=1)
    assert streams.part_tokens(model) is None
    np.testing.assert_allclose(model.predict(x, verbose=0)[:, 0], [2, 2, 2, 5, 5], rtol=1e-6)
    dynamic = keras_vit.VisionTransformer(**{**tiny_config, "dynamic_image_size": True})
    dynamic.compile(loss="mse")
    streams.use_streams(dynamic, 2, train=False, part_tokens=1)
    assert streams.part_tokens(dynamic) is None
    with pytest.raises(ValueError, match="part_tokens"):
        streams.use_streams(model, 2, train=False, part_tokens=0)
    # use_streams(model, 1) forgets the limit.
    fixed = _batch_mixing_attention_model(tokens=4)
    fixed.compile(loss="mse")
    streams.use_streams(fixed, 2, train=False, part_tokens=8)
    streams.use_streams(fixed, 1)
    assert streams.part_tokens(fixed) is None and streams.parts(fixed) == (1, 1)


def test_compile_fast_limits_the_tokens_of_inference_parts(tiny_config, monkeypatch):
    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "cpu_only_tensorflow", lambda: True)
    monkeypatch.setattr(_cpu, "graph_mode_predicts_faster", lambda: False)  # XLA inference
    model = keras_vit.VisionTransformer(**{**tiny_config, "num_classes": 5})
    training.compile_fast(model, keras.optimizers.SGD(0.0), "mse")
    assert streams.parts(model) == (1, 2)
    assert streams.part_tokens(model) == streams.INFERENCE_PART_TOKENS == 1600
    training.compile_fast(model, keras.optimizers.SGD(0.0), "mse", streams=2)
    assert streams.part_tokens(model) is None  # configured streams: fixed parts
    # The predictions do not depend on the cut: 40 images of 17 tokens, 680
    # tokens, in 2 parts, and with a limit of 100 tokens in 8 parts of 5.
    x = _data(40)[0]
    training.compile_fast(model, keras.optimizers.SGD(0.0), "mse", streams=1)
    whole = model.predict(x, batch_size=40, verbose=0)
    for limit in (1600, 100):
        monkeypatch.setattr(training, "INFERENCE_PART_TOKENS", limit)
        training.compile_fast(model, keras.optimizers.SGD(0.0), "mse")
        np.testing.assert_allclose(
            model.predict(x, batch_size=40, verbose=0), whole, rtol=1e-5, atol=1e-6
        )


def test_inference_parts_keep_the_train_steps_own_overrides(tiny_config):
    model = _model(tiny_config, True)
    training.training_without_xla(model)
    own = vars(model)["make_train_function"]
    streams.use_streams(model, 2, train=False)
    assert vars(model)["make_train_function"] is own and "train_step" not in vars(model)
    assert streams.parts(model) == (1, 2)
    streams.use_streams(model, 1)
    assert vars(model)["make_train_function"] is own
    assert "make_predict_function" not in vars(model) and "predict_step" not in vars(model)
    assert streams.parts(model) == (1, 1)
    with pytest.raises(ValueError, match="Compile the model before"):
        streams.use_streams(_batch_mixing_model(), 2, train=False)


def _python(code):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_configure_sets_the_threads_and_compile_model_picks_them_up():
    result = _python(
        """
        import tensorflow as tf
        from keras_vit import streams, training
        import keras_vit
        threads = streams.configure_cpu_streams(2, cores=2)
        assert threads == 1, threads
        assert tf.config.threading.get_intra_op_parallelism_threads() == 1
        assert tf.config.threading.get_inter_op_parallelism_threads() == 2
        model = keras_vit.VisionTransformer(image_size=16, patch_size=8, num_layers=1,
            num_heads=2, hidden_dim=8, mlp_dim=16, num_classes=3)
        training.compile_model(model, total_steps=2)
        assert "train_step" in vars(model)
        print("ok", streams.configured_streams())
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ok 2" in result.stdout


def test_configure_after_tensorflow_started_says_when_to_call_it():
    result = _python(
        """
        import tensorflow as tf
        from keras_vit import streams
        tf.constant(1.0) + 1.0
        try:
            streams.configure_cpu_streams(2, cores=2)
        except RuntimeError as error:
            print("refused:", error)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "refused:" in result.stdout and "before TensorFlow runs" in result.stdout


def test_recommended_streams_follow_the_measured_machines(monkeypatch):
    """2 only on a CPU-only machine of 2 cores whose oneDNN runs AVX-512."""
    import tensorflow as tf

    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "onednn_avx512", lambda: True)
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [])
    for name in streams.THREAD_ENVS:
        monkeypatch.delenv(name, raising=False)
    assert streams.recommended_cpu_streams(cores=2) == 2
    for name in streams.THREAD_ENVS:  # threads the user chose are left alone
        monkeypatch.setenv(name, "2")
        assert streams.recommended_cpu_streams(cores=2) == 1
        monkeypatch.delenv(name)
    assert streams.recommended_cpu_streams(cores=1) == 1
    assert streams.recommended_cpu_streams(cores=4) == 1  # not measured
    gpu = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
    monkeypatch.setattr(
        tf.config, "list_physical_devices", lambda kind=None: [gpu] if kind == "GPU" else []
    )
    assert streams.recommended_cpu_streams(cores=2) == 1
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [])
    monkeypatch.setattr(_cpu, "onednn_avx512", lambda: False)  # AVX2: measured slower
    assert streams.recommended_cpu_streams(cores=2) == 1
    with pytest.raises(ValueError, match="cores"):
        streams.recommended_cpu_streams(cores=0)
    monkeypatch.setenv(streams.THREAD_ENVS[0], "2")  # where the answer is 1 anyway
    with pytest.raises(ValueError, match="cores"):
        streams.recommended_cpu_streams(cores=0)
    with pytest.raises(ValueError, match="cores"):
        streams.configure_cpu_streams("auto", cores=-1)


def test_recommended_streams_leave_tensorflow_unstarted():
    """configure_cpu_streams still works after recommended_cpu_streams (fresh process)."""
    code = textwrap.dedent(
        """
        from keras_vit import streams
        recommended = streams.recommended_cpu_streams()
        auto = streams.configure_cpu_streams("auto")
        threads = streams.configure_cpu_streams(2, cores=2)
        print(recommended, auto, threads)
        """
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    recommended, auto, threads = result.stdout.split()
    assert recommended in ("1", "2") and threads == "1"
    # "auto": the recommended streams, one thread per operation on 2 cores; or nothing.
    assert auto == ("1" if recommended == "2" else "None")


def test_auto_streams_change_nothing_where_one_is_recommended(monkeypatch):
    monkeypatch.setattr(streams, "recommended_cpu_streams", lambda cores=None: 1)
    assert streams.configure_cpu_streams("auto") is None
    assert streams.configured_streams() == 1
