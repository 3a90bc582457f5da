"""OpenBLAS's products inside a TensorFlow XLA program, for micro.py grads.

NumPy's OpenBLAS runs the model's products faster than XLA does when each is
timed alone, and no TensorFlow kernel calls it. `build()` compiles
benchmarks/xla_blas.cc, an XLA custom call that runs a product in NumPy's own
OpenBLAS, against TensorFlow's headers and loads it, so that an XLA program can
put its products there and be timed against the same program on XLA's products.
A benchmark tool only: keras_vit does not use it.
"""

import contextlib
import ctypes
import glob
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peak  # noqa: E402

SOURCE = os.path.join(HERE, "xla_blas.cc")
TARGET = "keras_vit_bench_sgemm"
_loaded = {}


def _numpy_openblas():
    """NumPy's bundled OpenBLAS (the 64-bit-index build of NumPy 2's wheels), or None."""
    import numpy as np

    site = os.path.dirname(os.path.dirname(np.__file__))
    for path in sorted(glob.glob(os.path.join(site, "numpy.libs", "libscipy_openblas64_*.so"))):
        library = ctypes.CDLL(path)
        if hasattr(library, "scipy_cblas_sgemm64_"):
            return library
    return None


def build(threads):
    """Builds and loads the custom call, the product cut in `threads` one-thread parts.

    Returns (matmul, None), matmul(a, b, transpose_a, transpose_b) to call inside a
    jit-compiled tf.function, or (None, why) where it cannot be built here. Run its
    programs under `one_thread_openblas()`.
    """
    if "matmul" in _loaded:
        _loaded["library"].keras_vit_bench_set_blas(_loaded["sgemm"], ctypes.c_int(threads))
        return _loaded["matmul"], None
    import tensorflow as tf

    compiler = peak.find_compiler("CXX", "c++", "g++")
    if compiler is None:
        return None, "no C++ compiler (c++ or g++, or $CXX) to build benchmarks/xla_blas.cc"
    library_folder = tf.sysconfig.get_lib()
    header = "xla/service/custom_call_target_registry.h"
    if not os.path.exists(os.path.join(tf.sysconfig.get_include(), header)):
        return None, f"this TensorFlow ships no {header}"
    if not os.path.exists(os.path.join(library_folder, "libtensorflow_cc.so.2")):
        return None, "this TensorFlow has no libtensorflow_cc.so.2 (XLA's custom-call registry)"
    blas = _numpy_openblas()
    if blas is None:
        return None, "NumPy has no bundled OpenBLAS with scipy_cblas_sgemm64_ (NumPy 2 wheels do)"
    with tempfile.TemporaryDirectory() as folder:
        shared = os.path.join(folder, "xla_blas.so")
        command = [
            compiler,
            "-O2",
            "-shared",
            "-fPIC",
            *tf.sysconfig.get_compile_flags(),
            SOURCE,
            "-o",
            shared,
            f"-L{library_folder}",
            "-l:libtensorflow_cc.so.2",
            f"-Wl,-rpath,{library_folder}",
            "-pthread",
        ]
        failed = peak.build(command)
        if failed:
            return None, failed
        # Loading it registers the custom call with XLA (a static initializer).
        custom_call = ctypes.CDLL(shared, mode=ctypes.RTLD_GLOBAL)
    sgemm = ctypes.cast(blas.scipy_cblas_sgemm64_, ctypes.c_void_p)
    custom_call.keras_vit_bench_set_blas(sgemm, ctypes.c_int(threads))
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    def matmul(a, b, transpose_a=False, transpose_b=False):
        m, k = (a.shape[1], a.shape[0]) if transpose_a else (a.shape[0], a.shape[1])
        n = b.shape[0] if transpose_b else b.shape[1]
        dims = tf.constant([m, k, n, int(transpose_a), int(transpose_b)], tf.int64)
        (product,) = gen_xla_ops.xla_custom_call_v2(
            operands=[a, b, dims],
            call_target_name=TARGET,
            backend_config="",
            has_side_effect=False,
            result_dtypes=[tf.float32],
            result_shapes=[tf.TensorShape([m, n])],
        )
        return product

    _loaded.update(matmul=matmul, library=custom_call, sgemm=sgemm, blas=blas)
    return matmul, None


@contextlib.contextmanager
def one_thread_openblas():
    """NumPy's OpenBLAS on one thread inside, its own count restored after.

    The custom call runs one OpenBLAS call per core at once; OpenBLAS's thread count
    is process-wide, so NumPy's own products run on one thread inside too.
    """
    blas = _loaded.get("blas") or _numpy_openblas()
    before = blas.scipy_openblas_get_num_threads64_()
    blas.scipy_openblas_set_num_threads64_(1)
    try:
        yield
    finally:
        blas.scipy_openblas_set_num_threads64_(before)
