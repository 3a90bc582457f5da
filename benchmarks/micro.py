"""In-process micro-benchmarks behind keras_vit's fast path (TensorFlow backend, float32).

    python benchmarks/micro.py                 # all of them, ViT-S/16 shapes at 224
    python benchmarks/micro.py gemm mlp        # some of them
    python benchmarks/micro.py --tokens 577    # attention at 384 (24 x 24 patches + 1)
    python benchmarks/micro.py gemm --threads 1   # one thread per product, and two streams
    python benchmarks/micro.py peak            # the CPU's multiply-add peak, for scale

peak       the CPU's float32 multiply-add peak, 1 to all cores: benchmarks/peak.c, built with
           the C compiler (cc, gcc or $CC; skipped without one), the ceiling of any product
gemm       float32 matrix products at the model's shapes: TensorFlow (oneDNN), XLA, NumPy,
           PyTorch (where installed); with --threads 1 also "2 streams": the two halves
           of the rows as two 1-thread products at the same time (keras_vit.streams)
grads      the three products a training step runs for each Dense layer of a block
           (forward x @ w, input gradient dy @ w^T, weight gradient x^T @ dy), under XLA,
           in NumPy's OpenBLAS called from an XLA program (benchmarks/xla_blas.cc, built
           with the C++ compiler; skipped without one) and in NumPy, one call each and
           all twelve in one XLA program; run it twice to compare an XLA_FLAGS setting
mlp        the MLP on (batch, tokens, D) against (batch * tokens, D) rows, graph and XLA
attention  the attention core (softmax(q k^T) v) written four ways, forward and backward
           (keras_vit's: one transpose, unstack, einsums, a hand-written backward pass);
           with KERAS_BACKEND=jax, under jax.jit on JAX (the other benchmarks are TensorFlow's)
block      one TransformerBlock and its parts, forward and forward + backward
model      the whole ViT-S/16: inference and training-step images/s, peak RSS

Each figure is the median of several timed repetitions, after a warm-up call.
The machine is shared: compare figures from one run, not across runs. Side by
side comparisons with the peers are benchmarks/bench.py's job.
"""

import argparse
import contextlib
import functools
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peak  # noqa: E402
from runner import keras_loss_and_optimizer  # noqa: E402

BATCH, DIM, HEADS, MLP_DIM = 8, 384, 6, 1536


def median_seconds(function, repeats=7, inner=5):
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            result = function()
        _block(result)
        times.append((time.perf_counter() - start) / inner)
    return float(np.median(times))


def _block(result):
    import keras

    if keras.backend.backend() == "jax":
        import jax

        jax.block_until_ready(result)
        return
    import tensorflow as tf

    for value in tf.nest.flatten(result):
        if hasattr(value, "numpy"):
            value.numpy()


def bench_gemm(tokens):
    import tensorflow as tf

    rows = BATCH * tokens
    shapes = [(2048, 2048, 2048), (rows, DIM, 3 * DIM), (rows, DIM, MLP_DIM), (rows, MLP_DIM, DIM)]
    print("gemm: GFLOP/s of (m, k) @ (k, n)")
    graph = tf.function(tf.matmul)
    xla = tf.function(tf.matmul, jit_compile=True)
    halves = tf.function(lambda a, b: [tf.matmul(part, b) for part in tf.split(a, 2)])
    try:  # PyTorch's CPU product (MKL on x86): the one timm's Linear layers use
        import torch
    except ImportError:
        torch = None
        print("  (torch is not installed: no PyTorch column)")
    for m, k, n in shapes:
        a, b = tf.random.normal((m, k)), tf.random.normal((k, n))
        a_array, b_array = a.numpy(), b.numpy()  # copies made before timing
        contenders = {
            "tensorflow": functools.partial(graph, a, b),
            "xla": functools.partial(xla, a, b),
            "numpy": functools.partial(np.matmul, a_array, b_array),
        }
        if torch is not None:
            left, right = torch.from_numpy(a_array), torch.from_numpy(b_array)
            contenders["torch"] = functools.partial(torch.mm, left, right)
        if tf.config.threading.get_intra_op_parallelism_threads() == 1:
            # Two independent products, which TensorFlow's executor runs side by side.
            contenders["tensorflow 2 streams"] = functools.partial(halves, a, b)
        flops = 2.0 * m * k * n
        figures = {name: flops / median_seconds(call) / 1e9 for name, call in contenders.items()}
        print(f"  {(m, k, n)}: " + ", ".join(f"{name} {v:.0f}" for name, v in figures.items()))


def bench_grads(tokens):
    import tensorflow as tf
    import xla_blas

    rows = BATCH * tokens
    layers = {
        "qkv": (DIM, 3 * DIM),
        "proj": (DIM, DIM),
        "fc1": (DIM, MLP_DIM),
        "fc2": (MLP_DIM, DIM),
    }
    # name: (operands among x (rows, k), w (k, n), dy (rows, n); transpose_a, transpose_b)
    products = {
        "forward": ("x", "w", False, False),
        "input gradient": ("dy", "w", False, True),
        "weight gradient": ("x", "dy", True, False),
    }
    blas_matmul, why = xla_blas.build(peak.cores())
    libraries = {"xla": tf.matmul, "openblas in xla": blas_matmul}
    libraries = {name: matmul for name, matmul in libraries.items() if matmul is not None}
    names = {"xla": "XLA", "openblas in xla": "OpenBLAS in XLA", "numpy": "NumPy"}
    print(
        f"grads: GFLOP/s of each Dense layer's training products, {rows} rows, "
        + " / ".join(names[library] for library in [*libraries, "numpy"])
    )
    if blas_matmul is None:
        print(f"  OpenBLAS in XLA: skipped, {why}")
    if os.environ.get("XLA_FLAGS"):
        print(f"  XLA_FLAGS={os.environ['XLA_FLAGS']}")
    calls, operands = [], []
    for layer, (k, n) in layers.items():
        tensors = {"x": (rows, k), "w": (k, n), "dy": (rows, n)}
        tensors = {name: tf.random.normal(shape) for name, shape in tensors.items()}
        arrays = {name: tensor.numpy() for name, tensor in tensors.items()}
        for name, (left, right, transpose_a, transpose_b) in products.items():
            transposes = {"transpose_a": transpose_a, "transpose_b": transpose_b}
            operands.append((tensors[left], tensors[right], transposes))
            products_of = {
                library: functools.partial(
                    tf.function(functools.partial(matmul, **transposes), jit_compile=True),
                    tensors[left],
                    tensors[right],
                )
                for library, matmul in libraries.items()
            }
            a, b = arrays[left], arrays[right]
            products_of["numpy"] = functools.partial(
                np.matmul, a.T if transpose_a else a, b.T if transpose_b else b
            )
            calls.append((layer, name, 2.0 * rows * k * n, products_of))
    if blas_matmul is not None:  # the custom call computes the same products
        with xla_blas.one_thread_openblas():
            error = max(
                float(np.max(np.abs(call["openblas in xla"]().numpy() - call["numpy"]())))
                for *_, call in calls
            )
        print(f"  OpenBLAS in XLA against NumPy: largest difference {error:.1e}")

    # NumPy's products last: OpenBLAS's threads keep spinning for a while after each
    # call and would slow an XLA product timed right after one. (The custom call runs
    # one-thread OpenBLAS calls on threads of its own, which do not spin.)
    def threads_for(library):  # the custom call's one-thread parts; the others as they are
        if library == "openblas in xla":
            return xla_blas.one_thread_openblas()
        return contextlib.nullcontext()

    seconds = {}
    for library in [*libraries, "numpy"]:
        with threads_for(library):
            for *_, products_of in calls:  # a process's first products run slow: warm up
                median_seconds(products_of[library], repeats=1)
            seconds[library] = [median_seconds(call[library]) for *_, call in calls]
    figures = {}
    for index, (layer, name, flops, _) in enumerate(calls):
        rates = [f"{flops / values[index] / 1e9:.0f}" for values in seconds.values()]
        figures.setdefault(layer, []).append(f"{name} {' / '.join(rates)}")
    for layer, (k, n) in layers.items():
        print(f"  {layer} (m, k, n) = {(rows, k, n)}: " + ", ".join(figures[layer]))
    totals = ", ".join(f"{names[library]} {sum(v) * 1e3:.1f} ms" for library, v in seconds.items())
    print(f"  all twelve, one call each: {totals} (one block's Dense products in a training step)")
    # The twelve in one XLA program, as a training step runs them: XLA may overlap them.
    programs = {}
    for library, matmul in libraries.items():

        def program(matmul=matmul):
            products = [matmul(a, b, **transposes) for a, b, transposes in operands]
            return [product[0, 0] for product in products]

        programs[library] = tf.function(program, jit_compile=True)
    together = []
    for library, program in programs.items():
        with threads_for(library):
            together.append(f"{names[library]} {median_seconds(program) * 1e3:.1f} ms")
    together = ", ".join(together)
    print(f"  all twelve in one XLA program: {together}")


def bench_mlp(tokens):
    import keras
    import tensorflow as tf
    from keras import ops

    inputs = tf.random.normal((BATCH, tokens, DIM))
    fc1, fc2 = keras.layers.Dense(MLP_DIM), keras.layers.Dense(DIM)

    def three_d(x):
        return fc2(keras.activations.gelu(fc1(x)))

    def rows(x):
        y = fc2(keras.activations.gelu(fc1(ops.reshape(x, (-1, DIM)))))
        return ops.reshape(y, ops.shape(x))

    flops = 2 * 2 * BATCH * tokens * DIM * MLP_DIM
    print("mlp: forward ms (GFLOP/s)")
    for name, function in (("3-D input", three_d), ("2-D rows", rows)):
        for jit in (False, True):
            compiled = tf.function(function, jit_compile=jit)
            seconds = median_seconds(lambda c=compiled: c(inputs))
            mode = "xla" if jit else "graph"
            print(f"  {name:9s} {mode:5s} {seconds * 1e3:6.2f} ms ({flops / seconds / 1e9:.0f})")


def _attention_variants():
    from keras import ops

    def einsum(qkv):
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scale = query.shape[-1] ** -0.5
        weights = ops.softmax(ops.einsum("bqhd,bkhd->bhqk", query * scale, key), axis=-1)
        return ops.einsum("bhqk,bkhd->bqhd", weights, value)

    def transpose_matmul(qkv):
        query, key, value = ops.unstack(ops.transpose(qkv, (2, 0, 3, 1, 4)), axis=0)
        scale = query.shape[-1] ** -0.5
        weights = ops.softmax(ops.matmul(query * scale, ops.swapaxes(key, -1, -2)), axis=-1)
        return ops.transpose(ops.matmul(weights, value), (0, 2, 1, 3))

    def custom_backward(qkv, core="_attention_core"):
        from keras_vit.layers import attention

        query, key, value = ops.unstack(ops.transpose(qkv, (2, 0, 3, 1, 4)), axis=0)
        scale = query.shape[-1] ** -0.5
        return getattr(attention, core)(query * scale, key, value)

    def per_head(qkv):
        # What graph mode and JAX on the CPU run from PER_HEAD_MIN_TOKENS on (TensorFlow's
        # XLA keeps the batched core).
        return custom_backward(qkv, "_attention_core_per_head")

    def dot_product_attention(qkv):
        return ops.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])

    return {
        "hand-written backward (ours)": custom_backward,
        "per (image, head) pair (ours)": per_head,
        "transpose + matmul (before)": transpose_matmul,
        "einsum (before)": einsum,
        "ops.dot_product_attention": dot_product_attention,
    }


def _forward_and_backward(function, inputs, variables=()):
    import tensorflow as tf

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = function(x)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, *variables])

    return step


def bench_attention_jax(tokens):
    # KERAS_BACKEND=jax: the variants under jax.jit; forward + backward is jax.vjp's
    # forward and its pullback of a fixed upstream gradient. Each variant's
    # compiled forward + backward also reports XLA's temporary buffer.
    import jax

    qkv = jax.random.normal(jax.random.PRNGKey(0), (BATCH, tokens, 3, HEADS, DIM // HEADS))
    variants = _attention_variants()
    # Left out for a shorter run: on JAX it was slower than einsum, whose backward
    # pass is one dot_general (docs/performance.md, the JAX row of the table).
    variants.pop("transpose + matmul (before)")
    reference = np.asarray(variants["einsum (before)"](qkv))
    upstream = jax.random.normal(jax.random.PRNGKey(1), reference.shape)
    print("attention core (JAX): forward ms / forward + backward ms, temporary MB")
    for name, function in variants.items():
        np.testing.assert_allclose(np.asarray(function(qkv)), reference, atol=1e-4)
        forward = jax.jit(function)
        both = jax.jit(lambda x, f=function: jax.vjp(f, x)[1](upstream))
        temporary = both.lower(qkv).compile().memory_analysis().temp_size_in_bytes
        print(
            f"  {name:30s} xla   {median_seconds(lambda f=forward: f(qkv)) * 1e3:6.2f}"
            f" / {median_seconds(lambda f=both: f(qkv)) * 1e3:6.2f}, {temporary / 2**20:.0f} MB"
        )


def bench_attention(tokens):
    import keras

    if keras.backend.backend() == "jax":
        return bench_attention_jax(tokens)
    import tensorflow as tf

    qkv = tf.random.normal((BATCH, tokens, 3, HEADS, DIM // HEADS))
    variants = _attention_variants()
    reference = variants["einsum (before)"](qkv).numpy()
    print("attention core: forward ms / forward + backward ms")
    for name, function in variants.items():
        np.testing.assert_allclose(function(qkv).numpy(), reference, atol=1e-4)
        for jit in (False, True):
            forward = tf.function(function, jit_compile=jit)
            both = tf.function(_forward_and_backward(function, qkv), jit_compile=jit)
            mode = "xla" if jit else "graph"
            print(
                f"  {name:30s} {mode:5s} {median_seconds(lambda f=forward: f(qkv)) * 1e3:6.2f}"
                f" / {median_seconds(lambda f=both: f(qkv)) * 1e3:6.2f}"
            )


def bench_block(tokens):
    import keras
    import tensorflow as tf

    from keras_vit import layers
    from keras_vit.layers.transformer import LAYER_NORM_EPSILON

    inputs = tf.random.normal((BATCH, tokens, DIM))
    parts = {
        "TransformerBlock": layers.TransformerBlock(HEADS, MLP_DIM),
        "MLP": layers.MLP(MLP_DIM),
        "MultiHeadSelfAttention": layers.MultiHeadSelfAttention(HEADS),
        "LayerNormalization": keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPSILON),
    }
    print("block and parts: forward ms / forward + backward ms")
    for name, layer in parts.items():
        layer(inputs)
        for jit in (False, True):
            forward = tf.function(lambda x, f=layer: f(x), jit_compile=jit)
            step = _forward_and_backward(
                lambda x, f=layer: f(x, training=True), inputs, layer.trainable_variables
            )
            both = tf.function(step, jit_compile=jit)
            mode = "xla" if jit else "graph"
            print(
                f"  {name:22s} {mode:5s} {median_seconds(lambda f=forward: f(inputs)) * 1e3:6.2f}"
                f" / {median_seconds(lambda f=both: f(inputs)) * 1e3:6.2f}"
            )


def bench_model(tokens):
    import keras_vit

    side = int(round((tokens - 1) ** 0.5)) * 16
    model = keras_vit.ViT_S16(image_size=side)
    optimizer, loss = keras_loss_and_optimizer()  # the same as bench.py's contenders
    model.compile(optimizer=optimizer, loss=loss, jit_compile=True)
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (BATCH, side, side, 3)).astype("float32")
    labels = rng.integers(0, 1000, (BATCH,)).astype("int32")
    infer = median_seconds(lambda: model.predict_on_batch(images), repeats=5, inner=1)
    train = median_seconds(lambda: model.train_on_batch(images, labels), repeats=5, inner=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"model: ViT-S/16 at {side}, XLA: inference {BATCH / infer:.2f} images/s, "
        f"training {BATCH / train:.2f} images/s, peak RSS {peak:.2f} GB"
    )


def bench_peak(tokens):
    """The CPU's own float32 multiply-add peak (benchmarks/peak.c, compiled here)."""
    del tokens
    lines, figures = peak.measure()
    if lines is None:
        print(f"peak: skipped, {figures}")
        return
    print("peak: float32 multiply-adds in registers, no memory traffic (no product can beat it)")
    for line in lines:
        print(f"  {line}")


BENCHMARKS = {
    "peak": bench_peak,
    "gemm": bench_gemm,
    "grads": bench_grads,
    "mlp": bench_mlp,
    "attention": bench_attention,
    "block": bench_block,
    "model": bench_model,
}


def set_threads(threads):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(threads)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="*", help=f"from {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--tokens", type=int, default=197, help="197 (224) or 577 (384)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads per TensorFlow and PyTorch operation (default: theirs, all cores); "
        "NumPy keeps its own",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1. Received: {args.threads}")
        set_threads(args.threads)
    unknown = [name for name in args.which if name not in BENCHMARKS]
    if unknown:
        parser.error(f"expected names from {sorted(BENCHMARKS)}. Received: {unknown}")
    if args.tokens < 2 or round((args.tokens - 1) ** 0.5) ** 2 != args.tokens - 1:
        parser.error(f"--tokens must be a square number of patches + 1. Received: {args.tokens}")
    for name in args.which or BENCHMARKS:
        BENCHMARKS[name](args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
