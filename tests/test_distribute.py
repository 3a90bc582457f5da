"""tf.distribute: MirroredStrategy on 2 logical CPUs, MultiWorkerMirroredStrategy on 2 workers."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.tensorflow_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MIRRORED = r"""
import json, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np, keras_vit
from keras_vit import training

rng = np.random.default_rng(0)
x = rng.uniform(-1, 1, (16, 16, 16, 3)).astype("float32")
y = np.eye(3, dtype="float32")[np.arange(16) % 3]

def run(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras_vit.VisionTransformer(image_size=16, patch_size=8, num_layers=1,
            num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=3)
        training.compile_model(model, total_steps=3, learning_rate=1e-2, warmup_steps=1)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    model.fit(data, epochs=1, steps_per_epoch=3, verbose=0)
    return [w.numpy() for w in model.weights]

mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
assert mirrored.num_replicas_in_sync == 2
one, two = run(tf.distribute.get_strategy()), run(mirrored)
print(json.dumps({
    "max_diff": max(float(np.abs(a - b).max()) for a, b in zip(one, two)),
    "replicas": mirrored.num_replicas_in_sync,
}))
"""


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT)
    env.pop("TF_CONFIG", None)
    env.update(extra)
    return env


def test_mirrored_two_cpus_matches_one_device():
    result = subprocess.run(
        [sys.executable, "-c", MIRRORED],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["replicas"] == 2
    assert report["max_diff"] < 1e-5, report


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_multi_worker_two_processes_end_equal(tmp_path):
    rng = np.random.default_rng(0)
    y = np.arange(64) % 2
    x = (rng.integers(0, 100, size=(64, 16, 16, 3)) + y[:, None, None, None] * 150).astype("uint8")
    npz = tmp_path / "d.npz"
    np.savez(npz, x_train=x, y_train=y, x_test=x[:16], y_test=y[:16])
    workers = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    out = tmp_path / "run"
    args = [sys.executable, "-m", "keras_vit", "train", "--data", str(npz), "--model", "vit-test"]
    args += ["--image-size", "16", "--batch-size", "16", "--epochs", "1", "--quiet"]
    args += ["--strategy", "multiworker", "--output", str(out)]
    codes, logs = _two_workers(args, workers, tmp_path)
    assert codes == [0, 0], logs
    # The run is complete: no backup is left, the workers' included.
    assert sorted(path.name for path in out.glob("**/backup")) == []

    import keras

    import keras_vit  # noqa: F401

    chief = keras.models.load_model(out / "model.keras")
    other = keras.models.load_model(out / "worker-worker-1" / "model.keras")
    for a, b in zip(chief.weights, other.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    assert (out / "saved_model").is_dir()
    # Again over it: the second worker starts afresh too (it resumed a stale backup).
    workers = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    codes, logs = _two_workers(args + ["--overwrite"], workers, tmp_path)
    assert codes == [0, 0], logs


def _two_workers(args, workers, tmp_path):
    """Exit codes and log tails of `args` run as the two workers of `workers`."""
    processes = []
    for index in range(2):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        log = open(tmp_path / f"worker{index}.log", "w")
        processes.append(
            subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(TF_CONFIG=json.dumps(config)),
                cwd=ROOT,
            )
        )
    try:
        codes = [p.wait(timeout=300) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"worker{i}.log").read_text()[-2000:] for i in range(2)]
    return codes, logs
