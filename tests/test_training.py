"""The training recipe: schedule, optimizer, weight-decay exclusions, strategies."""

import math
import os
import warnings

import keras
import numpy as np
import pytest

from keras_vit import training

pytestmark = pytest.mark.tensorflow_only


def test_warmup_cosine_matches_formula():
    schedule = training.WarmupCosine(peak=1e-3, total_steps=100, warmup_steps=10, end=1e-5)
    for step in (0, 5, 10, 40, 99, 100, 150):
        if step < 10:
            expected = 1e-3 * step / 10
        else:
            progress = min((step - 10) / 90, 1.0)
            expected = 1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * progress))
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_warmup_cosine_serializes():
    schedule = training.WarmupCosine(2e-3, 50, 5)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert isinstance(restored, training.WarmupCosine)
    assert restored.get_config() == schedule.get_config()


def test_warmup_cosine_rejects_bad_steps():
    with pytest.raises(ValueError, match="warmup_steps"):
        training.WarmupCosine(1e-3, total_steps=10, warmup_steps=20)


def test_weight_decay_skips_norms_biases_embeddings(tiny_config):
    import keras_vit

    model = keras_vit.VisionTransformer(**tiny_config)
    optimizer = training.build_optimizer("adamw", 1e-3, weight_decay=0.1)
    optimizer.build(model.trainable_variables)
    decayed = {v.path for v in model.trainable_variables if optimizer._use_weight_decay(v)}
    skipped = {v.path for v in model.trainable_variables} - decayed
    assert any("class_token" in p for p in skipped)
    assert any("position_embedding" in p for p in skipped)
    assert all(not p.endswith("kernel") for p in skipped)
    assert all(p.endswith("kernel") for p in decayed), sorted(decayed)
    assert any("qkv" in p for p in decayed) and any("patch_encoder" in p for p in decayed)


def test_weight_decay_changes_kernels_only():
    """One step with zero gradients: only decayed variables move."""
    kernel = keras.Variable(np.ones((2, 2), "float32"), name="kernel")
    bias = keras.Variable(np.ones((2,), "float32"), name="bias")
    optimizer = training.build_optimizer("adamw", 0.1, weight_decay=0.5, clipnorm=None)
    optimizer.apply_gradients(
        [(np.zeros((2, 2), "float32"), kernel), (np.zeros(2, "float32"), bias)]
    )
    np.testing.assert_allclose(kernel.numpy(), 1 - 0.1 * 0.5, rtol=1e-6)
    np.testing.assert_allclose(bias.numpy(), 1.0)


def test_optimizer_sgd_and_errors():
    optimizer = training.build_optimizer("sgd", 0.1, weight_decay=0.0)
    assert isinstance(optimizer, keras.optimizers.SGD) and optimizer.momentum == 0.9
    with pytest.raises(ValueError, match="optimizer"):
        training.build_optimizer("adam", 0.1)


def test_label_smoothing_loss():
    loss = training.build_loss(0.1)
    logits = np.array([[2.0, 0.0, -1.0]], "float32")
    target = np.array([[0.0, 1.0, 0.0]], "float32")
    smoothed = target * 0.9 + 0.1 / 3
    log_softmax = logits - np.log(np.exp(logits).sum())
    assert float(loss(target, logits)) == pytest.approx(-(smoothed * log_softmax).sum(), rel=1e-5)


def test_jit_compile_auto_is_xla_on_one_device_only(monkeypatch):
    import types

    import tensorflow as tf

    assert training.resolve_jit_compile("auto") is True
    assert training.resolve_jit_compile(False) is False
    # Two replicas (the real MirroredStrategy case runs in test_distribute.py).
    two = types.SimpleNamespace(num_replicas_in_sync=2)
    monkeypatch.setattr(tf.distribute, "get_strategy", lambda: two)
    assert training.resolve_jit_compile("auto") is False
    with pytest.raises(ValueError, match="jit_compile"):
        training.resolve_jit_compile("always")


def test_compile_model_uses_xla_by_default(tiny_config):
    import keras_vit

    model = keras_vit.VisionTransformer(**tiny_config)
    training.compile_model(model, total_steps=10)
    assert model.jit_compile is True
    training.compile_model(model, total_steps=10, jit_compile=False)
    assert model.jit_compile is False


def _xla_requests(monkeypatch, make_function):
    """The jit_compile values passed to tf.function while `make_function` runs."""
    import tensorflow as tf

    requests = []
    original = tf.function

    def spy(*args, **kwargs):
        requests.append(bool(kwargs.get("jit_compile")))
        return original(*args, **kwargs)

    monkeypatch.setattr(tf, "function", spy)
    make_function(force=True)
    monkeypatch.setattr(tf, "function", original)
    return requests


def _inference_xla(monkeypatch, model, kind):
    """Whether `model`'s predict or evaluate (`kind` "predict" or "test") runs XLA programs.

    Builds the function and runs it on two images, noting the `jit_compile` of
    each tf.function that is called (where batches run in parts, each part's
    function is made while the step is traced; Keras' own layers make some
    XLA functions they call only in some cases).
    """
    import tensorflow as tf

    images = np.zeros((2, *model.input_shape[1:]), "float32")
    called = []
    original = tf.function

    def spy(*args, **kwargs):
        def noted(function):
            def call(*call_args, **call_kwargs):
                called.append(bool(kwargs.get("jit_compile")))
                return function(*call_args, **call_kwargs)

            return call

        if not args:  # used as @tf.function(...)
            return lambda fn: noted(original(fn, **kwargs))
        return noted(original(*args, **kwargs))

    monkeypatch.setattr(tf, "function", spy)
    getattr(model, f"make_{kind}_function")(force=True)
    if kind == "predict":
        model.predict_on_batch(images)
    else:
        model.test_on_batch(images, np.zeros((2, *model.output_shape[1:]), "float32"))
    monkeypatch.setattr(tf, "function", original)
    getattr(model, f"make_{kind}_function")(force=True)  # without the spy's wrappers
    return any(called)


@pytest.mark.parametrize("graph_predicts", [True, False])
def test_compile_model_auto_predicts_in_graph_mode_where_it_is_faster(
    tiny_config, monkeypatch, graph_predicts
):
    """Intel with AVX-512 (oneDNN's fast products): graph-mode inference; elsewhere XLA."""
    import keras_vit
    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "graph_mode_predicts_faster", lambda: graph_predicts)
    model = keras_vit.VisionTransformer(**tiny_config)
    training.compile_model(model, total_steps=10)
    assert model.jit_compile is True
    assert any(_xla_requests(monkeypatch, model.make_train_function))
    assert _inference_xla(monkeypatch, model, "predict") is not graph_predicts
    assert _inference_xla(monkeypatch, model, "test") is not graph_predicts
    assert model.jit_compile is True
    # jit_compile=False leaves all three in graph mode, whatever the CPU.
    training.compile_model(model, total_steps=10, jit_compile=False)
    assert not any(_xla_requests(monkeypatch, model.make_train_function))
    assert not _inference_xla(monkeypatch, model, "predict")
    # jit_compile=True compiles inference too.
    training.compile_model(model, total_steps=10, jit_compile=True)
    assert _inference_xla(monkeypatch, model, "predict")
    assert _inference_xla(monkeypatch, model, "test")
    # Both kinds of function still run and agree.
    size = tiny_config["image_size"]
    images = np.random.default_rng(0).uniform(-1, 1, (2, size, size, 3)).astype("float32")
    labels = keras.utils.to_categorical([0, 1], tiny_config["num_classes"])
    model.layers[-1].kernel.assign(np.full(model.layers[-1].kernel.shape, 0.1, "float32"))
    with_xla = model.predict_on_batch(images)
    training.compile_model(model, total_steps=10)
    np.testing.assert_allclose(model.predict_on_batch(images), with_xla, rtol=1e-4, atol=1e-5)
    model.train_on_batch(images, labels)
    assert np.isfinite(model.test_on_batch(images, labels)).all()
    with pytest.raises(ValueError, match="keras.Model"):
        training.inference_without_xla("model.keras")


@pytest.mark.parametrize("cpu", ["intel-avx512", "amd-avx512", "avx2"])
def test_compile_model_auto_trains_long_sequences_in_graph_mode(
    tiny_config, monkeypatch, per_head_calls, cpu
):
    """Per-head attention (here from 2 tokens): the train step leaves XLA, and
    inference too wherever oneDNN runs AVX-512 (Intel's or AMD's)."""
    import keras_vit
    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "graph_mode_predicts_faster", lambda: cpu == "intel-avx512")
    monkeypatch.setattr(_cpu, "onednn_avx512", lambda: cpu != "avx2")
    graph_inference = cpu != "avx2"
    model = keras_vit.VisionTransformer(**tiny_config)
    assert training.plan_xla(model) == (False, not graph_inference)
    # With streams the training parts run in graph mode and only the update is XLA.
    short_rule = cpu != "intel-avx512"
    assert training.plan_xla(model, streams=2) == (True, short_rule)
    assert training.plan_xla(model, jit_compile=True) == (True, True)
    training.compile_model(model, total_steps=10)
    assert not any(_xla_requests(monkeypatch, model.make_train_function))
    assert _inference_xla(monkeypatch, model, "predict") is not graph_inference
    size = tiny_config["image_size"]
    images = np.random.default_rng(0).uniform(-1, 1, (2, size, size, 3)).astype("float32")
    labels = keras.utils.to_categorical([0, 1], tiny_config["num_classes"])
    count = len(per_head_calls)
    model.train_on_batch(images, labels)
    assert len(per_head_calls) > count  # the graph-mode step took the per-head core
    training.training_without_xla(model, False)  # undone: the model's jit_compile again
    assert model.jit_compile is not graph_inference
    assert any(_xla_requests(monkeypatch, model.make_train_function)) is not graph_inference
    with pytest.raises(ValueError, match="keras.Model"):
        training.training_without_xla("model.keras")
    # Short sequences keep XLA training, and predict in graph mode on Intel's AVX-512 only.
    short = keras_vit.VisionTransformer(**{**tiny_config, "patch_size": 32})  # 2 tokens: 1 + 1
    monkeypatch.setattr("keras_vit.layers.attention.PER_HEAD_MIN_TOKENS", 3)
    assert training.plan_xla(short) == (True, short_rule)


def test_onednn_enabled_asks_tensorflow_and_honours_the_setting(monkeypatch):
    import subprocess
    import sys

    from keras_vit import _cpu

    # TensorFlow's own answer, read in a fresh process where the setting turns oneDNN on.
    script = "from keras_vit import _cpu; print(_cpu._tensorflow_onednn_enabled())"
    environment = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, check=True
    )
    assert result.stdout.split()[-1] == "True"

    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    for answer in (True, False):
        monkeypatch.setattr(_cpu, "_tensorflow_onednn_enabled", lambda answer=answer: answer)
        assert _cpu.onednn_enabled() is answer
    monkeypatch.setattr(_cpu, "_tensorflow_onednn_enabled", lambda: True)
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    assert _cpu.onednn_enabled() is False
    # Where TensorFlow's answer cannot be read: its default rule.
    monkeypatch.setattr(_cpu, "_tensorflow_onednn_enabled", lambda: None)
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS")
    for flags, expected in [
        ({"avx2", "avx512f", "avx512_vnni"}, True),  # Xeon from Cascade Lake
        ({"avx2", "avx_vnni"}, True),
        ({"avx2", "avx512f"}, False),  # Skylake-SP: AVX-512 without VNNI
        ({"avx2", "fma"}, False),  # AMD EPYC before Zen 4
    ]:
        monkeypatch.setattr(_cpu, "cpu_flags", lambda flags=flags: flags)
        assert _cpu.onednn_enabled() is expected
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "1")
    assert _cpu.onednn_enabled() is True


def test_onednn_avx512_reads_the_cpu_flags_and_onednn_settings(monkeypatch):
    from keras_vit import _cpu

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    monkeypatch.setattr(_cpu, "_tensorflow_onednn_enabled", lambda: True)
    for flags, expected in [
        ({"avx2", "avx512f", "avx512bw"}, True),
        ({"avx2", "fma"}, False),  # e.g. AMD EPYC before Zen 4
        (set(), False),  # unreadable /proc/cpuinfo, or not x86
    ]:
        monkeypatch.setattr(_cpu, "cpu_flags", lambda flags=flags: flags)
        assert _cpu.onednn_avx512() is expected
    monkeypatch.setattr(_cpu, "cpu_flags", lambda: {"avx2", "avx512f"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert _cpu.onednn_avx512() is False
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert _cpu.onednn_avx512() is True
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "false")
    assert _cpu.onednn_avx512() is False
    # AVX-512 without oneDNN (TensorFlow's default where the CPU lacks VNNI): no.
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS")
    monkeypatch.setattr(_cpu, "_tensorflow_onednn_enabled", lambda: False)
    assert _cpu.onednn_avx512() is False


def test_graph_mode_predicts_faster_on_intel_cpus_with_onednn_avx512(tmp_path, monkeypatch):
    from keras_vit import _cpu

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
        "flags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\nvendor_id\t: GenuineIntel\n"
    )
    assert _cpu.cpu_vendor(str(cpuinfo)) == "AuthenticAMD"  # the first CPU's
    assert _cpu.cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert _cpu.cpu_vendor(str(tmp_path / "missing")) == ""
    assert _cpu.cpu_flags(str(tmp_path / "missing")) == set()
    for avx512, vendor, expected in [
        (True, "GenuineIntel", True),  # the Xeon of docs/performance.md
        (True, "AuthenticAMD", False),  # EPYC Zen 4: XLA predicts faster
        (False, "GenuineIntel", False),  # no oneDNN, or no AVX-512
        (True, "", False),  # unreadable /proc/cpuinfo
    ]:
        monkeypatch.setattr(_cpu, "onednn_avx512", lambda avx512=avx512: avx512)
        monkeypatch.setattr(_cpu, "cpu_vendor", lambda vendor=vendor: vendor)
        assert _cpu.graph_mode_predicts_faster() is expected


def test_native_bfloat16_reads_the_cpu_flags_and_onednn_settings(tmp_path, monkeypatch):
    from keras_vit import _cpu

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n")
    assert {"avx2", "amx_bf16"} <= _cpu.cpu_flags(str(cpuinfo))
    assert _cpu.cpu_flags(str(tmp_path / "missing")) == set()

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    monkeypatch.setattr(_cpu, "_tensorflow_onednn_enabled", lambda: True)
    for flags, native in [
        ({"avx512f", "avx512_bf16"}, True),
        ({"amx_bf16"}, True),
        ({"avx2"}, False),
    ]:
        monkeypatch.setattr(_cpu, "cpu_flags", lambda flags=flags: flags)
        assert _cpu.native_bfloat16() is native
    monkeypatch.setattr(_cpu, "cpu_flags", lambda: {"amx_bf16"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core")
    assert _cpu.native_bfloat16() is False
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert _cpu.native_bfloat16() is True
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    assert _cpu.native_bfloat16() is False


@pytest.mark.parametrize("native", [True, False])
def test_compile_model_auto_runs_bfloat16_where_the_cpu_runs_it_fast(
    tiny_config, monkeypatch, native
):
    """CPU bfloat16 instructions: graph mode (oneDNN) throughout; none: XLA throughout."""
    import keras_vit
    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "native_bfloat16", lambda: native)
    model = keras_vit.VisionTransformer(**tiny_config, dtype="mixed_bfloat16")
    training.compile_model(model, total_steps=10)
    assert model.jit_compile is not native
    assert any(_xla_requests(monkeypatch, model.make_train_function)) is not native
    assert _inference_xla(monkeypatch, model, "predict") is not native
    assert _inference_xla(monkeypatch, model, "test") is not native
    size = tiny_config["image_size"]
    images = np.random.default_rng(0).uniform(-1, 1, (2, size, size, 3)).astype("float32")
    labels = keras.utils.to_categorical([0, 1], tiny_config["num_classes"])
    assert np.isfinite(model.train_on_batch(images, labels)[0])
    assert model.predict_on_batch(images).dtype == np.float32
    # With streams the parts already run in graph mode; the update stays XLA.
    # Without the instructions, use_streams warns that its parts will be slow.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        training.compile_model(model, total_steps=10, streams=2)
    assert model.jit_compile is True
    assert any("bfloat16" in str(w.message) for w in caught) is not native
    # float32 models and an explicit jit_compile are left as they were.
    monkeypatch.setattr(_cpu, "graph_mode_predicts_faster", lambda: True)
    float32 = keras_vit.VisionTransformer(**tiny_config)
    training.compile_model(float32, total_steps=10)
    assert float32.jit_compile is True
    assert not any(_xla_requests(monkeypatch, float32.make_predict_function))
    training.compile_model(model, total_steps=10, jit_compile=True)
    assert model.jit_compile is True
    assert _inference_xla(monkeypatch, model, "predict")


@pytest.mark.parametrize("graph_predicts", [True, False])
def test_compile_fast_gives_your_optimizer_and_loss_compile_models_plan(
    tiny_config, monkeypatch, graph_predicts
):
    import keras_vit
    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "graph_mode_predicts_faster", lambda: graph_predicts)
    model = keras_vit.VisionTransformer(**tiny_config)
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    loss = keras.losses.CategoricalCrossentropy(from_logits=True)
    returned = training.compile_fast(
        model, optimizer, loss, metrics=["accuracy"], steps_per_execution=2
    )
    assert returned is model and model.optimizer is optimizer and model.loss is loss
    assert model.steps_per_execution == 2  # the other compile() arguments reach Keras
    assert optimizer.built  # slots made now, not while the first step is traced
    # The same plan as compile_model: XLA training, XLA inference only below AVX-512.
    assert any(_xla_requests(monkeypatch, model.make_train_function))
    assert _inference_xla(monkeypatch, model, "predict") is not graph_predicts
    assert _inference_xla(monkeypatch, model, "test") is not graph_predicts
    size = tiny_config["image_size"]
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (4, size, size, 3)).astype("float32")
    labels = keras.utils.to_categorical([0, 1, 2, 0], tiny_config["num_classes"])
    before = model.predict_on_batch(images)
    history = model.fit(images, labels, batch_size=2, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert not np.allclose(model.predict_on_batch(images), before)  # SGD moved the weights
    # Two streams: the batch runs as two parts, with the same outputs.
    whole = model.predict_on_batch(images)
    training.compile_fast(model, keras.optimizers.SGD(0.05), loss, jit_compile=False, streams=2)
    assert not _inference_xla(monkeypatch, model, "predict")
    np.testing.assert_allclose(model.predict_on_batch(images), whole, rtol=1e-4, atol=1e-5)
    # No optimizer: evaluation only, still with the plan's inference.
    training.compile_fast(model, None, loss, metrics=["accuracy"])
    assert model.optimizer is None
    assert _inference_xla(monkeypatch, model, "test") is not graph_predicts
    assert np.isfinite(model.evaluate(images, labels, verbose=0)).all()
    with pytest.raises(ValueError, match="keras.Model"):
        training.compile_fast("model.keras", optimizer, loss)
    with pytest.raises(ValueError, match="streams"):
        training.compile_fast(model, optimizer, loss, streams=0)
    with pytest.raises(ValueError, match="jit_compile"):
        training.compile_fast(model, optimizer, loss, jit_compile="always")


def test_compile_model_builds_optimizer_slots_before_the_first_step(tiny_config):
    import keras_vit

    model = keras_vit.VisionTransformer(**tiny_config)
    training.compile_model(model, total_steps=10, jit_compile=False)
    assert model.optimizer.built
    slots = {id(v) for v in model.optimizer.variables}
    # One first and second moment per trainable variable, created before any step.
    assert len(model.optimizer.variables) >= 2 * len(model.trainable_variables)
    size = tiny_config["image_size"]
    images = np.zeros((2, size, size, 3), "float32")
    labels = keras.utils.to_categorical([0, 1], tiny_config["num_classes"])
    model.predict_on_batch(images)
    model.train_on_batch(images, labels)
    assert {id(v) for v in model.optimizer.variables} == slots  # the same slots trained


def test_compile_model_leaves_an_unbuilt_model_to_keras():
    class Unbuilt(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, inputs):
            return self.dense(inputs)

    model = Unbuilt()
    training.compile_model(model, total_steps=4, jit_compile=False)
    assert not model.optimizer.built
    model.train_on_batch(np.zeros((2, 5), "float32"), np.eye(3, dtype="float32")[[0, 1]])
    assert model.optimizer.built


def test_scaled_learning_rate():
    assert training.scaled_learning_rate(4e-3, 64) == pytest.approx(1e-3)


def test_strategy_names(monkeypatch):
    import tensorflow as tf

    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert training.get_strategy("default") is tf.distribute.get_strategy()
    assert training.get_strategy("auto").num_replicas_in_sync == 1
    with pytest.raises(ValueError, match="strategy"):
        training.get_strategy("horovod")


def test_is_chief(monkeypatch):
    cluster = '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": %d}}'
    monkeypatch.setenv("TF_CONFIG", cluster % 0)
    assert training.is_chief() and training._tf_config_workers() == 2
    monkeypatch.setenv("TF_CONFIG", cluster % 1)
    assert not training.is_chief()


@pytest.mark.parametrize("backup_steps", [2, 3, 0])
def test_every_backup_follows_the_history_row_of_each_epoch_it_has_finished(
    tmp_path, monkeypatch, backup_steps
):
    """A run killed right after a backup resumes at the backup's step. Were an epoch
    finished there without its row in history.csv (and best.keras's look at it), the
    resumed run would skip that epoch's validation and row. 3 steps per epoch: at
    backup_steps=3 a step backup falls on each epoch's last step."""
    output = tmp_path / "run"
    seen = []
    save = training.StepBackupAndRestore._save_model

    def recording_save(callback):
        finished = int(callback.model.optimizer.iterations.numpy()) // 3
        with open(output / "history.csv") as file:
            rows = max(len(file.read().splitlines()) - 1, 0)  # less the header, once written
        seen.append((finished, rows))
        save(callback)

    monkeypatch.setattr(training.StepBackupAndRestore, "_save_model", recording_save)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="sgd", loss=loss, metrics=["accuracy"])
    x = np.random.default_rng(0).normal(size=(12, 4)).astype("float32")
    y = np.arange(12) % 2
    callbacks = training.build_callbacks(str(output), backup_steps=backup_steps)
    model.fit(x, y, batch_size=4, epochs=3, validation_data=(x, y), callbacks=callbacks, verbose=0)
    assert [finished for finished, _ in seen][-1] == 3  # the last epoch's end was backed up
    for finished, rows in seen:
        assert rows >= finished, seen


@pytest.mark.parametrize("jit_compile", [False, True])
def test_compile_model_trains_on_integer_class_ids_as_on_one_hot_labels(tmp_path, jit_compile):
    """Integer labels, (N,) or (N, 1), gave Keras' "target and output must have the
    same rank" error: the recipe's loss took one-hot labels only. Each kind of label
    now gives the loss and accuracy of the one-hot labels (computed here in NumPy),
    and the compiled model saves and loads."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 4)).astype("float32")
    ids = np.array([0, 2, 1, 2, 0, 1])
    one_hot = np.eye(3, dtype="float32")[ids]
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    training.compile_model(model, total_steps=10, label_smoothing=0.1, jit_compile=jit_compile)
    logits = model.predict(x, verbose=0)
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected_loss = -((one_hot * 0.9 + 0.1 / 3) * log_softmax).sum(-1).mean()
    expected_accuracy = (logits.argmax(-1) == ids).mean()
    for labels in (ids, ids[:, None], ids.astype("float32"), one_hot):
        loss, accuracy = model.evaluate(x, labels, verbose=0)
        assert loss == pytest.approx(expected_loss, rel=1e-5), labels.shape
        assert accuracy == pytest.approx(expected_accuracy), labels.shape
    model.fit(x, ids, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.loss, training.CrossEntropy)
    assert loaded.loss.label_smoothing == pytest.approx(0.1)
    np.testing.assert_allclose(
        loaded.evaluate(x, ids, verbose=0), model.evaluate(x, one_hot, verbose=0), rtol=1e-6
    )
