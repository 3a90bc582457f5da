"""The training recipe: optimizer, schedule, loss, callbacks and tf.distribute strategy.

As in the paper and its fine-tuning: AdamW (or SGD with momentum), linear
warm-up then cosine decay, label smoothing, global-norm gradient clipping,
weight decay on the kernels only (not on norms, biases, the position embedding
or the class token).

Learning-rate scaling with the global batch size: lr = base_lr * global_batch / 256
(`scaled_learning_rate`).
"""

import contextlib
import json
import math
import os
import signal
import sys

import keras

from keras_vit import _cpu, _memory
from keras_vit.layers._checks import non_negative_int, positive_int, real
from keras_vit.layers.attention import runs_per_head
from keras_vit.models import model_image_size
from keras_vit.streams import (
    INFERENCE_PART_TOKENS,
    INFERENCE_PARTS,
    configured_streams,
    make_without_xla,
    use_streams,
)

# Variables (by name) that get no weight decay.
NO_WEIGHT_DECAY = ("bias", "gamma", "beta", "position_embedding", "class_token")
STRATEGIES = ("auto", "default", "mirrored", "multiworker", "tpu")
REFERENCE_BATCH = 256


def scaled_learning_rate(base_lr, global_batch_size):
    """lr = base_lr * global_batch_size / 256.

    `base_lr` must be a positive number, `global_batch_size` a positive integer.
    """
    base_lr = real("base_lr", base_lr, low=0, low_open=True)
    global_batch_size = positive_int("global_batch_size", global_batch_size)
    return base_lr * global_batch_size / REFERENCE_BATCH


def _check_clipnorm(clipnorm):
    """None or a number >= 0 (0 and None: no clipping, as in Keras)."""
    return None if clipnorm is None else real("clipnorm", clipnorm, low=0)


@keras.saving.register_keras_serializable(package="keras_vit")
class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0 to `peak` over `warmup_steps`, then cosine decay to `end`.

    `peak` and `end` are numbers >= 0, `total_steps` a positive integer and
    `warmup_steps` an integer in [0, total_steps].
    """

    def __init__(self, peak, total_steps, warmup_steps=0, end=0.0):
        self.peak = real("peak", peak, low=0)
        self.total_steps = positive_int("total_steps", total_steps)
        self.warmup_steps = non_negative_int("warmup_steps", warmup_steps)
        self.end = real("end", end, low=0)
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                "`total_steps` must be >= 1 and 0 <= `warmup_steps` <= `total_steps`. "
                f"Received: total_steps={total_steps}, warmup_steps={warmup_steps}"
            )

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        warm = self.peak * step / max(self.warmup_steps, 1)
        progress = (step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1)
        progress = keras.ops.clip(progress, 0.0, 1.0)
        cosine = self.end + 0.5 * (self.peak - self.end) * (1.0 + keras.ops.cos(math.pi * progress))
        return keras.ops.where(step < self.warmup_steps, warm, cosine)

    def get_config(self):
        return dict(
            peak=self.peak,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            end=self.end,
        )


def _without_decay_on(base):
    """`base` (a Keras optimizer class) that keeps its weight-decay exclusions in its
    config, so that a model loaded from a .keras file trains as it did: Keras'
    `exclude_from_weight_decay` is not saved, and a reloaded AdamW decays every
    bias, norm, position embedding and class token. It also clips, under a
    strategy of several replicas, the gradients summed over the replicas, not
    each replica's share (Keras 3.15 clips the shares before it sums them)."""

    class Optimizer(base):
        def __init__(self, *args, no_weight_decay=(), **kwargs):
            super().__init__(*args, **kwargs)
            self.no_weight_decay = tuple(no_weight_decay)
            if self.no_weight_decay and self.weight_decay:
                self.exclude_from_weight_decay(var_names=list(self.no_weight_decay))

        def get_config(self):
            return {**super().get_config(), "no_weight_decay": list(self.no_weight_decay)}

        # Under a tf.distribute strategy of several replicas Keras clips each
        # replica's share of the gradients and sums the clipped shares; these
        # sum them first and clip the sum, as on one device.
        def _clip_gradients(self, grads):
            context = _summing_replica_context(self)
            if context is not None:
                import tensorflow as tf

                present = [g for g in grads if g is not None]
                summed = iter(context.all_reduce(tf.distribute.ReduceOp.SUM, present))
                grads = [None if g is None else next(summed) for g in grads]
            return super()._clip_gradients(grads)

        def _all_reduce_sum_gradients(self, grads_and_vars):
            if _summing_replica_context(self) is not None:  # summed before clipping
                return list(grads_and_vars)
            return super()._all_reduce_sum_gradients(grads_and_vars)

    Optimizer.__name__ = Optimizer.__qualname__ = base.__name__
    Optimizer.__doc__ = (
        f"keras.optimizers.{base.__name__} that skips the weight decay of the variables "
        "named in `no_weight_decay`, and saves them in its config; under a tf.distribute "
        "strategy of several replicas it clips the summed gradients, as on one device."
    )
    return keras.saving.register_keras_serializable(package="keras_vit")(Optimizer)


def _summing_replica_context(optimizer):
    """The replica context of a train step that runs on several replicas, when
    `optimizer` clips its gradients; None otherwise."""
    clips = optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue
    if not clips or keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


AdamW = _without_decay_on(keras.optimizers.AdamW)
SGD = _without_decay_on(keras.optimizers.SGD)


def build_optimizer(
    name="adamw",
    learning_rate=1e-3,
    weight_decay=0.05,
    momentum=0.9,
    clipnorm=1.0,
):
    """AdamW or SGD with momentum, global-norm clipping, no decay on NO_WEIGHT_DECAY variables.

    `learning_rate` may be a positive number or a schedule (see
    `WarmupCosine`); `weight_decay` a number >= 0 (0 or None: none);
    `momentum` (SGD) a number in [0, 1); `clipnorm` the global norm the
    gradients are clipped to, a number >= 0 (0 or None: no clipping).
    """
    if not isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        learning_rate = real("learning_rate", learning_rate, low=0, low_open=True)
    weight_decay = 0.0 if weight_decay is None else real("weight_decay", weight_decay, low=0)
    momentum = real("momentum", momentum, low=0, high=1, high_open=True)
    clipnorm = _check_clipnorm(clipnorm)
    if name == "adamw":
        return AdamW(
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            global_clipnorm=clipnorm,
            no_weight_decay=NO_WEIGHT_DECAY,
        )
    if name == "sgd":
        return SGD(
            learning_rate=learning_rate,
            momentum=momentum,
            weight_decay=weight_decay or None,
            global_clipnorm=clipnorm,
            no_weight_decay=NO_WEIGHT_DECAY,
        )
    raise ValueError(f"`optimizer` must be 'adamw' or 'sgd'. Received: optimizer={name!r}")


def _one_hot_labels(y_true, y_pred):
    """`y_true` as one row of class probabilities per prediction: integer class ids,
    of shape (N,) or (N, 1), become one-hot rows; one-hot or soft labels (N, classes)
    are kept. Decided from the static shapes where they are known, so it costs nothing
    per step; a step traced for labels of several ranks (Keras relaxes the shapes when
    it traces again) decides at run time."""
    from keras import ops

    classes = y_pred.shape[-1]

    def one_hot(ids):
        return ops.one_hot(ops.cast(ids, "int32"), classes, dtype=y_pred.dtype)

    # Known rank: a tuple (JAX, NumPy) or a TensorShape whose rank is not None.
    if getattr(y_true.shape, "rank", 0) is not None:
        rank = len(y_pred.shape)
        if len(y_true.shape) == rank and y_true.shape[-1] == 1 and classes != 1:
            y_true = ops.squeeze(y_true, axis=-1)
        if len(y_true.shape) == rank - 1:
            return one_hot(y_true)
        return ops.cast(y_true, y_pred.dtype)
    y_true = ops.reshape(y_true, (*ops.shape(y_pred)[:-1], -1))
    return ops.cond(
        ops.shape(y_true)[-1] == 1,
        lambda: one_hot(y_true[..., 0]),
        lambda: ops.cast(y_true, y_pred.dtype),
    )


@keras.saving.register_keras_serializable(package="keras_vit")
class CrossEntropy(keras.losses.Loss):
    """Softmax cross-entropy of logits, with label smoothing, on integer class ids
    ((N,) or (N, 1)) or on one-hot or soft labels ((N, classes), as mixup and cutmix
    make): the loss `compile_model` gives, so `fit` takes either kind of label."""

    def __init__(self, label_smoothing=0.0, name="cross_entropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = real(
            "label_smoothing", label_smoothing, low=0, high=1, high_open=True
        )

    def call(self, y_true, y_pred):
        return keras.losses.categorical_crossentropy(
            _one_hot_labels(y_true, y_pred),
            y_pred,
            from_logits=True,
            label_smoothing=self.label_smoothing,
        )

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing}


def _accuracy(y_true, y_pred):
    from keras import ops

    y_true = _one_hot_labels(y_true, y_pred)
    hits = ops.equal(ops.argmax(y_true, axis=-1), ops.argmax(y_pred, axis=-1))
    return ops.cast(hits, "float32")


@keras.saving.register_keras_serializable(package="keras_vit")
class Accuracy(keras.metrics.MeanMetricWrapper):
    """Top-1 accuracy on integer class ids or on one-hot (or soft) labels, as
    `CrossEntropy` takes them; named "accuracy" (history's `val_accuracy`)."""

    def __init__(self, name="accuracy", dtype=None):
        super().__init__(_accuracy, name=name, dtype=dtype)

    def get_config(self):
        return {"name": self.name, "dtype": self.dtype}


def build_loss(label_smoothing=0.1):
    """Cross-entropy on logits with label smoothing, for integer class ids or one-hot
    labels (`CrossEntropy`)."""
    return CrossEntropy(label_smoothing=label_smoothing)


def compile_model(
    model,
    total_steps,
    learning_rate=1e-3,
    warmup_steps=None,
    optimizer="adamw",
    weight_decay=0.05,
    label_smoothing=0.1,
    clipnorm=1.0,
    jit_compile="auto",
    streams="auto",
):
    """Compiles `model` with the recipe; the LR warms up over 10% of `total_steps` by default.

    `jit_compile="auto"` compiles the train step with XLA (one fused program for the
    forward pass, the backward pass and the optimizer update) on the TensorFlow
    backend with one replica, and on JAX. Unlike Keras' own "auto", it does so on
    CPUs too, where XLA trains ViT-S/16 about 8% faster than TensorFlow's graph
    mode and the digits model of `keras-vit train` 2.5x faster (docs/performance.md).
    It stays off under a tf.distribute strategy with several replicas, as in Keras.
    On a TensorFlow machine without GPU or TPU whose CPU is an Intel one with
    AVX-512, "auto" leaves `predict` and `evaluate` to TensorFlow's graph mode:
    its oneDNN kernels (with the fused layer norm of
    `keras_vit.layers.LayerNorm`) run ViT-S/16 inference about 10% faster than
    XLA there. Elsewhere XLA predicts as fast or faster, so "auto" compiles
    them too: on an AMD EPYC with AVX2 only, where oneDNN's products are the
    slower ones, XLA predicts ViT-S/16 and ViT-B/16 1.2-1.5x faster than graph
    mode, and on one with AVX-512 (Zen 4) ViT-S/16 1.08-1.11x
    (`keras_vit._cpu.graph_mode_predicts_faster`; docs/performance.md, "Two
    CPUs" and "A third CPU"). For models with long
    sequences (from `keras_vit.layers.attention.PER_HEAD_MIN_TOKENS` = 512
    tokens, such as 16-pixel patches at 384 x 384) such a machine trains in
    graph mode, whose attention then runs one (image, head) pair at a time:
    ViT-S/16 384 trained 1.5-1.7x faster than with XLA on a 2-core EPYC
    (docs/performance.md, "Long sequences"). Where oneDNN runs AVX-512 (Intel
    or AMD) such a model predicts in graph mode too: on the Zen 4 EPYC as fast
    as with XLA, and the process, which then compiles no XLA program, peaked
    0.2 GB lower. `jit_compile=True` compiles all three.

    A model that computes in bfloat16 (`dtype="mixed_bfloat16"`, or the policy
    `keras-vit train --mixed-precision` sets on CPUs) changes "auto" on a
    TensorFlow machine without GPU or TPU. Where the CPU has bfloat16
    instructions (AVX512_BF16, AMX), the train step runs in graph mode too,
    whose oneDNN kernels use them: ViT-S/16 trains 1.55x and ViT-B/16 1.75x
    faster than with XLA (with streams, whose parts already run in graph mode,
    the optimizer update stays one XLA program). Where it has not, `predict`
    and `evaluate` use XLA too: graph mode emulates bfloat16 and predicts
    ViT-S/16 3.3x slower (docs/performance.md, "bfloat16 on the CPU").

    `streams="auto"` cuts each batch into the parts set by
    `keras_vit.streams.configure_cpu_streams`, on a TensorFlow machine without
    GPU or TPU and one replica; an integer asks for that many
    (`keras_vit.streams.use_streams`). Where none were configured, "auto"
    still cuts predict and evaluate batches in parts when they run as XLA
    programs (two, or 4 or 8 so that each part holds at most
    `keras_vit.streams.INFERENCE_PART_TOKENS` = 1600 tokens: 8 images at 224,
    2 at 384): the executor runs two programs at once, so one's
    single-threaded element-wise work overlaps the other's matrix products
    (ViT-S/16, ViT-B/16 and ViT-S/16 384 predicted 1.06x, 1.02x and 1.11x
    faster on a 2-core AMD EPYC; docs/performance.md, "Inference in two XLA
    parts"). The train step stays whole: in two XLA parts it was 1.03x faster
    for 0.25 GB more memory. `streams=1` leaves every batch whole.

    The arguments: `total_steps` a positive integer; `learning_rate` the peak
    rate, a positive number; `warmup_steps` None (10% of `total_steps`) or an
    integer >= 0; more than `total_steps` warms up over the whole run (it is
    clamped to `total_steps`: `keras-vit train` with more warm-up epochs than
    epochs); `optimizer` "adamw" or "sgd"; `weight_decay` a number >= 0;
    `label_smoothing` a number in [0, 1); `clipnorm` a number >= 0 or None
    (0 or None: no clipping). Anything else is a ValueError (a TypeError for
    what is not a number) naming the argument.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model. Received: model={model!r}")
    total_steps = positive_int("total_steps", total_steps)
    learning_rate = real("learning_rate", learning_rate, low=0, low_open=True)
    if warmup_steps is None:
        warmup_steps = max(1, total_steps // 10)
    warmup_steps = non_negative_int("warmup_steps", warmup_steps)
    label_smoothing = real("label_smoothing", label_smoothing, low=0, high=1, high_open=True)
    schedule = WarmupCosine(learning_rate, total_steps, min(warmup_steps, total_steps))
    _check_model_strategy(model)  # before its scope is entered
    with _strategy_scope(model):  # the optimizer's variables go where the model's are
        optimizer = build_optimizer(optimizer, schedule, weight_decay, clipnorm=clipnorm)
    return compile_fast(
        model,
        optimizer=optimizer,
        loss=build_loss(label_smoothing),
        metrics=[Accuracy()],
        jit_compile=jit_compile,
        streams=streams,
    )


def compile_fast(
    model, optimizer, loss, metrics=None, jit_compile="auto", streams="auto", **kwargs
):
    """`model.compile(optimizer, loss, metrics, **kwargs)` run the way `compile_model` runs it.

    For your own optimizer and loss: the train step, predict and evaluate each
    get XLA or TensorFlow's graph mode as `plan_xla` picks for this machine and
    model (see `compile_model` for `jit_compile="auto"` and `streams="auto"`),
    and the optimizer's slot variables are created now rather than while the
    first train step is traced (`build_optimizer_state`). A plain
    `model.compile(...)` on a CPU-only machine leaves all three without XLA.
    `optimizer=None` compiles for `evaluate` and `predict` only.
    `kwargs` go to `model.compile` (`steps_per_execution`, `loss_weights`, ...).
    Under tf.distribute, build the model in the strategy's scope; compiling may
    happen outside it (a model built outside it, or an optimizer object made
    outside it, is a ValueError). A model that computes in float16
    (mixed_float16) gets a `keras.optimizers.LossScaleOptimizer`.
    It also starts the thread that hands the memory compiling frees back to
    the system (`keras_vit._memory.return_freed_memory`; off with
    `KERAS_VIT_RETURN_FREED_MEMORY=0`). Returns `model`.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model. Received: model={model!r}")
    _check_model_strategy(model)
    _memory.return_freed_memory()  # compiling leaves freed heap memory resident
    if streams == "auto":
        single = _cpu.cpu_only_tensorflow() and model.distribute_strategy.num_replicas_in_sync == 1
        streams = configured_streams() if single else 1
        # Without configured streams, XLA inference still runs in parts.
        inference_parts = INFERENCE_PARTS if single else 1
    else:
        streams = positive_int("streams", streams)
        inference_parts = 1
    train_xla, infer_xla = plan_xla(model, jit_compile, streams)
    use_streams(model, 1)  # an earlier compile's parts: model.compile keeps them
    with _strategy_scope(model):  # an optimizer or metric named by a string is made here
        if optimizer is not None and _computes_in_float16(model):
            optimizer = keras.optimizers.get(optimizer)
            if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        _check_optimizer_strategy(model, optimizer)
        model.compile(
            optimizer=optimizer,
            loss=loss,
            metrics=metrics,
            jit_compile=train_xla or infer_xla,
            **kwargs,
        )
    if keras.backend.backend() == "tensorflow" and _in_multi_worker_mode(model.distribute_strategy):
        _prepare_multi_worker(model)
    else:
        if keras.backend.backend() == "tensorflow" and (
            model.distribute_strategy.num_replicas_in_sync > 1
        ):
            _build_from_first_replica(model)
        build_optimizer_state(model)
    inference_without_xla(model, train_xla and not infer_xla)
    training_without_xla(model, infer_xla and not train_xla)
    if streams != 1:
        use_streams(model, streams, infer_jit=infer_xla)
    elif infer_xla and inference_parts != 1:
        use_streams(
            model, inference_parts, infer_jit=True, train=False, part_tokens=INFERENCE_PART_TOKENS
        )
    return model


def _strategy_scope(model):
    """The scope of the tf.distribute strategy `model` was built under (a no-op off
    TensorFlow); `_check_model_strategy(model)` first, for a clear error."""
    if keras.backend.backend() != "tensorflow":
        return contextlib.nullcontext()
    return model.distribute_strategy.scope()


def _strategy_name(strategy):
    return f"{type(strategy).__name__} of {strategy.num_replicas_in_sync} replica(s)"


def _check_model_strategy(model):
    """ValueError unless `model`'s variables belong to the strategy it is compiled under.

    Keras' own failures here are a RuntimeError ("Mixing different
    tf.distribute.Strategy objects") or a ValueError that prints a whole variable.
    """
    if keras.backend.backend() != "tensorflow":
        tf = sys.modules.get("tensorflow")
        if tf is not None and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            raise ValueError(
                "tf.distribute strategies need the TensorFlow backend of Keras; on "
                f"{keras.backend.backend()!r} a strategy's scope does not distribute anything "
                "(use keras.distribution there). Received: a scope of "
                f"{_strategy_name(tf.distribute.get_strategy())}"
            )
        return
    import tensorflow as tf

    strategy = model.distribute_strategy
    if tf.distribute.has_strategy() and tf.distribute.get_strategy() is not strategy:
        raise ValueError(
            f"`model` was built under another tf.distribute strategy ({_strategy_name(strategy)}) "
            f"than the one whose scope is open ({_strategy_name(tf.distribute.get_strategy())}): "
            "build (or load) and compile it under the same `strategy.scope()`."
        )
    foreign = [
        variable.path
        for variable in model.weights
        if not strategy.extended.variable_created_in_scope(variable.value)
    ]
    if foreign:
        raise ValueError(
            "`model` was built outside the scope of the tf.distribute strategy it is "
            f"compiled under ({_strategy_name(strategy)}): {len(foreign)} of its "
            f"{len(model.weights)} weights, such as {foreign[0]!r}, are not that "
            "strategy's. Build (or load) the model inside `with strategy.scope():`."
        )


def _check_optimizer_strategy(model, optimizer):
    """ValueError for an optimizer object made under another strategy than `model`."""
    if keras.backend.backend() != "tensorflow" or not isinstance(
        optimizer, keras.optimizers.Optimizer
    ):
        return
    strategy = model.distribute_strategy
    inner = getattr(optimizer, "inner_optimizer", None)  # a LossScaleOptimizer's
    for made in (optimizer, inner):
        made_under = getattr(made, "_distribution_strategy", strategy)
        if made is not None and made_under is not strategy:
            raise ValueError(
                f"`optimizer` was created under {_strategy_name(made_under)}, but `model` "
                f"under {_strategy_name(strategy)}: create the optimizer inside the same "
                "`strategy.scope()` as the model (or pass its name, such as 'adamw')."
            )


def _computes_in_float16(model):
    """Whether a layer of `model` computes in float16 with float32 variables
    (mixed_float16), whose gradients need loss scaling."""
    return any(
        layer.compute_dtype == "float16" and layer.variable_dtype == "float32"
        for layer in model._flatten_layers(include_self=True)
    )


def _build_from_first_replica(model):
    """Lets `fit` and `evaluate` start on a global batch that the replicas share unevenly.

    Under a strategy of several replicas, Keras 3 builds the loss and metrics
    from the first batch, which it averages over the replicas first: a batch of
    5 on 2 replicas (3 and 2 images) fails in an AddN ("Inputs to operation
    AddN of type AddN must have the same size and shape"). The build only needs
    the shapes past the batch axis, so the first replica's part is used instead.
    """
    import tensorflow as tf

    original = model._maybe_symbolic_build
    if getattr(original, "_keras_vit_first_replica", False):
        return

    def first_replica(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return model.distribute_strategy.experimental_local_results(value)[0]
        return value

    def maybe_symbolic_build(iterator=None, data_batch=None):
        if iterator is None or data_batch is not None or model._distribute_strategy is None:
            return original(iterator=iterator, data_batch=data_batch)
        for item in iterator:  # (step, batches) in Keras 3.10, (begin, end, batches) later
            data_batch = keras.tree.map_structure(first_replica, next(item[-1]))
            break
        with model.distribute_strategy.scope():
            model._symbolic_build(data_batch=data_batch)

    maybe_symbolic_build._keras_vit_first_replica = True
    model._maybe_symbolic_build = maybe_symbolic_build


def plan_xla(model, jit_compile="auto", streams=1):
    """(XLA for the train step, XLA for predict and evaluate), as `compile_model` decides.

    `jit_compile` is "auto", True or False; `streams` the parts each batch is
    cut into (1: none). See `compile_model` for what "auto" picks and why.
    """
    train_xla = resolve_jit_compile(jit_compile, model)
    if jit_compile != "auto" or not _cpu.cpu_only_tensorflow():
        return train_xla, train_xla
    if not _cpu.computes_in_bfloat16(model):
        # oneDNN's float32 products predict faster on Intel's AVX-512; elsewhere XLA's.
        infer_xla = train_xla and not _cpu.graph_mode_predicts_faster()
        if streams == 1 and runs_per_head(model):
            # Long sequences: graph mode's per-head attention trains faster than
            # XLA; where oneDNN runs AVX-512 it predicts as fast, and a process
            # without any XLA program peaks lower.
            return False, train_xla and not _cpu.onednn_avx512()
        return train_xla, infer_xla
    if _cpu.native_bfloat16():
        # Graph mode's oneDNN kernels use the CPU's bfloat16 instructions; with
        # streams, whose parts run in graph mode, only the update stays XLA.
        return train_xla and streams != 1, False
    return train_xla, train_xla


def inference_without_xla(model, enabled=True):
    """Makes a compiled `model` predict and evaluate without XLA; training keeps it.

    `compile_model(jit_compile="auto")` does this on TensorFlow machines
    without GPU or TPU. Call it again after each `model.compile`. With
    `enabled=False` it undoes it: the model's `jit_compile` applies to all.
    """
    _functions_without_xla(model, ("predict", "test"), enabled)


def training_without_xla(model, enabled=True):
    """Makes a compiled `model` train without XLA; predict and evaluate keep it.

    `compile_model(jit_compile="auto")` does this on TensorFlow machines
    without GPU or TPU for models with long sequences (`plan_xla`). Call it
    again after each `model.compile`. With `enabled=False` it undoes it.
    """
    _functions_without_xla(model, ("train",), enabled)


def _functions_without_xla(model, kinds, enabled):
    """Builds `model`'s functions of these kinds ("train", "predict", "test") without XLA."""
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model. Received: model={model!r}")
    for kind in kinds:
        vars(model).pop(f"make_{kind}_function", None)
        if enabled:
            make_without_xla(model, f"make_{kind}_function")
        setattr(model, f"{kind}_function", None)


def build_optimizer_state(model):
    """Creates the optimizer's slot variables of a compiled, built `model` now.

    Without a tf.distribute strategy, Keras on TensorFlow creates them while it
    traces the first train step. When a predict or evaluate function has run
    before that step, the XLA train step then keeps about 2 GB more at ViT-S/16
    384 batch 8 (peak 6.1 instead of 4.1 GB) and its first call takes 6 s longer
    (docs/performance.md). Building them eagerly, under the model's strategy,
    avoids both. A model that is not built yet is left to Keras.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built or not model.built:
        return
    if keras.backend.backend() != "tensorflow":
        optimizer.build(model.trainable_variables)
        return
    with model.distribute_strategy.scope():
        optimizer.build(model.trainable_variables)


def resolve_jit_compile(jit_compile="auto", model=None):
    """True or False for `jit_compile` ("auto", True or False); see `compile_model`.

    "auto" looks at the replicas of `model`'s tf.distribute strategy (the one it
    was built under, though compiled outside its scope), or of the strategy
    whose scope is open when `model` is None.
    """
    if jit_compile not in ("auto", True, False):
        raise ValueError(
            f"`jit_compile` must be 'auto', True or False. Received: jit_compile={jit_compile!r}"
        )
    if jit_compile != "auto":
        return jit_compile
    backend = keras.backend.backend()
    if backend != "tensorflow":
        return backend == "jax"
    import tensorflow as tf

    strategy = tf.distribute.get_strategy() if model is None else model.distribute_strategy
    return strategy.num_replicas_in_sync == 1


def set_mixed_precision(enabled):
    """mixed_float16 on GPUs, mixed_bfloat16 otherwise (CPU, TPU); float32 when disabled."""
    if not enabled:
        keras.config.set_dtype_policy("float32")
        return "float32"
    import tensorflow as tf

    policy = "mixed_float16" if tf.config.list_physical_devices("GPU") else "mixed_bfloat16"
    keras.config.set_dtype_policy(policy)
    return policy


# Strategies --------------------------------------------------------------------


def _tf_config():
    """TF_CONFIG as a dict ({} when unset or empty); a ValueError naming it when it
    is not a JSON object."""
    text = os.environ.get("TF_CONFIG", "") or "{}"
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"TF_CONFIG is not valid JSON: {error}. Received: {text[:200]!r}"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object. Received: {text[:200]!r}")
    return config


def _tf_config_workers():
    config = _tf_config()
    cluster = config.get("cluster", {})
    return len(cluster.get("worker", [])) + len(cluster.get("chief", []))


def _tpu_strategy(required):
    import tensorflow as tf

    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver()
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        if required:
            raise ValueError(f"no TPU found ({error})") from None
        return None
    return tf.distribute.TPUStrategy(resolver)


def _tpu_in_sight():
    """True where a TPU may be attached: TPU_NAME is set, or a TPU VM's device files exist."""
    return bool(
        os.environ.get("TPU_NAME") or os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio")
    )


def get_strategy(name="auto"):
    """A tf.distribute strategy by name (see STRATEGIES).

    "auto": TPUStrategy when a TPU is found, MultiWorkerMirroredStrategy when
    TF_CONFIG names several workers, MirroredStrategy for several GPUs, and the
    default strategy otherwise.

    tf.distribute needs the TensorFlow backend: on another Keras backend (JAX),
    whose training a strategy's scope leaves on one device, "auto" and
    "default" give the default strategy, and the others a ValueError.
    """
    import tensorflow as tf

    if name not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}. Received: strategy={name!r}")
    if name == "default" or (name == "auto" and keras.backend.backend() != "tensorflow"):
        return tf.distribute.get_strategy()
    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            f"`strategy={name!r}` needs the TensorFlow backend of Keras (set "
            "KERAS_BACKEND=tensorflow before importing keras): on "
            f"{keras.backend.backend()!r} a tf.distribute strategy does not distribute "
            "training (use keras.distribution there). "
            f"Received: backend {keras.backend.backend()!r}"
        )
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multiworker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        return _tpu_strategy(required=True)
    if _tpu_in_sight():
        strategy = _tpu_strategy(required=False)
        if strategy is not None:
            return strategy
    if _tf_config_workers() > 1:
        return tf.distribute.MultiWorkerMirroredStrategy()
    if len(tf.config.list_logical_devices("GPU")) > 1:
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()


def _in_multi_worker_mode(strategy):
    import tensorflow as tf

    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


def _prepare_multi_worker(model):
    """Lets Keras 3 `fit`/`evaluate` run a compiled model under MultiWorkerMirroredStrategy.

    Two defects of Keras 3.x (up to 3.15 at least, tensorflow/tensorflow#72388) are
    worked around here:

    - `fit` builds the loss and metrics from the first distributed batch, which it
      tries to reduce across workers and fails on ("Attempt to convert a value
      (PerReplica...)"). The model is built here from a local zero batch instead,
      labels shaped like the outputs (the recipe's categorical cross-entropy).
    - The train and test steps average their scalar logs across workers with
      `strategy.reduce("MEAN", value, axis=0)`, which fails on 0-d values ("Invalid
      reduction dimension 0 for input with 0 dimensions"). Scalars are averaged with
      `axis=None` instead; everything else goes to Keras unchanged.
    """
    import numpy as np

    strategy = model.distribute_strategy
    shape = tuple(model.inputs[0].shape[1:])
    if None in shape:  # built with dynamic_image_size=True: the size it was built for
        shape = (*model_image_size(model), shape[-1])
    inputs = np.zeros((1, *shape), model.inputs[0].dtype)
    labels = np.zeros((1,) + tuple(model.outputs[0].shape[1:]), "float32")
    with strategy.scope():
        model._symbolic_build(data_batch=(inputs, labels))
    model._maybe_symbolic_build = lambda iterator=None, data_batch=None: None
    _patch_multi_worker_log_reduction()


def _patch_multi_worker_log_reduction():
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.reduce_per_replica
    if getattr(original, "_keras_vit_patched", False):
        return

    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not _in_multi_worker_mode(strategy):
            return original(values, strategy, reduction)

        def reduce(value):
            local = strategy.experimental_local_results(value)[0]
            if getattr(local, "shape", None) is not None and len(local.shape) == 0:
                return strategy.reduce("MEAN", value, axis=None)
            return original(value, strategy, reduction)

        return keras.tree.map_structure(reduce, values)

    reduce_per_replica._keras_vit_patched = True
    tf_trainer.reduce_per_replica = reduce_per_replica


def is_chief():
    """Whether this process is the chief (or the only) worker under TF_CONFIG."""
    config = _tf_config()
    task = config.get("task", {})
    kind, index = task.get("type", "worker"), task.get("index", 0)
    has_chief = "chief" in config.get("cluster", {})
    return kind == "chief" or (not has_chief and kind == "worker" and index == 0)


# Callbacks ---------------------------------------------------------------------


def write_atomic(path, write):
    """Calls `write(temporary)` for a temporary file beside `path`, then renames it to
    `path`: a process killed while writing leaves the file at `path` as it was.

    The temporary name keeps the extension Keras checks (NAME.tmp.keras,
    NAME.tmp.weights.h5, NAME.tmp.h5); other files get ".tmp" appended.
    """
    for extension in (".weights.h5", ".keras", ".h5"):
        if path.endswith(extension):
            temporary = path[: -len(extension)] + ".tmp" + extension
            break
    else:
        temporary = path + ".tmp"
    write(temporary)
    os.replace(temporary, path)


def write_json_atomic(path, value, indent=None):
    """`value` as JSON at `path`, written as `write_atomic` writes."""

    def write(temporary):
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(value, file, indent=indent)

    write_atomic(path, write)


def _finite_loss(logs):
    """False when `logs` hold a NaN or infinite loss (what TerminateOnNaN stops on)."""
    loss = (logs or {}).get("loss")
    return loss is None or math.isfinite(float(loss))


def _finite_weights(model):
    """Whether every trainable weight of `model` is finite (a step's update can make them
    NaN a step before the loss shows it)."""
    ops = keras.ops
    return all(bool(ops.all(ops.isfinite(v))) for v in model.trainable_variables)


class StepBackupAndRestore(keras.callbacks.BackupAndRestore):
    """BackupAndRestore that records the current epoch in mid-epoch backups too,
    and backs up at each epoch's end as well as every `save_freq` steps.

    The global step is the optimizer's `iterations` (restored with the weights),
    from which `keras_vit.commands.train` resumes mid-epoch. Like Keras', this
    callback loads its backup when `fit` begins: a resumed run first finishes
    the interrupted epoch in one `fit` and trains the rest in another, and the
    second must find the state the first ended with, not an older mid-epoch
    backup (which would undo the first's steps).
    """

    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch

    # A step whose loss or weights are NaN or infinite is not backed up: the backup
    # keeps the last weights that trained well (TerminateOnNaN stops the run).
    # A step backup that falls due is written when the next step begins, from the
    # same state; if the epoch ends first, the epoch-end backup replaces it, written
    # after the validation and after the callbacks before this one (history.csv's
    # row, best.keras). A backup at the epoch's boundary taken before those would, if
    # the process were killed in between, resume at the next epoch: the finished
    # epoch would never be validated, logged or considered for best.keras.
    def on_train_batch_end(self, batch, logs=None):
        due = self._should_save_on_batch(batch)  # counts the batch either way
        self._due = due and _finite_loss(logs)

    def on_train_batch_begin(self, batch, logs=None):
        if getattr(self, "_due", False):
            self._due = False
            self._save_model()

    def on_epoch_end(self, epoch, logs=None):
        self._due = False
        if _finite_loss(logs):
            super().on_epoch_end(epoch, logs)  # saves when save_freq is "epoch"
            if self.save_freq != "epoch":
                self._save_model()

    def _save_model(self):
        """Writes the weights, then the metadata, each to a temporary file renamed over
        the last one: a process killed while writing leaves the previous backup whole.
        Weights that are not all finite are not written."""
        if not _finite_weights(self.model):
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        write_atomic(self._weights_path, lambda file: self.model.save_weights(file, overwrite=True))
        metadata = {"epoch": self._current_epoch, "batch": self._last_batch_seen}
        write_json_atomic(self._training_metadata_path, metadata)

    def _load_model(self):
        super()._load_model()
        # The caller derives the epoch (and the step within it) from `iterations`.
        self.model._initial_epoch = None


class BestCheckpoint(keras.callbacks.ModelCheckpoint):
    """ModelCheckpoint of the best model, written to a temporary file and renamed, so
    that a process killed while writing leaves the previous best model whole; never
    a model whose training loss is NaN or infinite."""

    def _save_model(self, epoch, batch, logs):
        filepath = self._get_file_path(epoch, batch, logs)
        if not (_finite_loss(logs) and _finite_weights(self.model)):  # training diverged
            return
        if not self._should_save_model(epoch, batch, logs, filepath):
            return
        directory = os.path.dirname(filepath)
        if directory:
            os.makedirs(directory, exist_ok=True)
        save = self.model.save_weights if self.save_weights_only else self.model.save
        write_atomic(filepath, lambda file: save(file, overwrite=True))


class KillAtStep(keras.callbacks.Callback):
    """Test hook: SIGKILL this process after global step `step` (KERAS_VIT_KILL_AT_STEP)."""

    def __init__(self, step):
        super().__init__()
        self.step = int(step)

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


TENSORBOARD_MISSING = (
    "TensorBoard logs need the tensorboard package, which recent TensorFlow releases do "
    "not install: pip install tensorboard (or pip install 'keras_vit[tensorboard]')"
)


def require_tensorboard():
    """Raises ImportError, saying what to install, where tensorboard is not installed
    (Keras' TensorBoard callback would fail only at the first epoch's end)."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError(TENSORBOARD_MISSING)


def build_callbacks(
    output,
    backup_steps=50,
    best_checkpoint=True,
    tensorboard=False,
    csv_append=False,
    best_value=None,
):
    """BackupAndRestore (every `backup_steps` steps, counted over the epochs, and at
    each epoch's end), best checkpoint, CSVLogger, TerminateOnNaN and optionally
    TensorBoard, all under `output`.

    Every checkpoint (backup, best.keras) is written to a temporary file and renamed.
    `best_value`: the best validation accuracy of the epochs before (a resumed run),
    which best.keras is replaced only to improve on; None for a new run.
    `backup_steps`: a positive integer, or 0 or None for a backup at each epoch's end only.
    """
    if not isinstance(output, (str, os.PathLike)) or not os.fspath(output):
        raise ValueError(f"`output` must be a folder path. Received: output={output!r}")
    if backup_steps is not None:
        backup_steps = non_negative_int("backup_steps", backup_steps)
    if tensorboard:
        require_tensorboard()
    os.makedirs(output, exist_ok=True)  # CSVLogger opens history.csv there when fit begins
    callbacks = [
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.CSVLogger(os.path.join(output, "history.csv"), append=csv_append),
    ]
    if best_checkpoint:
        callbacks.append(
            BestCheckpoint(
                os.path.join(output, "best.keras"),
                monitor="val_accuracy",
                mode="max",
                save_best_only=True,
                initial_value_threshold=best_value,
            )
        )
    if tensorboard:
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(output, "logs")))
    # Last, so that an epoch's end is backed up only once its row is in history.csv
    # and best.keras has seen it: a run killed before resumes inside that epoch and
    # ends it again (_history_from_csv keeps an epoch's last row).
    callbacks.append(
        StepBackupAndRestore(
            os.path.join(output, "backup"),
            save_freq=backup_steps if backup_steps else "epoch",
            delete_checkpoint=False,
        )
    )
    if os.environ.get("KERAS_VIT_KILL_AT_STEP"):
        callbacks.append(KillAtStep(os.environ["KERAS_VIT_KILL_AT_STEP"]))
    return callbacks
