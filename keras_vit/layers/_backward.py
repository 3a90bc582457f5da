"""Helpers of the hand-written backward passes: ties for recomputing instead of
keeping, and element-wise work fused by XLA in graph mode."""

import functools

import keras
from keras import ops

from keras_vit import _cpu


def in_xla_program():
    """Whether TensorFlow is tracing a function for XLA (`jit_compile=True`)."""
    import tensorflow as tf

    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # the private module moved: assume graph mode
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def xla_fused(function):
    """`function`, run as one small XLA program where TensorFlow traces a graph.

    For the element-wise work of the hand-written backward passes (layer norms,
    GELU). TensorFlow's graph mode, which the CPU streams train in, runs each
    operation as its own kernel, one pass over memory each; as an XLA program
    they fuse into a few loops, while the matrix products around them stay
    TensorFlow's (oneDNN's one-thread products run faster than XLA's). A
    ViT-S/16 step in two CPU streams spends ~1/3 less time outside the
    products (docs/performance.md). Eagerly, inside an XLA program, and on
    other backends `function` runs as it is. Its arguments are tensors and
    Python values (epsilon, a dtype), which the compiled function keeps as
    constants.
    """
    compiled = []

    @functools.wraps(function)
    def call(*args):
        if keras.backend.backend() != "tensorflow":
            return function(*args)
        import tensorflow as tf

        if tf.executing_eagerly() or in_xla_program():
            return function(*args)
        if not compiled:
            compiled.append(
                tf.function(function, jit_compile=True, autograph=False, reduce_retracing=True)
            )
        return compiled[0](*args)

    return call


def tied_to_upstream(values, upstream):
    """`values` in float32, plus 0 * one element of the 2-D `upstream`.

    The same numbers, but a recomputation that starts from them now waits for
    the backward pass. Computed from forward values alone, XLA's scheduler and
    TensorFlow's executor run it as soon as those values exist, and keep its
    results through the forward pass, which is what recomputing was meant to
    avoid. (A non-finite upstream gives non-finite gradients either way.)
    """
    return ops.cast(values, "float32") + 0.0 * ops.cast(upstream[:1, :1], "float32")


def remat(layer, forward):
    """`keras.remat(forward)` for one of `layer`'s calls, tied on JAX's CPU.

    `forward(x)` runs the layer's own computation on its input. Elsewhere this
    is `keras.remat`. On JAX with the CPU backend, `keras.remat` is
    `jax.checkpoint`, whose recomputation depends on forward values alone; the
    CPU's XLA scheduler runs it during the forward pass, so the compiled step
    keeps what it was meant to drop (ViT-S/16, 4 blocks: temporary buffer
    148 MB against 146 without remat). Here the backward pass recomputes from
    x + 0 * one element of the output's gradient instead (68 MB), with the
    layer's variables passed in explicitly: a `jax.custom_vjp` cannot close
    over values it differentiates.

    Variables the forward pass updates (dropout's seeds) are handed back to
    the caller's scope, and the recomputation starts from their old values,
    so it draws the same masks.
    """
    if not _cpu.jax_on_cpu():
        return keras.remat(forward)
    import jax

    variables = list(layer.variables)
    states = [v for v in variables if not v.trainable]

    def run(values, x):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))) as scope:
            given = [scope.get_current_value(v) for v in states]
            y = forward(x)
            now = [scope.get_current_value(v) for v in states]
        # Only what the forward pass assigned (a frozen kernel is left alone).
        return y, {i: value for i, value in enumerate(now) if value is not given[i]}

    @jax.custom_vjp
    def recomputed(values, x):
        return run(values, x)

    def forward_pass(values, x):
        return run(values, x), (values, x)

    def backward_pass(kept, upstream):
        values, x = kept
        d_y = upstream[0]  # the states' cotangents are not used
        tie = ops.cast(ops.reshape(d_y, (-1,))[0], x.dtype)
        _, vjp = jax.vjp(lambda v, x: run(v, x + 0 * tie)[0], values, x)
        return vjp(d_y)

    recomputed.defvjp(forward_pass, backward_pass)

    def call(x):
        y, updated = recomputed([v.value for v in variables], x)
        for i, value in updated.items():
            states[i].assign(value)
        return y

    return call
