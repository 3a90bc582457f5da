"""TensorFlow's pooling CPU allocator, which importing keras_vit turns on (keras_vit/_memory.py)."""

import os
import subprocess
import sys

import pytest

from keras_vit import _memory


def test_pool_is_asked_for_with_a_cap_at_the_machine_memory():
    environ = {}
    assert _memory.pool_cpu_memory(environ) is True
    assert environ[_memory.POOL_ENV] == "true"
    memory = _memory.physical_memory_mb()
    assert memory and memory > 0
    assert environ[_memory.LIMIT_ENV] == str(memory)


@pytest.mark.parametrize("choice", ["false", "0", "true"])
def test_the_users_choice_is_kept(choice):
    environ = {_memory.POOL_ENV: choice}
    assert _memory.pool_cpu_memory(environ) is False
    assert environ == {_memory.POOL_ENV: choice}  # no cap added either


def test_the_users_cap_is_kept():
    environ = {_memory.LIMIT_ENV: "1024"}
    assert _memory.pool_cpu_memory(environ) is True
    assert environ == {_memory.POOL_ENV: "true", _memory.LIMIT_ENV: "1024"}


def _pooled_in_a_fresh_process(**env):
    """Import keras_vit in a new interpreter, run one operation, report the allocator."""
    code = (
        "import keras_vit, keras\n"
        "from keras_vit import _memory\n"
        "keras.ops.convert_to_numpy(keras.ops.ones((4, 4)) * 2)\n"
        "print(_memory.cpu_memory_pooled())\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != _memory.POOL_ENV}
    environ.update(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3", **env)
    done = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_importing_keras_vit_turns_the_pool_on_and_the_user_can_turn_it_off():
    pytest.importorskip("tensorflow")
    # The setting governs TensorFlow's own CPU allocator, which it uses where
    # oneDNN is off (TensorFlow's default on CPUs without VNNI or AMX).
    without_onednn = {"TF_ENABLE_ONEDNN_OPTS": "0"}
    assert _pooled_in_a_fresh_process(**without_onednn) == "True"
    assert _pooled_in_a_fresh_process(**{_memory.POOL_ENV: "false"}, **without_onednn) == "False"
    # With oneDNN on, TensorFlow allocates through oneDNN's allocator, a pool
    # whatever the setting says (found on an AMD EPYC with AVX-512).
    with_onednn = {"TF_ENABLE_ONEDNN_OPTS": "1", _memory.POOL_ENV: "false"}
    assert _pooled_in_a_fresh_process(**with_onednn) == "True"
