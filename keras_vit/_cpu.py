"""What the CPU computes fast: picks graph mode or XLA for inference and bfloat16 models.

TensorFlow's graph-mode kernels (oneDNN) run bfloat16 matrix products on the
CPU's own bfloat16 instructions (AVX512_BF16, AMX) where it has them, and
emulate them, far slower, where it does not; XLA on the CPU is in between.
Measured on a 2-core Xeon with AMX (docs/performance.md, "bfloat16 on the
CPU"): a mixed_bfloat16 ViT-S/16 trains 1.55x faster in graph mode than with
XLA; with oneDNN capped below bfloat16 (`ONEDNN_MAX_CPU_ISA=AVX512_CORE`, as
on a CPU without it), graph mode trains 3.2x and predicts 3.3x slower than XLA.
"""

import os

import keras

# oneDNN's ONEDNN_MAX_CPU_ISA values below AVX-512, and those without bfloat16.
_ISAS_WITHOUT_AVX512 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2"}
_ISAS_WITHOUT_BFLOAT16 = _ISAS_WITHOUT_AVX512 | {"AVX512_CORE", "AVX512_CORE_VNNI"}
_BFLOAT16_FLAGS = {"avx512_bf16", "amx_bf16"}


def _cpuinfo_field(names, path="/proc/cpuinfo"):
    """The first CPU's value of the first of `names` in `path`; "" where it cannot be read."""
    try:
        with open(path) as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() in names:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags(path="/proc/cpuinfo"):
    """The CPU's feature flags as Linux lists them; empty where it cannot be read."""
    return set(_cpuinfo_field(("flags", "Features"), path).split())


def cpu_vendor(path="/proc/cpuinfo"):
    """The CPU's vendor as Linux lists it ("GenuineIntel", "AuthenticAMD"); "" where unknown."""
    return _cpuinfo_field(("vendor_id",), path)


def native_bfloat16():
    """True when TensorFlow's oneDNN kernels can compute bfloat16 on this CPU's instructions.

    x86 CPUs with AVX512_BF16 or AMX-BF16 (Intel from Cooper Lake and Sapphire
    Rapids, AMD from Zen 4). False elsewhere, with oneDNN turned off
    (`TF_ENABLE_ONEDNN_OPTS=0`) or capped below bfloat16 (`ONEDNN_MAX_CPU_ISA`).
    """
    return _onednn_can_use(_BFLOAT16_FLAGS, _ISAS_WITHOUT_BFLOAT16)


def computes_in_bfloat16(model):
    """True when `model` or one of its layers computes in bfloat16 (e.g. mixed_bfloat16)."""
    layers = [model, *getattr(model, "layers", [])]
    return any(getattr(layer, "compute_dtype", None) == "bfloat16" for layer in layers)


def onednn_avx512():
    """True when TensorFlow's graph-mode float32 products run on oneDNN's AVX-512 kernels.

    On such a CPU (a 2-core Xeon with AVX-512 and AMX here) ViT inference in
    graph mode, whose oneDNN kernels also fuse each product with its bias and
    GELU and the layer norm, is about 10% faster than XLA. On a CPU with AVX2
    and no AVX-512 (a 2-core AMD EPYC here, where TensorFlow leaves oneDNN
    off) XLA predicts ViT-S/16 and ViT-B/16 1.2-1.5x faster than graph mode
    (docs/performance.md, "Two CPUs"). False where TensorFlow runs without
    oneDNN (`onednn_enabled`: its default on CPUs without VNNI or AMX, or
    `TF_ENABLE_ONEDNN_OPTS=0`) or capped below AVX-512 (`ONEDNN_MAX_CPU_ISA`).
    """
    return _onednn_can_use({"avx512f"}, _ISAS_WITHOUT_AVX512)


def graph_mode_predicts_faster():
    """True where TensorFlow's graph mode predicts a float32 ViT faster than XLA.

    That is an Intel CPU whose oneDNN kernels run AVX-512 (`onednn_avx512`):
    on a 2-core Xeon with AVX-512 and AMX, graph mode's oneDNN products, fused
    with their bias, GELU and layer norm, predicted ViT-S/16 about 10% faster
    than XLA. Everywhere else XLA predicts as fast or faster: on a 2-core AMD
    EPYC with AVX-512 (Zen 4), where oneDNN is on too, XLA predicted ViT-S/16
    1.08-1.11x as fast as graph mode, and ViT-B/16 and ViT-S/16 384 level
    (0.97-1.03x); on one with AVX2 only (Zen 3), where oneDNN is off, 1.2-1.5x
    (docs/performance.md, "Two CPUs" and "A third CPU").
    """
    return onednn_avx512() and cpu_vendor() == "GenuineIntel"


# The CPU features for which TensorFlow turns its oneDNN kernels on by default
# (x86 builds since TensorFlow 2.9); elsewhere TF_ENABLE_ONEDNN_OPTS=1 turns them on.
_ONEDNN_DEFAULT_FLAGS = {
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
}


def onednn_enabled():
    """True when TensorFlow's graph-mode CPU kernels are oneDNN's in this process.

    TensorFlow decides this when it loads: on by default on x86 CPUs with
    AVX512_VNNI, AVX512_BF16, AVX-VNNI or AMX (most Xeons since Cascade Lake,
    AMD from Zen 4), off on the others (an AMD EPYC with AVX2 here, a Xeon
    with AVX-512 but no VNNI), and `TF_ENABLE_ONEDNN_OPTS` overrides it.
    TensorFlow's own answer is used where it can be read; otherwise the same
    rule from the environment and `/proc/cpuinfo`.
    """
    setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "").strip().lower()
    if setting in ("0", "false"):
        return False
    enabled = _tensorflow_onednn_enabled()
    if enabled is None:
        return setting in ("1", "true") or bool(cpu_flags() & _ONEDNN_DEFAULT_FLAGS)
    return enabled


def _tensorflow_onednn_enabled():
    """TensorFlow's own `IsMklEnabled()`; None where its private module cannot be read."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return None


def _onednn_can_use(flags, isas_without):
    """True when oneDNN is on, not capped to one of `isas_without`, and the CPU has one of `flags`."""
    if not onednn_enabled():
        return False
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in isas_without:
        return False
    return bool(cpu_flags() & flags)


def jax_on_cpu():
    """True on the JAX backend when JAX computes on the CPU (its default backend)."""
    if keras.backend.backend() != "jax":
        return False
    import jax

    return jax.default_backend() == "cpu"


def cpu_only_tensorflow():
    """True on the TensorFlow backend when no GPU or TPU is visible."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return not (tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))
