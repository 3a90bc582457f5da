"""TensorFlow's pooling CPU allocator, turned on when keras_vit is imported.

By default TensorFlow allocates CPU tensors with malloc. glibc serves every
block above 32 MB with its own mmap and returns it with munmap, so the large
buffers of a training step (XLA's temporary buffer: about 1.1 GB at ViT-B/16,
batch 8) are handed back to the kernel after every step and faulted in again,
page by page, in the next one: 276,000 page faults and 0.7 s of kernel time
per ViT-B/16 step. When another process has run in between (a data pipeline,
an evaluation, another job on the machine), each fault costs more: 2.6-4.2 s
of kernel time, and the step took 6.6-7.5 s instead of 5.4 s. TensorFlow's
BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC`) keeps the memory it has allocated
and reuses it: no page faults after the first step, 4.9-5.0 s per step
(docs/performance.md, "CPU memory: the pooling allocator").

TensorFlow reads the setting once, when it creates its CPU device, at the
first operation it runs. So keras_vit sets it when it is imported, and only
where the user has not chosen: `TF_CPU_ALLOCATOR_USE_BFC=false` in the
environment keeps malloc. The pool's cap (`TF_CPU_BFC_MEM_LIMIT_IN_MB`,
64 GB by TensorFlow's default) is raised or lowered to the machine's physical
memory, unless set. The pool grows as the process needs memory and does not
shrink: the process keeps its peak resident set until it exits.

Where TensorFlow runs oneDNN (its default on CPUs with AVX512_VNNI,
AVX512_BF16, AVX-VNNI or AMX, or `TF_ENABLE_ONEDNN_OPTS=1`), it allocates CPU
tensors through oneDNN's own allocator, which pools as well, and the setting
changes nothing: malloc then needs `TF_ENABLE_ONEDNN_OPTS=0` too (seen on an
AMD EPYC with AVX-512).

Freed memory handed back (`return_freed_memory`, which `compile_fast` and
`compile_model` start): while TensorFlow traces and compiles a step, glibc's
heap fills with blocks that are freed again but stay resident, scattered
among blocks still in use, so the process's resident set only grows. A
thread checks the resident set four times a second and, each time it has
grown by 32 MiB since the last look at its low point, asks glibc to hand the
free pages back (`malloc_trim`). Steady training does not grow the resident
set, so the thread then only reads `/proc/self/statm`. It lowered the peak
of ViT-S/16 224 and ViT-B/16 (with and without `remat`) training processes
by 0.17-0.18 GB, wherever an XLA train step is compiled (docs/performance.md,
"Freed memory handed back").
`KERAS_VIT_RETURN_FREED_MEMORY=0` turns it off.
"""

import ctypes
import os
import threading
import time

POOL_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
LIMIT_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
RETURN_ENV = "KERAS_VIT_RETURN_FREED_MEMORY"
# How often the thread reads the resident set, and by how much it must have
# grown before glibc is asked to hand free pages back.
RETURN_PERIOD_S = 0.25
RETURN_GROWTH_BYTES = 32 * 2**20
_returning = {"pid": None}


def physical_memory_mb():
    """The machine's physical memory in MiB; None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError, AttributeError):
        return None


def pool_cpu_memory(environ=None):
    """Ask TensorFlow for its pooling CPU allocator, unless the user has chosen.

    Returns True when this call set `TF_CPU_ALLOCATOR_USE_BFC`, False when the
    environment already had it (whatever its value). It has an effect only if
    TensorFlow has not run an operation yet in this process.
    """
    environ = os.environ if environ is None else environ
    if environ.get(POOL_ENV, "").strip():
        return False
    environ[POOL_ENV] = "true"
    if not environ.get(LIMIT_ENV, "").strip():
        memory = physical_memory_mb()
        if memory:
            environ[LIMIT_ENV] = str(memory)
    return True


def cpu_memory_pooled():
    """Whether this process's TensorFlow CPU device allocates from the BFC pool.

    Answers for TensorFlow whatever Keras' backend is (on JAX, tf.data still
    allocates through it). Creates the CPU device if TensorFlow has not yet;
    False where TensorFlow is not installed.
    """
    try:
        import tensorflow as tf
    except ImportError:
        return False
    try:
        tf.config.experimental.get_memory_info("CPU:0")
    except ValueError:  # "Allocator stats not available": malloc, not the pool
        return False
    return True


def resident_bytes():
    """This process's resident set in bytes (`/proc/self/statm`); None where unreadable."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _glibc_malloc_trim():
    """glibc's `malloc_trim(pad)`, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc, or not a POSIX loader
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def keep_returning(resident, trim, wait, growth=RETURN_GROWTH_BYTES):
    """The returning thread's loop; returns how many times it trimmed.

    After each `wait()` (False ends the loop) it reads `resident()` and calls
    `trim(0)` when the resident set is `growth` bytes or more above its lowest
    reading since the last trim. Ends when `resident()` gives None.
    """
    low = resident()
    trims = 0
    while low is not None and wait():
        now = resident()
        if now is None:
            break
        if now - low >= growth:
            trim(0)
            trims += 1
            now = resident()
            if now is None:
                break
            low = now
        else:
            low = min(low, now)
    return trims


def _sleep_a_period():
    time.sleep(RETURN_PERIOD_S)
    return True


def return_freed_memory(environ=None):
    """Starts, once per process, the thread that hands freed heap memory back.

    See the module's docstring. Returns True when the thread runs (started now
    or earlier in this process), False when `KERAS_VIT_RETURN_FREED_MEMORY` is
    0, false, no or off, or where glibc's `malloc_trim` or `/proc/self/statm`
    is missing (macOS, Windows, musl).
    """
    environ = os.environ if environ is None else environ
    if environ.get(RETURN_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    if _returning["pid"] == os.getpid():
        return True
    trim = _glibc_malloc_trim()
    if trim is None or resident_bytes() is None:
        return False
    thread = threading.Thread(
        target=keep_returning,
        args=(resident_bytes, trim, _sleep_a_period),
        name="keras_vit-return-freed-memory",
        daemon=True,
    )
    thread.start()
    _returning["pid"] = os.getpid()  # a forked child starts its own
    return True


# At import, before TensorFlow runs an operation (keras_vit/__init__.py imports
# this module first).
pool_cpu_memory()
