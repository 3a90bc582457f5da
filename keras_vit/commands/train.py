"""`keras-vit train`: train or fine-tune a ViT; the project's main job.

With no arguments it trains a small ViT on scikit-learn's bundled digits
(offline) and writes runs/vit-<timestamp>/ with model.keras, saved_model/,
classes.json, history.csv, history.json, curves.png and best.keras.
"""

import json
import os
import shutil
import time

from keras_vit.cli import UsageError

HELP = "Train or fine-tune a ViT (default: a small ViT on the bundled digits, offline)."

# Small configurations for small images; any name of keras_vit.VARIANTS works too.
PRESETS = {
    "vit-digits": dict(patch_size=4, num_layers=4, num_heads=4, hidden_dim=64, mlp_dim=128),
    "vit-test": dict(patch_size=4, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32),
}
DEFAULT_MODEL = "vit-digits"
RUN_FILE = "run.json"
# Arguments stored in run.json and reused by --resume.
STORED = (
    "model",
    "data",
    "image_size",
    "epochs",
    "batch_size",
    "lr",
    "optimizer",
    "weight_decay",
    "warmup_epochs",
    "label_smoothing",
    "clipnorm",
    "weights",
    "mixed_precision",
    "seed",
    "flip",
    "crop_scale",
    "rand_augment",
    "mixup",
    "cutmix",
    "dropout",
    "backup_steps",
    "jit_compile",
    "remat",
    "cpu_streams",
    "skip_corrupt",
)


def _positive_int(text):
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _positive_float(text):
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def add_arguments(parser):
    from keras_vit.training import STRATEGIES

    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"{' | '.join(PRESETS)} or a variant such as ViT_Ti16, ViT_B16 "
        f"(default {DEFAULT_MODEL}: patch 4, width 64, 4 layers, 4 heads)",
    )
    parser.add_argument(
        "--data",
        default="digits",
        help="digits (bundled, offline; default) | tfds:NAME | a folder with one sub-folder "
        "per class | a .npz with x_train, y_train, x_test, y_test",
    )
    parser.add_argument("--image-size", type=_positive_int, default=32, help="default 32")
    parser.add_argument("--epochs", type=_positive_int, default=30, help="default 30")
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=64,
        help="the GLOBAL batch size, split over all replicas and workers (default 64)",
    )
    parser.add_argument(
        "--lr",
        type=_positive_float,
        default=4e-3,
        help="base learning rate for a global batch of 256; the peak rate used is "
        "lr * batch_size / 256 (default 4e-3, i.e. 1e-3 at batch 64), reached after a "
        "linear warm-up and followed by cosine decay to 0",
    )
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--weight-decay", type=float, default=0.05, help="default 0.05")
    parser.add_argument("--warmup-epochs", type=float, default=3.0, help="default 3")
    parser.add_argument("--label-smoothing", type=float, default=0.1, help="default 0.1")
    parser.add_argument("--clipnorm", type=float, default=1.0, help="global-norm clipping")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout rate (default 0)")
    parser.add_argument(
        "--weights", help="fine-tune from a checkpoint file (.npz, .safetensors, .keras ...)"
    )
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="mixed_float16 on GPUs, mixed_bfloat16 on CPUs/TPUs",
    )
    parser.add_argument("--strategy", choices=STRATEGIES, default="auto", help="default auto")
    parser.add_argument("--output", help="output folder (default runs/vit-<timestamp>)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run in --output (with its stored arguments)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --output folder"
    )
    parser.add_argument("--seed", type=int, default=0, help="default 0")
    parser.add_argument(
        "--flip",
        choices=("auto", "yes", "no"),
        default="auto",
        help="random horizontal flips (auto: not for digits)",
    )
    parser.add_argument(
        "--crop-scale",
        type=float,
        default=None,
        help="smallest area fraction of the random resized crop (default 0.85 for digits, "
        "0.35 otherwise; 1 for none)",
    )
    parser.add_argument("--rand-augment", action="store_true", help="RandAugment")
    parser.add_argument("--mixup", action="store_true", help="MixUp")
    parser.add_argument("--cutmix", action="store_true", help="CutMix")
    parser.add_argument(
        "--backup-steps",
        type=_positive_int,
        default=20,
        help="save a resumable backup every N steps (default 20)",
    )
    parser.add_argument(
        "--jit-compile",
        choices=("auto", "yes", "no"),
        default="auto",
        help="XLA-compile the train step and evaluation (auto: yes on one device, no with "
        "several replicas; on a CPU-only machine, graph mode where it is faster: evaluation on "
        "Intel CPUs whose oneDNN kernels run AVX-512; from 512 tokens (e.g. 16-pixel patches at "
        "384) with --cpu-streams 1, training, and evaluation too where oneDNN runs AVX-512, "
        "Intel or AMD; with --mixed-precision on CPUs with bfloat16 instructions, evaluation, "
        "and training with --cpu-streams 1. See keras_vit.training.plan_xla)",
    )
    parser.add_argument(
        "--remat",
        action="store_true",
        help="gradient checkpointing of every block: less memory, about 20%% slower",
    )
    parser.add_argument(
        "--cpu-streams",
        type=_positive_int,
        default=1,
        help="CPU only: cut each batch into N parts run side by side, each on cores/N "
        "cores (keras_vit.streams; 2 on a 2-core machine: 5-17%% faster evaluation, "
        "6-14%% faster training); with 1, evaluation with XLA still runs each batch "
        "as two or more parts, two at once",
    )
    parser.add_argument("--tensorboard", action="store_true", help="TensorBoard logs in logs/")
    parser.add_argument(
        "--skip-corrupt", action="store_true", help="folder data: skip unreadable images"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _check_args(args):
    for name in ("weight_decay", "label_smoothing", "clipnorm", "dropout", "warmup_epochs"):
        value = getattr(args, name)
        if value < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0. Received: {value}")
    if not 0 <= args.label_smoothing < 1:
        raise UsageError(f"--label-smoothing must be in [0, 1). Received: {args.label_smoothing}")
    if args.crop_scale is not None and not 0 < args.crop_scale <= 1:
        raise UsageError(f"--crop-scale must be in (0, 1]. Received: {args.crop_scale}")
    if args.weights and not os.path.isfile(args.weights):
        raise UsageError(f"--weights: no such file. Received: {args.weights!r}")
    from keras_vit.models import VARIANTS

    if args.model not in PRESETS and args.model not in VARIANTS:
        raise UsageError(
            f"--model must be one of {sorted(PRESETS) + sorted(VARIANTS)}. Received: {args.model!r}"
        )


def _prepare_output(args):
    """The output folder: new, resumed or (with --overwrite) replaced."""
    if args.output is None:
        if args.resume:
            raise UsageError("--resume needs --output, the folder of the run to continue")
        args.output = os.path.join("runs", time.strftime("vit-%Y%m%d-%H%M%S"))
    output = args.output
    run_file = os.path.join(output, RUN_FILE)
    resumable = os.path.isfile(run_file)
    if args.resume:
        if not resumable:
            raise UsageError(f"--resume: {output!r} is not a training run (no {RUN_FILE})")
        with open(run_file, encoding="utf-8") as file:
            stored = json.load(file)
        for name in STORED:
            if name in stored["args"]:
                setattr(args, name, stored["args"][name])
        return stored.get("completed", False)
    if os.path.isdir(output) and os.listdir(output):
        if not args.overwrite:
            hint = "pass --resume to continue it, " if resumable else ""
            raise UsageError(
                f"the output folder {output!r} is not empty; {hint}choose another --output, "
                "or pass --overwrite to replace it"
            )
        shutil.rmtree(output)
    elif os.path.exists(output) and not os.path.isdir(output):
        raise UsageError(f"--output must be a folder. Received: {output!r} (a file)")
    os.makedirs(output, exist_ok=True)
    _write_run_file(args, completed=False)
    return False


def _write_run_file(args, completed, extra=None):
    record = {"args": {name: getattr(args, name) for name in STORED}, "completed": completed}
    record.update(extra or {})
    path = os.path.join(args.output, RUN_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as file:
        json.dump(record, file, indent=2)
    os.replace(path + ".tmp", path)


def build_model(name, image_size, num_classes, num_channels=3, dropout=0.0, remat=False):
    import keras_vit

    if name in PRESETS:
        return keras_vit.VisionTransformer(
            image_size=image_size,
            num_classes=num_classes,
            num_channels=num_channels,
            dropout_rate=dropout,
            remat=remat,
            **PRESETS[name],
        )
    return getattr(keras_vit, name)(
        image_size=image_size,
        num_classes=num_classes,
        num_channels=num_channels,
        dropout_rate=dropout,
        remat=remat,
    )


def save_model_atomic(model, path):
    """model.save to a temporary file beside `path`, then rename."""
    temporary = path[: -len(".keras")] + ".tmp.keras"
    model.save(temporary)
    os.replace(temporary, path)


def _history_from_csv(path):
    import csv

    if not os.path.isfile(path):
        return {}
    history, seen = {}, {}
    with open(path, newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    for row in rows:  # a resumed epoch appears twice: keep the last row
        seen[int(row["epoch"])] = row
    for epoch in sorted(seen):
        for key, value in seen[epoch].items():
            try:
                history.setdefault(key, []).append(float(value))
            except (TypeError, ValueError):
                history.setdefault(key, []).append(None)
    return history


def plot_curves(history, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [int(e) + 1 for e in history.get("epoch", [])]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, metric in zip(axes, ("loss", "accuracy")):
        for key, label in ((metric, "train"), (f"val_{metric}", "validation")):
            if key in history:
                axis.plot(epochs, history[key], marker="o", markersize=3, label=label)
        axis.set_xlabel("epoch")
        axis.set_ylabel(metric)
        axis.set_title(metric)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run(args):
    from keras_vit.training import is_chief

    _check_args(args)
    if not is_chief():  # the chief owns the output folder; others write worker-*/ in it
        if args.output is None:
            raise UsageError("multi-worker training needs the same --output on every worker")
        os.makedirs(args.output, exist_ok=True)
        return train(args)
    completed = _prepare_output(args)
    if completed:
        print(f"The run in {args.output} is already complete.")
        return 0
    return train(args)


def train(args):
    import keras
    import tensorflow as tf

    from keras_vit import data as data_module
    from keras_vit import training

    output = args.output
    if args.cpu_streams > 1:  # before TensorFlow runs an operation
        from keras_vit import streams

        try:
            streams.configure_cpu_streams(args.cpu_streams)
        except (ValueError, RuntimeError) as error:
            raise UsageError(f"--cpu-streams: {error}") from None
    strategy = training.get_strategy(args.strategy)  # first: MultiWorker needs it before ops
    chief = training.is_chief()
    work_dir = output if chief else os.path.join(output, f"worker-{_task_index()}")
    os.makedirs(work_dir, exist_ok=True)
    keras.utils.set_random_seed(args.seed)
    training.set_mixed_precision(args.mixed_precision)

    data = data_module.load(
        args.data, image_size=args.image_size, seed=args.seed, skip_corrupt=args.skip_corrupt
    )
    channels = data.train.element_spec[0].shape[-1]
    steps = data_module.steps_per_epoch(data, args.batch_size)
    total_steps = steps * args.epochs
    lr = training.scaled_learning_rate(args.lr, args.batch_size)

    with strategy.scope():
        model = build_model(
            args.model, args.image_size, data.num_classes, channels, args.dropout, args.remat
        )
        if args.weights:
            _load_weights(model, args.weights)
        training.compile_model(
            model,
            total_steps,
            learning_rate=lr,
            warmup_steps=int(args.warmup_epochs * steps),
            optimizer=args.optimizer,
            weight_decay=args.weight_decay,
            label_smoothing=args.label_smoothing,
            clipnorm=args.clipnorm,
            jit_compile=_jit_compile(args.jit_compile),
        )
        done = _restore(model, work_dir)
    print(
        f"Training {args.model} ({model.count_params():,} parameters) on {args.data}: "
        f"{data.train_size} train / {data.validation_size} validation images, "
        f"{data.num_classes} classes, {args.epochs} epochs of {steps} steps, global batch "
        f"{args.batch_size} on {strategy.num_replicas_in_sync} replica(s), peak lr {lr:.2e}"
        + (f"; resuming at step {done}" if done else "")
    )
    validation = data_module.eval_pipeline(data, args.batch_size)
    verbose = 0 if args.quiet else 1
    epoch = done // steps
    if done % steps and epoch < args.epochs:  # finish the interrupted epoch first
        rest = steps - done % steps
        _fit(model, data, args, work_dir, done, epoch, epoch + 1, rest, validation, verbose)
        epoch += 1
    if epoch < args.epochs:
        skip = epoch * steps
        _fit(model, data, args, work_dir, skip, epoch, args.epochs, steps, validation, verbose)

    loss, accuracy = model.evaluate(validation, verbose=0)
    model_path = os.path.join(work_dir, "model.keras")
    save_model_atomic(model, model_path)
    if not chief:
        return 0
    with open(os.path.join(output, "classes.json"), "w", encoding="utf-8") as file:
        json.dump(data.class_names, file)
    history = _history_from_csv(os.path.join(output, "history.csv"))
    with open(os.path.join(output, "history.json"), "w", encoding="utf-8") as file:
        json.dump(history, file, indent=1)
    plot_curves(history, os.path.join(output, "curves.png"))
    saved_model = os.path.join(output, "saved_model")
    from keras_vit.export import export_saved_model

    if os.path.exists(saved_model):
        shutil.rmtree(saved_model)
    export_saved_model(model, saved_model, class_names=data.class_names)
    shutil.rmtree(os.path.join(output, "backup"), ignore_errors=True)
    _write_run_file(
        args, completed=True, extra={"val_loss": float(loss), "val_accuracy": float(accuracy)}
    )
    del tf
    print(f"Final validation accuracy: {accuracy:.4f} (loss {loss:.4f})")
    for name in ("model.keras", "saved_model", "best.keras", "classes.json"):
        print(f"  {name:14s} {os.path.join(output, name)}")
    for name in ("history.csv", "history.json", "curves.png"):
        print(f"  {name:14s} {os.path.join(output, name)}")
    return 0


def _task_index():
    task = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}").get("task", {})
    return f"{task.get('type', 'worker')}-{task.get('index', 0)}"


def _load_weights(model, path):
    if path.endswith(".keras"):
        import keras

        source = keras.models.load_model(path, safe_mode=True)
        for layer in model.layers:
            try:
                other = source.get_layer(layer.name)
            except ValueError:
                continue
            shapes = [tuple(w.shape) for w in other.weights]
            if shapes == [tuple(w.shape) for w in layer.weights]:
                layer.set_weights(other.get_weights())
            else:
                print(f"Not loaded (shapes differ): {layer.name}")
        return
    try:
        from keras_vit.weights import load_weights
    except ImportError:
        from keras_vit.weights.loader import load_weights
    load_weights(model, path)


def _restore(model, work_dir):
    """Loads the backup of an interrupted run, if any; returns the global step reached."""
    path = os.path.join(work_dir, "backup", "latest.weights.h5")
    if not os.path.isfile(path):
        return 0
    model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return int(model.optimizer.iterations.numpy())


def _fit(model, data, args, work_dir, skip, epoch, end_epoch, steps, validation, verbose):
    from keras_vit import data as data_module
    from keras_vit import training

    stream = data_module.train_pipeline(
        data,
        args.batch_size,
        seed=args.seed,
        skip_steps=skip,
        flip={"yes": True, "no": False}.get(args.flip, args.data != data_module.DIGITS),
        crop_scale=_crop(args),
        rand_augment=args.rand_augment,
        mixup=args.mixup,
        cutmix=args.cutmix,
    )
    callbacks = training.build_callbacks(
        work_dir,
        backup_steps=args.backup_steps,
        tensorboard=getattr(args, "tensorboard", False),
        csv_append=skip > 0,
    )
    model.fit(
        stream,
        initial_epoch=epoch,
        epochs=epoch + 1
        if steps != data_module.steps_per_epoch(data, args.batch_size)
        else args.epochs,
        steps_per_epoch=steps,
        validation_data=validation,
        callbacks=callbacks,
        verbose=verbose,
    )


def _jit_compile(value):
    # run.json of earlier versions stored a boolean.
    return {"yes": True, "no": False, True: True, False: False}.get(value, "auto")


def _crop(args):
    from keras_vit import data as data_module

    scale = args.crop_scale
    if scale is None:
        scale = 0.85 if args.data == data_module.DIGITS else 0.35
    return None if scale >= 1 else scale
