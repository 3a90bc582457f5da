"""`keras-vit train`: train or fine-tune a ViT; with no arguments, a small ViT on digits."""

import csv
import json
import os
import shutil
import sys
import tempfile
import time

from keras_vit.cli import UsageError

HELP = "Train or fine-tune a ViT (default: a small ViT on the embedded digits dataset)."

# The default model: 32x32 images, 4x4 patches (64 tokens), 4 layers of width 64.
TINY = dict(patch_size=4, num_layers=4, num_heads=4, hidden_dim=64, mlp_dim=128)
DEFAULT_OUTPUT = "keras_vit_run"
PRECISIONS = ("mixed_float16", "mixed_bfloat16")


def add_arguments(parser):
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (default: patch 4, 4 layers, width 64) or a "
        "variant name such as ViT_Ti16, ViT_B16",
    )
    parser.add_argument(
        "--data",
        default="digits",
        help="digits (default, embedded), tfds:NAME, a folder of "
        "class sub-folders, or an .npz with x_train/y_train[/x_val/y_val]",
    )
    parser.add_argument("--image-size", type=int, default=32, help="input side in pixels (32)")
    parser.add_argument("--epochs", type=int, default=30, help="training epochs (30)")
    parser.add_argument("--batch-size", type=int, default=64, help="the GLOBAL batch size (64)")
    parser.add_argument(
        "--lr",
        type=float,
        default=0.01,
        help="base learning rate for a global batch of 512; "
        "the rate used is lr * batch_size / 512 (default 0.01, i.e. 1.25e-3 at batch 64)",
    )
    parser.add_argument("--warmup-epochs", type=float, default=3.0, help="linear warm-up (3)")
    parser.add_argument("--weight-decay", type=float, default=0.05, help="decoupled decay (0.05)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--clipnorm", type=float, default=1.0, help="global gradient norm clip")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout rate")
    parser.add_argument("--drop-path", type=float, default=0.0, help="stochastic depth rate")
    parser.add_argument(
        "--crop-scale",
        type=float,
        default=0.8,
        help="min area of the random resized crop (1 = no crop)",
    )
    parser.add_argument(
        "--flip",
        action="store_true",
        help="random horizontal flips (off by default: digits are not mirror-symmetric)",
    )
    parser.add_argument("--rand-augment", action="store_true", help="keras.layers.RandAugment")
    parser.add_argument("--mixup", type=float, default=0.0, help="MixUp alpha (0 = off)")
    parser.add_argument("--cutmix", type=float, default=0.0, help="CutMix alpha (0 = off)")
    parser.add_argument(
        "--skip-corrupt",
        action="store_true",
        help="folder data: skip unreadable images instead of stopping",
    )
    parser.add_argument(
        "--weights",
        help="fine-tune from a checkpoint (.keras, .npz, "
        ".safetensors or a preset name); a different head size is re-initialised",
    )
    parser.add_argument(
        "--mixed-precision",
        nargs="?",
        const="mixed_float16",
        choices=PRECISIONS,
        help="mixed precision policy (mixed_float16 when given alone)",
    )
    parser.add_argument(
        "--strategy", default="auto", choices=("auto", "default", "mirrored", "multiworker", "tpu")
    )
    parser.add_argument("--jit-compile", action="store_true", help="XLA-compile the train step")
    parser.add_argument(
        "--output", default=DEFAULT_OUTPUT, help=f"output folder ({DEFAULT_OUTPUT})"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run in --output from its last backup",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --output that is not a resumable run",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic ops (tf.config.experimental.enable_op_determinism)",
    )
    parser.add_argument(
        "--save-every", type=int, default=20, help="back up the training state every N steps (20)"
    )
    parser.add_argument("--tensorboard", action="store_true", help="write TensorBoard logs")
    parser.add_argument("--max-steps", type=int, help=argparse_suppress())
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def _check_args(args):
    for name in ("image_size", "epochs", "batch_size", "save_every"):
        value = getattr(args, name)
        if value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive. Received: {value}")
    if args.lr <= 0:
        raise UsageError(f"--lr must be positive. Received: {args.lr}")
    if not 0 < args.crop_scale <= 1:
        raise UsageError(f"--crop-scale must be in (0, 1]. Received: {args.crop_scale}")
    if args.mixup and args.cutmix:
        raise UsageError("use --mixup or --cutmix, not both")
    if args.weights and not os.path.exists(args.weights):
        from keras_vit import weights as weights_module

        args.weights = weights_module.resolve(args.weights)


def _prepare_output(args, chief):
    """The folder to write and the global step to resume from."""
    from keras_vit import training

    output = args.output
    backup = os.path.join(output, "backup")
    if not chief:
        return tempfile.mkdtemp(prefix="keras_vit_worker_"), training.backup_step(backup)
    if args.resume:
        step = training.backup_step(backup)
        if step == 0 and os.path.isfile(os.path.join(output, "model.keras")):
            raise UsageError(f"--output {output!r} holds a finished run; nothing to resume")
        os.makedirs(output, exist_ok=True)
        return output, step
    if os.path.isdir(output) and os.listdir(output):
        if not args.overwrite:
            hint = " or --resume" if training.backup_step(backup) else ""
            raise UsageError(
                f"--output {output!r} is not empty; pass --overwrite to replace it{hint}"
            )
        shutil.rmtree(output)
    os.makedirs(output, exist_ok=True)
    return output, 0


def build_model(name, image_size, num_classes, dropout=0.0, drop_path=0.0):
    import keras_vit

    common = dict(
        image_size=image_size,
        num_classes=num_classes,
        dropout_rate=dropout,
        drop_path_rate=drop_path,
    )
    if name == "tiny":
        return keras_vit.VisionTransformer(**TINY, name="vit_tiny", **common)
    constructor = getattr(keras_vit, name, None)
    if name not in keras_vit.VARIANTS or constructor is None:
        raise UsageError(
            f"--model must be 'tiny' or one of {sorted(keras_vit.VARIANTS)}. Received: {name!r}"
        )
    return constructor(**common)


def load_pretrained(model, path):
    """Loads a checkpoint into `model`; a head of another size stays freshly initialised."""
    import keras

    if path.endswith(".keras"):
        source = keras.models.load_model(path, safe_mode=True, compile=False)
    else:
        from keras_vit.weights import load_weights

        config = model.get_config()
        try:
            load_weights(model, path)
            return
        except ValueError:
            pass
        source = keras.Model.from_config(config)  # same architecture; loaded without the head
        load_weights(source, path)
    copied = 0
    for layer in model.layers:
        try:
            other = source.get_layer(layer.name)
        except ValueError:
            continue
        shapes = [tuple(weight.shape) for weight in layer.weights]
        if shapes and shapes == [tuple(weight.shape) for weight in other.weights]:
            layer.set_weights(other.get_weights())
            copied += 1
        elif layer.name != "head" and shapes:
            raise ValueError(
                f"--weights {path!r}: layer {layer.name!r} has shapes "
                f"{[tuple(w.shape) for w in other.weights]}, the model needs {shapes}"
            )
    print(f"Loaded {copied} layers from {path}")


def run(args):
    _check_args(args)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    from keras_vit import data, training

    if args.deterministic:
        tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(args.seed)
    strategy = training.get_strategy(args.strategy)
    chief = training.is_chief(strategy)
    output, start_step = _prepare_output(args, chief)

    train_source, validation_source = data.load_data(
        args.data, image_size=args.image_size, skip_corrupt=args.skip_corrupt
    )
    class_names = train_source.class_names
    steps = data.steps_per_epoch(train_source, args.batch_size)
    total_steps = steps * args.epochs
    soft = bool(args.mixup or args.cutmix)
    crop = None if args.crop_scale >= 1 else (args.crop_scale, 1.0)

    def make_train(start, end):
        if args.max_steps is not None:  # testing aid: stop early
            end = min(end, max(start, args.max_steps))
        return data.train_dataset(
            train_source,
            args.batch_size,
            args.image_size,
            epochs=args.epochs,
            seed=args.seed,
            start_step=start,
            end_step=end,
            crop_scale=crop,
            flip=args.flip,
            rand_augment=args.rand_augment,
            mixup_alpha=args.mixup,
            cutmix_alpha=args.cutmix,
        )

    validation = data.eval_dataset(
        validation_source, args.batch_size, args.image_size, one_hot=soft
    )
    if args.mixed_precision:
        keras.mixed_precision.set_global_policy(args.mixed_precision)
    with strategy.scope():
        model = build_model(
            args.model, args.image_size, len(class_names), args.dropout, args.drop_path
        )
        if args.weights and start_step == 0:
            load_pretrained(model, args.weights)
        learning_rate = training.scaled_learning_rate(args.lr, args.batch_size)
        schedule = training.WarmupCosine(
            learning_rate,
            total_steps,
            warmup_steps=min(total_steps, int(args.warmup_epochs * steps)),
        )
        optimizer = training.build_optimizer(
            model, schedule, args.optimizer, args.weight_decay, clipnorm=args.clipnorm
        )
        training.compile_model(
            model, optimizer, args.label_smoothing, jit_compile=args.jit_compile, soft_labels=soft
        )
    callbacks = training.make_callbacks(
        output, args.save_every, start_step, tensorboard=args.tensorboard
    )
    print(
        f"Training {model.name} ({model.count_params():,} parameters) on {args.data}: "
        f"{len(train_source)} train / {len(validation_source)} validation images, "
        f"{len(class_names)} classes, {args.epochs} epochs of {steps} steps, "
        f"global batch {args.batch_size}, lr {learning_rate:.3g}, "
        f"{strategy.num_replicas_in_sync} replica(s)"
        + (f", resuming at step {start_step}" if start_step else "")
    )
    started = time.time()
    training.fit_resumable(
        model,
        make_train,
        validation,
        args.epochs,
        steps,
        callbacks,
        verbose=0 if args.quiet else 1,
    )
    elapsed = time.time() - started
    if args.max_steps is not None and args.max_steps < total_steps:
        _write_weights_summary(model, output)
        return 0
    _finish(model, output, class_names, validation, elapsed, chief)
    if not chief:
        shutil.rmtree(output, ignore_errors=True)
    return 0


def _write_weights_summary(model, output):
    import numpy as np

    np.savez(os.path.join(output, "weights.npz"), *[w.numpy() for w in model.weights])


def _finish(model, output, class_names, validation, elapsed, chief):
    from keras_vit import training

    loss, accuracy = model.evaluate(validation, verbose=0)
    training.save_model_atomically(model, os.path.join(output, "model.keras"))
    _write_weights_summary(model, output)
    training._write_json(os.path.join(output, "classes.json"), class_names)
    history = _read_history(os.path.join(output, "history.csv"))
    training._write_json(os.path.join(output, "history.json"), history)
    _plot_curves(history, os.path.join(output, "curves.png"))
    _export(model, os.path.join(output, "saved_model"), class_names)
    shutil.rmtree(os.path.join(output, "backup"), ignore_errors=True)
    summary = dict(val_loss=loss, val_accuracy=accuracy, seconds=round(elapsed, 1))
    training._write_json(os.path.join(output, "summary.json"), summary)
    if chief:
        print(
            f"Validation accuracy {accuracy:.4f}, loss {loss:.4f} after {elapsed:.0f} s. "
            f"Wrote {output}/: model.keras, saved_model/, history.csv, history.json, "
            "curves.png, classes.json"
        )
        sys.stdout.flush()


def _export(model, path, class_names):
    try:
        from keras_vit.export import export_saved_model
    except ImportError:  # export.py not available: Keras' own export
        model.export(path)
        return
    export_saved_model(model, path, class_names=class_names, top_k=min(5, len(class_names)))


def _read_history(path):
    with open(path, newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    history = {}
    for row in rows:
        for key, value in row.items():
            history.setdefault(key, []).append(float(value) if key != "epoch" else int(value))
    return history


def _plot_curves(history, path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (loss_axes, accuracy_axes) = pyplot.subplots(1, 2, figsize=(10, 4))
    epochs = [epoch + 1 for epoch in history.get("epoch", [])]
    for key, axes in (("loss", loss_axes), ("accuracy", accuracy_axes)):
        for prefix, label in (("", "train"), ("val_", "validation")):
            if prefix + key in history:
                axes.plot(epochs, history[prefix + key], label=label)
        axes.set_xlabel("epoch")
        axes.set_ylabel(key)
        axes.legend()
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    json.dumps(history)  # history must be JSON-serialisable
