"""The training recipe: optimizer, schedule, strategies, callbacks and the fit loop.

The recipe of the paper and its fine-tuning: AdamW (or SGD with momentum),
linear warm-up then cosine decay, label smoothing, global-norm clipping, and
weight decay that skips norms, biases, the position embedding and the class
token. The learning rate given is the base rate for a global batch of 512:
`lr = base_lr * global_batch / 512` (`scaled_learning_rate`).
"""

import json
import math
import os

import keras
import numpy as np

REFERENCE_BATCH = 512
STRATEGIES = ("auto", "default", "mirrored", "multiworker", "tpu")
# Variables whose names contain one of these are not weight-decayed.
NO_DECAY = ("gamma", "beta", "bias", "position_embedding", "class_token")


@keras.saving.register_keras_serializable(package="keras_vit")
class WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0 to `peak` over `warmup_steps`, then cosine to `end`.

    Args:
        peak: the learning rate at the end of the warm-up.
        total_steps: the step at which the cosine reaches `end`.
        warmup_steps: length of the linear warm-up.
        end: the final learning rate.

    Example:
    >>> schedule = WarmupCosine(1.0, total_steps=10, warmup_steps=2)
    >>> [round(float(schedule(step)), 3) for step in (0, 1, 2, 10)]
    [0.0, 0.5, 1.0, 0.0]
    """

    def __init__(self, peak, total_steps, warmup_steps=0, end=0.0):
        if not total_steps > 0:
            raise ValueError(f"`total_steps` must be positive. Received: total_steps={total_steps}")
        if not 0 <= warmup_steps <= total_steps:
            raise ValueError(
                "`warmup_steps` must be in [0, total_steps]. "
                f"Received: warmup_steps={warmup_steps}, total_steps={total_steps}"
            )
        self.peak = float(peak)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.end = float(end)

    def __call__(self, step):
        step = keras.ops.cast(step, "float32")
        warmup = self.peak * step / max(self.warmup_steps, 1)
        progress = (step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1)
        progress = keras.ops.clip(progress, 0.0, 1.0)
        cosine = self.end + 0.5 * (self.peak - self.end) * (1 + keras.ops.cos(math.pi * progress))
        return keras.ops.where(step < self.warmup_steps, warmup, cosine)

    def get_config(self):
        return dict(
            peak=self.peak,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            end=self.end,
        )


def scaled_learning_rate(base_lr, global_batch_size):
    """`base_lr * global_batch_size / 512`: the rate for the batch actually used."""
    return base_lr * global_batch_size / REFERENCE_BATCH


def no_decay_variables(model):
    """The model variables that weight decay skips (norms, biases, embeddings, token)."""
    return [
        variable
        for variable in model.trainable_variables
        if any(key in variable.path.split("/")[-1] for key in NO_DECAY)
    ]


def build_optimizer(
    model,
    learning_rate,
    optimizer="adamw",
    weight_decay=0.05,
    momentum=0.9,
    clipnorm=1.0,
):
    """AdamW or SGD with momentum, global-norm clipping and selective decay.

    Args:
        model: the model (its no-decay variables are excluded from decay).
        learning_rate: a float or a `LearningRateSchedule`.
        optimizer: "adamw" or "sgd".
        weight_decay: decoupled weight decay (AdamW) or decay of SGD.
        momentum: SGD momentum.
        clipnorm: the global gradient norm clip (None for none).
    """
    if optimizer == "adamw":
        result = keras.optimizers.AdamW(
            learning_rate, weight_decay=weight_decay, beta_2=0.999, global_clipnorm=clipnorm
        )
    elif optimizer == "sgd":
        result = keras.optimizers.SGD(
            learning_rate, momentum=momentum, weight_decay=weight_decay, global_clipnorm=clipnorm
        )
    else:
        raise ValueError(f"`optimizer` must be 'adamw' or 'sgd'. Received: optimizer={optimizer!r}")
    result.exclude_from_weight_decay(var_list=no_decay_variables(model))
    return result


# Strategies ------------------------------------------------------------------


def _workers_in_tf_config():
    try:
        config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    except json.JSONDecodeError as error:
        raise ValueError(f"TF_CONFIG is not valid JSON: {error}") from None
    cluster = config.get("cluster", {})
    return len(cluster.get("worker", [])) + len(cluster.get("chief", []))


def get_strategy(name="auto"):
    """A `tf.distribute` strategy by name.

    "auto": `TPUStrategy` when a TPU is found, `MultiWorkerMirroredStrategy`
    when TF_CONFIG names several workers, `MirroredStrategy` for several GPUs,
    the default strategy otherwise.
    """
    import tensorflow as tf

    if name not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}. Received: strategy={name!r}")
    if name == "auto":
        if _find_tpu() is not None:
            name = "tpu"
        elif _workers_in_tf_config() > 1:
            name = "multiworker"
        elif len(tf.config.list_logical_devices("GPU")) > 1:
            name = "mirrored"
        else:
            name = "default"
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multiworker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    resolver = _find_tpu()
    if resolver is None:
        raise ValueError("`strategy='tpu'` but no TPU was found")
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return tf.distribute.TPUStrategy(resolver)


def _find_tpu():
    import tensorflow as tf

    if not (os.environ.get("TPU_NAME") or os.path.exists("/dev/accel0")):
        return None
    try:
        return tf.distribute.cluster_resolver.TPUClusterResolver()
    except (ValueError, RuntimeError):
        return None


def is_chief(strategy):
    """Whether this worker writes the outputs (always true off multi-worker)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    return task_type == "chief" or (
        task_type == "worker" and task_id == 0 and "chief" not in resolver.cluster_spec().as_dict()
    )


# Callbacks -------------------------------------------------------------------


class ResumableBackup(keras.callbacks.BackupAndRestore):
    """`BackupAndRestore` that records the global step, for mid-epoch resumption.

    The weights (model and optimizer) are saved every `save_freq` steps and at
    each epoch end, with {"global_step": ...}. `fit_resumable` reads the step
    back and restarts the data at that very batch.
    """

    def __init__(self, backup_dir, save_freq, start_step=0):
        super().__init__(backup_dir, save_freq=save_freq, delete_checkpoint=False)
        self.global_step = start_step

    def _load_model(self):
        if os.path.exists(self._weights_path):
            if self.model.optimizer is not None and not self.model.optimizer.built:
                self.model.optimizer.build(self.model.trainable_variables)
            self.model.load_weights(self._weights_path)

    def on_train_batch_end(self, batch, logs=None):
        self.global_step += 1
        super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._last_batch_seen = -1
        self._save_model()

    def on_train_end(self, logs=None):
        pass

    def _save_model(self):
        os.makedirs(self.backup_dir, exist_ok=True)
        temporary = self._weights_path + ".tmp.weights.h5"
        self.model.save_weights(temporary, overwrite=True)
        os.replace(temporary, self._weights_path)
        _write_json(os.path.join(self.backup_dir, "state.json"), {"global_step": self.global_step})


def backup_step(backup_dir):
    """The global step saved in `backup_dir`, or 0 when there is none."""
    state = os.path.join(backup_dir, "state.json")
    weights = os.path.join(backup_dir, "latest.weights.h5")
    if not (os.path.isfile(state) and os.path.isfile(weights)):
        return 0
    with open(state, encoding="utf-8") as file:
        return int(json.load(file)["global_step"])


def _write_json(path, value):
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(value, file, indent=1)
    os.replace(temporary, path)


def save_model_atomically(model, path):
    """`model.save(path)` through a temporary file and a rename: never half a file."""
    temporary = path[: -len(".keras")] + ".tmp.keras"
    model.save(temporary)
    os.replace(temporary, path)


class AtomicBestCheckpoint(keras.callbacks.Callback):
    """Saves the model with the best `monitor` to `path` (atomic rename)."""

    def __init__(self, path, monitor="val_accuracy"):
        super().__init__()
        self.path, self.monitor, self.best = path, monitor, -np.inf

    def on_epoch_end(self, epoch, logs=None):
        value = (logs or {}).get(self.monitor)
        if value is not None and value > self.best:
            self.best = value
            save_model_atomically(self.model, self.path)


def make_callbacks(output_dir, save_freq, start_step=0, tensorboard=False, best_path=None):
    """Backup (resume), CSV log, TerminateOnNaN, optional best checkpoint and TensorBoard."""
    callbacks = [
        ResumableBackup(os.path.join(output_dir, "backup"), save_freq, start_step),
        keras.callbacks.CSVLogger(os.path.join(output_dir, "history.csv"), append=start_step > 0),
        keras.callbacks.TerminateOnNaN(),
    ]
    if best_path is not None:
        callbacks.append(AtomicBestCheckpoint(best_path))
    if tensorboard:
        callbacks.append(keras.callbacks.TensorBoard(os.path.join(output_dir, "logs")))
    return callbacks


def compile_model(model, optimizer, label_smoothing=0.1, jit_compile=False, soft_labels=False):
    """Cross-entropy on logits with label smoothing, accuracy metric."""
    if soft_labels:
        loss = keras.losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=label_smoothing
        )
        metric = keras.metrics.CategoricalAccuracy(name="accuracy")
    else:
        loss = _SparseSmoothedCrossentropy(label_smoothing)
        metric = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    model.compile(optimizer=optimizer, loss=loss, metrics=[metric], jit_compile=jit_compile)


@keras.saving.register_keras_serializable(package="keras_vit")
class _SparseSmoothedCrossentropy(keras.losses.Loss):
    """Cross-entropy from logits and integer labels with label smoothing."""

    def __init__(self, label_smoothing=0.1, name="smoothed_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = label_smoothing

    def call(self, y_true, y_pred):
        num_classes = keras.ops.shape(y_pred)[-1]
        labels = keras.ops.one_hot(
            keras.ops.cast(keras.ops.reshape(y_true, [-1]), "int32"), num_classes
        )
        return keras.losses.categorical_crossentropy(
            labels, y_pred, from_logits=True, label_smoothing=self.label_smoothing
        )

    def get_config(self):
        return {**super().get_config(), "label_smoothing": self.label_smoothing}


def fit_resumable(model, make_train, validation, epochs, steps, callbacks, verbose=1):
    """`model.fit` that resumes at the global step saved by `ResumableBackup`.

    Args:
        model: a compiled model.
        make_train: function (start_step, end_step) -> training dataset of
            those global steps.
        validation: the validation dataset.
        epochs: the total number of epochs.
        steps: steps per epoch.
        callbacks: from `make_callbacks` (the first is the `ResumableBackup`).

    Returns:
        The list of `History` objects of the fit calls made.
    """
    backup = callbacks[0]
    start = backup.global_step
    histories = []
    epoch = start // steps
    if start % steps and epoch < epochs:
        # The rest of an interrupted epoch first, then the whole epochs.
        end = (epoch + 1) * steps
        histories.append(
            model.fit(
                make_train(start, end),
                validation_data=validation,
                initial_epoch=epoch,
                epochs=epoch + 1,
                steps_per_epoch=end - start,
                callbacks=callbacks,
                verbose=verbose,
            )
        )
        epoch += 1
    if epoch < epochs:
        histories.append(
            model.fit(
                make_train(epoch * steps, epochs * steps),
                validation_data=validation,
                initial_epoch=epoch,
                epochs=epochs,
                steps_per_epoch=steps,
                callbacks=callbacks,
                verbose=verbose,
            )
        )
    return histories
