"""CPU streams: each batch split into parts that run side by side.

TensorFlow splits every operation of a step across all the CPU cores it has.
On a small machine that split is costly: on 2 cores its float32 matrix
products run at 1.7-1.9x their 1-core speed (PyTorch's at 2x), and each of
the step's thousands of small operations waits for both cores. With streams,
each batch is cut into `streams` parts that do not depend on each other (a
ViT computes each image on its own); each part runs on its own group of cores,
and TensorFlow's executor runs the parts at the same time. On a 2-core
Intel Xeon, two streams made ViT-S/16, ViT-B/16 and ViT-S/16 384 predict 5-17%
and train 6-14% faster in two bench runs (docs/performance.md, "CPU streams").
On 2-core AMD EPYCs, whose default already predicts in two XLA parts, they
predicted at 0.94-1.11x the default's speed and trained 5-16% faster on one
with AVX-512 (Zen 4), 0.91-1.06x as fast on one with AVX2 only (README,
Training).

Two steps:

1. `configure_cpu_streams(streams)` at the start of the program, before
   TensorFlow runs its first operation: it gives each operation
   `cores // streams` threads and the executor `streams` threads at a time.
   This is process-wide; without streams, operations would then run on fewer
   cores. `keras-vit train` does it for you where `recommended_cpu_streams()`
   says 2 (a 2-core CPU-only machine whose oneDNN runs AVX-512), or with
   `--cpu-streams N`.
2. `use_streams(model)` after `model.compile(...)` (or `compile_model(...)`,
   which calls it): the model's train, test and predict steps cut each batch.
   The training parts run in TensorFlow's graph mode, whose executor runs
   them at the same time, and whose oneDNN matrix products were faster on one
   core than XLA's (on a Xeon with AVX-512). Predict and evaluate parts are
   XLA programs where `compile_model` predicts with XLA (CPUs without
   AVX-512), graph-mode ones elsewhere. Each part's loss is weighted by its
   share of the batch, and the parts' gradients are summed one variable at a
   time as they come. With
   `jit_compile`, the optimizer update is one XLA program.

Without `configure_cpu_streams`, `compile_model` and `compile_fast` still cut
predict and evaluate batches in `INFERENCE_PARTS` parts where they predict with
XLA on a CPU-only machine (`use_streams(model, 2, train=False,
part_tokens=INFERENCE_PART_TOKENS)`): each part is one XLA program, and the
executor runs two programs at once, so one's single-threaded element-wise
work overlaps the other's matrix products. On a 2-core AMD EPYC halves made
ViT-S/16, ViT-B/16 and ViT-S/16 384 predict 1.06x, 1.02x and 1.11x faster.
A batch of more tokens is cut in 4 or 8 parts, so that each part holds at
most 1600 tokens and its activations stay closer to the cache: 1.03-1.06x
faster again for ViT-S/16 384 at batch 8 (quarters), 1.06x for ViT-S/16 at
batch 32 (docs/performance.md, "Inference in two XLA parts").

The results are the same as without streams up to float rounding: the loss is
the part losses weighted by part size, and so are the gradients. Batches
smaller than `streams` run as one part. Models whose outputs for one sample
depend on other samples of the batch (batch normalization in training) must
not use streams. Only the TensorFlow backend with one replica is supported.
"""

import os
import warnings

import keras

from keras_vit import _cpu
from keras_vit.layers._checks import positive_int

_configured = {"streams": 1}
# The model attribute holding the step overrides that use_streams replaced.
_UNSTREAMED = "_keras_vit_unstreamed"
# The model attribute holding (parts of a training batch, parts of an inference batch).
_PARTS = "_keras_vit_parts"
# The model attribute holding the most tokens of one inference part (None: no limit).
_PART_TOKENS = "_keras_vit_part_tokens"
# Parts of a predict or evaluate batch where inference runs as XLA programs on
# a CPU-only machine without configured streams (compile_fast): at least
# INFERENCE_PARTS, and more (doubling) until each part holds at most
# INFERENCE_PART_TOKENS tokens (images x tokens per image).
INFERENCE_PARTS = 2
INFERENCE_PART_TOKENS = 1600
# The most parts a batch is cut into for a token limit.
MAX_PARTS = 8
# TensorFlow's own thread settings: where one is set, no streams are recommended.
THREAD_ENVS = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


def _available_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def configure_cpu_streams(streams=2, cores=None):
    """Gives TensorFlow `streams` executor threads of `cores // streams` threads each.

    Call it before TensorFlow runs its first operation (before any model is
    built); TensorFlow backend only. Returns the threads per operation. `cores` defaults to the cores
    this process may run on.

    `streams="auto"` configures `recommended_cpu_streams(cores)` streams, as
    `keras-vit train` does by default: where that is 1, nothing is changed
    and None is returned (on any backend).
    """
    if isinstance(streams, str) and streams == "auto":
        streams = recommended_cpu_streams(cores)
        if streams == 1:
            return None
    streams = positive_int("streams", streams)
    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            "Streams need the TensorFlow backend (set KERAS_BACKEND=tensorflow before "
            f"importing keras). Received: backend {keras.backend.backend()!r}"
        )
    cores = positive_int("cores", _available_cores() if cores is None else cores)
    if streams > cores:
        raise ValueError(
            f"`streams` must not exceed the cores ({cores}): each stream needs at least one. "
            f"Received: streams={streams}"
        )
    import tensorflow as tf

    threads = cores // streams
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(streams)
    except RuntimeError as error:
        raise RuntimeError(
            "configure_cpu_streams() must run before TensorFlow runs its first operation "
            "(call it at the start of the program, before building a model). "
            f"TensorFlow said: {error}"
        ) from None
    _configured["streams"] = streams
    return threads


def recommended_cpu_streams(cores=None):
    """The CPU streams `keras-vit train --cpu-streams auto` configures: 2 or 1.

    2 on the TensorFlow backend with no GPU or TPU, on a machine of 2 cores
    whose TensorFlow runs oneDNN's AVX-512 kernels (`keras_vit._cpu.onednn_avx512`).
    There two streams trained ViT-S/16 224, ViT-B/16 224 and ViT-S/16 384
    5-16% faster than one in the full bench runs of a 2-core Intel Xeon and a
    2-core AMD EPYC (Zen 4), and predicted at 0.94-1.16x the speed of one
    (at ViT-S/16 384 they peak 0.3-0.5 GB higher). 1 elsewhere: on a
    2-core AMD EPYC with AVX2 only, two streams trained 0.91-1.06x as fast as
    one, and no machine of more cores was measured (README, Training). Also 1
    where `TF_NUM_INTRAOP_THREADS` or `TF_NUM_INTEROP_THREADS` is set: the
    threads were chosen.

    It reads the devices without starting TensorFlow's runtime, so
    `configure_cpu_streams(2)` still works after it. Where it says 1, leave
    the threads as they are (`configure_cpu_streams(1)` would give the
    executor one thread): `configure_cpu_streams("auto")` does both.
    `cores` defaults to the cores this process may run on.
    """
    if cores is not None:  # a bad value is an error wherever the answer is 1 anyway
        cores = positive_int("cores", cores)
    if keras.backend.backend() != "tensorflow":
        return 1
    if any(os.environ.get(name) for name in THREAD_ENVS):
        return 1
    if (_available_cores() if cores is None else cores) != 2 or not _cpu.onednn_avx512():
        return 1
    import tensorflow as tf

    devices = tf.config.list_physical_devices
    return 1 if devices("GPU") or devices("TPU") else 2


def configured_streams():
    """The streams set by `configure_cpu_streams` (1 when it was not called)."""
    return _configured["streams"]


def _batch_size(structure):
    import tensorflow as tf

    first = next(t for t in keras.tree.flatten(structure) if t is not None)
    return tf.shape(first)[0]


def _split(structure, sizes, streams):
    """`structure`'s tensors cut along the batch axis: a list of `streams` structures."""
    import tensorflow as tf

    if structure is None:
        return [None] * streams
    pieces = [
        tf.split(t, sizes, num=streams, axis=0) if t is not None else [None] * streams
        for t in keras.tree.flatten(structure)
    ]
    return [keras.tree.pack_sequence_as(structure, [p[i] for p in pieces]) for i in range(streams)]


def _concat(structures):
    import tensorflow as tf

    return keras.tree.map_structure(lambda *parts: tf.concat(parts, axis=0), *structures)


def _part_sizes(n, streams):
    """Row counts of the parts: as equal as possible, the first ones one larger."""
    import tensorflow as tf

    base, extra = n // streams, n % streams
    return tf.stack([base + tf.cast(i < extra, n.dtype) for i in range(streams)])


def _run_streams(n, streams, single, streamed):
    """streamed(sizes) when the batch has at least `streams` rows, else single()."""
    import tensorflow as tf

    return tf.cond(n >= streams, lambda: streamed(_part_sizes(n, streams)), single)


def _part_counts(streams):
    """The part counts a token limit picks from: streams, 2 x streams, ... up to MAX_PARTS."""
    counts = [streams]
    while counts[-1] * 2 <= MAX_PARTS:
        counts.append(counts[-1] * 2)
    return counts


def _part_branch(n, counts, tokens, part_tokens):
    """Which of `counts` cuts an `n`-row batch; 0 for none (the batch runs whole).

    The smallest count (index + 1) whose parts hold at most `part_tokens`
    tokens of `tokens` each per row, among the counts no larger than `n`; the
    largest such count when none is small enough; 0 when `n` is below them all.
    """
    import tensorflow as tf

    counts = tf.constant(counts, dtype=n.dtype)
    fits = counts <= n  # a prefix: the counts grow
    small = fits & (counts * part_tokens >= n * tokens)
    return tf.where(
        tf.reduce_any(small),
        tf.cast(tf.argmax(tf.cast(small, "int32")), n.dtype) + 1,
        tf.reduce_sum(tf.cast(fits, n.dtype)),
    )


def _forward(model, x, training):
    return model(x, training=training) if model._call_has_training_arg else model(x)


def _make_steps(model, streams, train_jit, infer_jit, tokens=None, part_tokens=None):
    import tensorflow as tf
    from keras.src.losses.loss import unscale_loss_for_distribution
    from keras.src.trainers.data_adapters.data_adapter_utils import unpack_x_y_sample_weight

    def predict_parts(x):
        forward = tf.function(lambda part: _forward(model, part, False), jit_compile=infer_jit)
        n = _batch_size(x)

        def streamed(count, sizes=None):
            sizes = _part_sizes(n, count) if sizes is None else sizes
            return _concat([forward(part) for part in _split(x, sizes, count)])

        if part_tokens is None or tokens is None:
            return _run_streams(n, streams, lambda: forward(x), lambda s: streamed(streams, s))
        # More parts for larger batches: one branch per count; only the chosen one runs.
        counts = _part_counts(streams)
        branches = [lambda: forward(x)] + [lambda c=c: streamed(c) for c in counts]
        return tf.switch_case(_part_branch(n, counts, tokens, part_tokens), branches)

    def predict_step(data):
        x, _, _ = unpack_x_y_sample_weight(data)
        return predict_parts(x)

    def test_step(data):
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        y_pred = predict_parts(x)
        loss = model._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
        )
        model._loss_tracker.update_state(
            unscale_loss_for_distribution(loss), sample_weight=_batch_size(x)
        )
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def train_step(data):
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        weights = model.trainable_weights
        connected = []  # indices of the weights that get a gradient (known when traced)

        def part_gradients(x, y, sample_weight, share):
            # The part's loss weighted by its share of the batch: its gradients
            # are then the part's term of the whole batch's gradient.
            with tf.GradientTape() as tape:
                y_pred = _forward(model, x, True)
                loss = model._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
                scaled = model.optimizer.scale_loss(tf.cast(share, loss.dtype) * loss)
            gradients = tape.gradient(scaled, weights)
            connected[:] = [i for i, g in enumerate(gradients) if g is not None]
            return loss, y_pred, [gradients[i] for i in connected]

        # Graph mode, not XLA, for the parts: on one core TensorFlow's oneDNN
        # products run 15-19% faster than XLA's, and a ViT-B/16 step is ~13% faster.
        part_gradients = tf.function(part_gradients)

        def apply(gradients):
            model.optimizer.apply_gradients(zip(gradients, [weights[i] for i in connected]))

        apply = tf.function(apply, jit_compile=train_jit)
        n = _batch_size(x)

        def streamed(sizes):
            shares = tf.unstack(tf.cast(sizes, "float32") / tf.cast(n, "float32"))
            parts = [
                part_gradients(*part, share)
                for part, share in zip(
                    zip(*(_split(s, sizes, streams) for s in (x, y, sample_weight))), shares
                )
            ]
            if connected:
                # Summed here, one variable at a time, as the parts' gradients
                # come: each pair is freed once added, so the two full sets are
                # not all alive at once (an update that took both sets kept
                # them until the last gradient came).
                apply([tf.add_n([part[2][i] for part in parts]) for i in range(len(connected))])
            loss = tf.add_n([tf.cast(s, p[0].dtype) * p[0] for s, p in zip(shares, parts)])
            return loss, _concat([part[1] for part in parts])

        def single():
            loss, y_pred, gradients = part_gradients(x, y, sample_weight, tf.ones(()))
            if connected:
                apply(gradients)
            return loss, y_pred

        loss, y_pred = _run_streams(n, streams, single, streamed)
        if not weights:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
        model._loss_tracker.update_state(unscale_loss_for_distribution(loss), sample_weight=n)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return train_step, test_step, predict_step


def use_streams(model, streams=None, infer_jit=None, train=True, part_tokens=None):
    """Makes a compiled `model` cut each batch into `streams` parts run side by side.

    `streams` defaults to `configured_streams()`; 1 undoes it. Training
    parts run in graph mode; the model's `jit_compile` decides whether the
    optimizer update is an XLA program. `infer_jit` (default: the model's
    `jit_compile`) decides whether each predict and evaluate part is one.
    `train=False` cuts predict and evaluate batches only and leaves the train
    step as the model compiled it (no optimizer needed). `part_tokens`, for
    a keras_vit model of known size: predict and evaluate batches are cut in
    more parts (`streams` times 2, 4, ..., up to `MAX_PARTS`) until each
    part holds at most that many tokens (images x the model's tokens per
    image); a batch too small for that many parts gets the most it has rows
    for. Call it again after each `model.compile`.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model. Received: model={model!r}")
    streams = positive_int("streams", configured_streams() if streams is None else streams)
    if part_tokens is not None:
        part_tokens = positive_int("part_tokens", part_tokens)
    names = ("train_step", "test_step", "predict_step")
    makers = ("make_train_function", "make_test_function", "make_predict_function")
    # Back to the model as it was before streams, with its own overrides
    # (inference_without_xla's) if it had any.
    for name, value in vars(model).pop(_UNSTREAMED, {}).items():
        vars(model).pop(name, None)
        if value is not None:
            vars(model)[name] = value
    vars(model).pop(_PARTS, None)
    vars(model).pop(_PART_TOKENS, None)
    model.train_function = model.test_function = model.predict_function = None
    if streams == 1:
        return model
    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            f"Streams need the TensorFlow backend. Received: backend {keras.backend.backend()!r}"
        )
    if model.distribute_strategy.num_replicas_in_sync > 1:
        raise ValueError("Streams run on one replica; this model's strategy has several.")
    if not getattr(model, "compiled", False) or (train and model.optimizer is None):
        raise ValueError(
            "Compile the model (with an optimizer) before `use_streams`."
            if train
            else "Compile the model before `use_streams`."
        )
    if train and _cpu.computes_in_bfloat16(model) and not _cpu.native_bfloat16():
        warnings.warn(
            "This model computes in bfloat16, and this CPU has no bfloat16 instructions "
            "(or oneDNN is off or capped below them): the streams' training parts run in "
            "graph mode, which emulates bfloat16 about 3x slower than XLA without streams. "
            "Train in float32, or without streams.",
            stacklevel=2,
        )
    from keras_vit.layers.attention import tokens_per_image

    tokens = tokens_per_image(model) if part_tokens is not None else None
    train_jit = bool(model.jit_compile)
    infer_jit = train_jit if infer_jit is None else bool(infer_jit)
    steps = _make_steps(model, streams, train_jit, infer_jit, tokens, part_tokens)
    if not train:  # predict and evaluate only
        names, makers, steps = names[1:], makers[1:], steps[1:]
    # What each replaced name was (None: the class's own), to undo it.
    vars(model)[_UNSTREAMED] = {n: vars(model).get(n) for n in names + makers}
    vars(model)[_PARTS] = (streams if train else 1, streams)
    if tokens is not None:
        vars(model)[_PART_TOKENS] = part_tokens
    for name, step in zip(names, steps):
        setattr(model, name, step)
    # The steps are graph-mode functions: the executor runs their parts side
    # by side, which one XLA program for the whole step would not; the parts'
    # own functions (and the update) decide on XLA themselves.
    for name in makers:
        make_without_xla(model, name)
    return model


def parts(model):
    """(parts of a training batch, parts of a predict or evaluate batch) of `model`.

    (1, 1) for a model that `use_streams` did not cut. With `part_tokens(model)`,
    the second is the fewest parts of a predict or evaluate batch.
    """
    return vars(model).get(_PARTS, (1, 1))


def part_tokens(model):
    """The most tokens of one predict or evaluate part of `model`, or None for no limit."""
    return vars(model).get(_PART_TOKENS)


def make_without_xla(model, name):
    """Overrides `model`'s `name` (a make_*_function) to build its function without XLA."""
    make = getattr(type(model), name)

    def make_function(force=False):
        jit_compile = model.jit_compile
        model.jit_compile = False
        try:
            return make(model, force=force)
        finally:
            model.jit_compile = jit_compile

    setattr(model, name, make_function)
