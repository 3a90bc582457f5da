"""Shared test settings: quiet TensorFlow, a backend marker, tiny models."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# A tiny configuration: seconds per test on two cores.
TINY = dict(
    image_size=32,
    patch_size=8,
    num_layers=2,
    num_heads=2,
    hidden_dim=32,
    mlp_dim=64,
    num_classes=10,
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "tensorflow_only: needs TensorFlow itself (tf.data, tf.distribute, SavedModel)"
    )


def pytest_collection_modifyitems(config, items):
    if keras.backend.backend() == "tensorflow":
        return
    skip = pytest.mark.skip(reason=f"needs the TensorFlow backend, not {keras.backend.backend()}")
    for item in items:
        if "tensorflow_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_clear():
    keras.utils.set_random_seed(0)
    yield
    keras.config.set_dtype_policy("float32")
    # No forced gc.collect() after every test: over a whole run the heap grows and
    # each full collection took ~2 s by the end (Python's own collector still runs).
    keras.backend.clear_session(free_memory=False)


@pytest.fixture
def tiny_config():
    return dict(TINY)


@pytest.fixture
def images():
    return np.random.default_rng(0).uniform(-1, 1, size=(2, 32, 32, 3)).astype("float32")


@pytest.fixture
def npz(tmp_path):
    """A .npz of 96 training and 24 test images of 16 x 16 in 3 classes told apart by
    brightness, as `keras-vit train --data` takes it."""
    rng = np.random.default_rng(0)
    y = np.arange(96) % 3
    x = (rng.integers(0, 60, size=(96, 16, 16, 3)) + y[:, None, None, None] * 90).astype("uint8")
    path = tmp_path / "tiny.npz"
    np.savez(path, x_train=x, y_train=y, x_test=x[:24], y_test=y[:24])
    return str(path)


@pytest.fixture
def fused_calls(monkeypatch):
    """Makes keras_vit's attention call `keras.ops.dot_product_attention`, as it does on
    JAX with a GPU (here: Keras' plain implementation of it); counts those calls."""
    from keras_vit.layers import attention

    calls = []
    fused = attention._fused_attention
    monkeypatch.setattr(attention, "_fuses_attention", lambda: True)
    monkeypatch.setattr(attention, "_fused_attention", lambda *a: calls.append(1) or fused(*a))
    return calls


@pytest.fixture
def per_head_calls(monkeypatch):
    """Makes keras_vit take the per-head attention core from 2 tokens on (TensorFlow
    on a CPU outside XLA, JAX on its CPU backend); counts its calls."""
    from keras_vit import _cpu
    from keras_vit.layers import attention

    if not (_cpu.cpu_only_tensorflow() or _cpu.jax_on_cpu()):
        pytest.skip("the per-head core runs on TensorFlow or JAX, on the CPU")

    calls = []
    per_head = attention._attention_core_per_head
    monkeypatch.setattr(attention, "PER_HEAD_MIN_TOKENS", 2)
    monkeypatch.setattr(
        attention, "_attention_core_per_head", lambda *a: calls.append(1) or per_head(*a)
    )
    return calls
