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


# --------------------------------------------------------------------------- freed memory handed back


def _readings(values):
    """A fake `resident()` giving `values` in turn, then None (which ends the loop)."""
    values = iter(values)
    return lambda: next(values, None)


def test_the_loop_trims_when_the_resident_set_has_grown_by_the_threshold():
    trims = []
    growth = 100
    # start 1000; +50 (no); +120 over the low (trim, then 1040 after it); a dip to 990
    # lowers the low; +99 over it (no); +100 over it (trim, then 1000).
    readings = [1000, 1050, 1120, 1040, 990, 1089, 1090, 1000]
    count = _memory.keep_returning(_readings(readings), trims.append, lambda: True, growth=growth)
    assert count == 2
    assert trims == [0, 0]


def test_the_loop_stops_when_told_and_when_the_resident_set_cannot_be_read():
    waits = iter([True, True, False])
    assert _memory.keep_returning(lambda: 10**9, pytest.fail, lambda: next(waits)) == 0
    assert _memory.keep_returning(lambda: None, pytest.fail, lambda: True) == 0


@pytest.mark.parametrize("value", ["0", "false", "Off", " no "])
def test_the_user_can_turn_it_off(value):
    assert _memory.return_freed_memory({_memory.RETURN_ENV: value}) is False


def test_resident_bytes_reads_this_process():
    resident = _memory.resident_bytes()
    if resident is None:
        pytest.skip("no /proc/self/statm here")
    block = bytearray(64 * 2**20)  # zero pages are touched by bytearray's memset
    assert _memory.resident_bytes() >= resident + 32 * 2**20
    del block


_FRAGMENTED_HEAP = r"""
import ctypes, os, sys, time
sys.path.insert(0, os.environ["KERAS_VIT_SOURCE"])
from keras_vit import _memory
if os.environ.get("START") == "1":
    assert _memory.return_freed_memory({})
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
base = _memory.resident_bytes()
def allocate(count, size):
    blocks = [libc.malloc(size) for _ in range(count)]
    for block in blocks:
        libc.memset(block, 1, size)
    return blocks
# 256 MiB of 4 KiB blocks; every 16th stays in use, so glibc cannot give the
# rest back by shrinking the heap from its top.
blocks = allocate(65536, 4096)
for i, block in enumerate(blocks):
    if i % 16:
        libc.free(block)
# Then the process grows again with blocks too large for the 60 KiB holes
# (and below glibc's 128 KiB threshold for a block of its own mapping).
more = allocate(800, 100000)
time.sleep(3 * _memory.RETURN_PERIOD_S + 1)
print(base, _memory.resident_bytes())
"""


@pytest.mark.parametrize("start", [True, False], ids=["returning", "not-started"])
def test_freed_heap_pages_are_handed_back_once_the_process_grows(start):
    if _memory.resident_bytes() is None or _memory._glibc_malloc_trim() is None:
        pytest.skip("needs glibc's malloc_trim and /proc/self/statm")
    source = os.path.dirname(os.path.dirname(os.path.abspath(_memory.__file__)))
    env = dict(os.environ, KERAS_VIT_SOURCE=source, START="1" if start else "0")
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    done = subprocess.run(
        [sys.executable, "-c", _FRAGMENTED_HEAP],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    base, final = (int(x) for x in done.stdout.split())
    # 256 MiB allocated, 240 MiB of it freed (16 MiB stay in use), then 76 MiB
    # more: without the thread the freed pages stay resident (~330 MiB above
    # where the process started); with it they go back, whenever the thread
    # happened to look (~92 MiB above). Measured from the start, so that the
    # test does not depend on when the thread trimmed.
    grown = (final - base) / 2**20
    if start:
        assert grown < 200, grown
    else:
        assert grown > 280, grown
