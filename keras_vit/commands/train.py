"""`keras-vit train`: train or fine-tune a ViT; the project's main job.

With no arguments it trains a small ViT on scikit-learn's bundled digits
(offline) and writes runs/vit-<timestamp>/ with model.keras, saved_model/,
classes.json, history.csv, history.json, curves.png and best.keras.
"""

import errno
import json
import os
import shutil
import socket
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
# Locked (flock) by the process that writes a run folder, removed when it ends.
LOCK_FILE = ".keras-vit-train.lock"
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


def _cpu_streams(text):
    """--cpu-streams: "auto" or a positive integer."""
    return "auto" if text.strip().lower() == "auto" else _positive_int(text)


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
    from keras_vit.commands._common import seed_argument
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
    parser.add_argument(
        "--optimizer", choices=("adamw", "sgd"), default="adamw", help="default adamw"
    )
    parser.add_argument("--weight-decay", type=float, default=0.05, help="default 0.05")
    parser.add_argument("--warmup-epochs", type=float, default=3.0, help="default 3")
    parser.add_argument("--label-smoothing", type=float, default=0.1, help="default 0.1")
    parser.add_argument(
        "--clipnorm", type=float, default=1.0, help="global-norm clipping (default 1; 0: none)"
    )
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout rate (default 0)")
    parser.add_argument(
        "--weights",
        help="fine-tune from a checkpoint file (.npz, .safetensors, .keras) or a preset name "
        "(downloaded once into ~/.keras/keras_vit/)",
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
        help="continue the interrupted run in --output with its stored arguments (options "
        "that differ from them are refused)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace the run in a non-empty --output folder (one with {RUN_FILE}; other "
        "folders are refused, and files a run does not write are kept)",
    )
    parser.add_argument("--seed", type=seed_argument, default=0, help="default 0")
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
        help="save a resumable backup every N steps (default 20) and at each epoch's end",
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
        type=_cpu_streams,
        default="auto",
        help="CPU only: cut each batch into N parts run side by side, each on cores/N "
        "cores (keras_vit.streams; 2 on a 2-core machine trained 5-16%% faster in "
        "the bench on an Intel Xeon and an AVX-512 AMD EPYC, and predicted 8-16%% "
        "faster on the Xeon; see README); with 1, evaluation with XLA still runs "
        "each batch as two or more parts, two at once. auto (the default): 2 where "
        "that was measured faster, a 2-core CPU-only machine whose oneDNN runs "
        "AVX-512, with one replica; 1 elsewhere "
        "(keras_vit.streams.recommended_cpu_streams)",
    )
    parser.add_argument(
        "--tensorboard", action="store_true", help="TensorBoard logs in OUTPUT/logs/"
    )
    parser.add_argument(
        "--skip-corrupt", action="store_true", help="folder data: skip unreadable images"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _check_args(args, weights=True):
    """Checks what can be checked without reading the data or building the model
    (`weights=False`: not --weights, which a run resumed from its backup does not read)."""
    from keras_vit.commands._common import check_data_spec

    for name in ("weight_decay", "label_smoothing", "clipnorm", "dropout", "warmup_epochs"):
        value = getattr(args, name)
        if value < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0. Received: {value}")
    if not 0 <= args.label_smoothing < 1:
        raise UsageError(f"--label-smoothing must be in [0, 1). Received: {args.label_smoothing}")
    if not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1). Received: {args.dropout}")
    if args.crop_scale is not None and not 0 < args.crop_scale <= 1:
        raise UsageError(f"--crop-scale must be in (0, 1]. Received: {args.crop_scale}")
    if weights and args.weights and not os.path.isfile(args.weights):
        from keras_vit.weights import PRESETS as CHECKPOINTS
        from keras_vit.weights import close_presets

        if os.path.isdir(args.weights) or args.weights not in CHECKPOINTS:
            close = close_presets(args.weights)
            hint = f"; close matches: {', '.join(close)}" if close else ""
            raise UsageError(
                f"--weights must be a checkpoint file (.npz, .safetensors, .keras) or a preset "
                f"name (keras_vit.weights.PRESETS){hint}. Received: "
                f"{args.weights!r} ({'a folder' if os.path.isdir(args.weights) else 'no such file'})"
            )
    from keras_vit.models import VARIANTS

    if args.model not in PRESETS and args.model not in VARIANTS:
        raise UsageError(
            f"--model must be one of {sorted(PRESETS) + sorted(VARIANTS)}. Received: {args.model!r}"
        )
    check_data_spec(args.data)
    if getattr(args, "tensorboard", False):
        from keras_vit.training import require_tensorboard

        try:
            require_tensorboard()
        except ImportError as error:
            raise UsageError(f"--tensorboard: {error}") from None


# What a run writes in its folder: --overwrite removes these, and keeps anything else.
RUN_ENTRIES = (
    "model.keras",
    "model.tmp.keras",
    "best.keras",
    "best.tmp.keras",
    "saved_model",
    "classes.json",
    "classes.json.tmp",
    "history.csv",
    "history.json",
    "curves.png",
    "backup",
    "logs",
    RUN_FILE + ".tmp",
)


def read_run_file(output):
    """The record of the run in `output` (run.json), or None when there is none."""
    path = os.path.join(output, RUN_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            stored = json.load(file)
    except (OSError, ValueError) as error:
        raise UsageError(
            f"{path!r} is not a readable run file of keras-vit train: {error}"
        ) from None
    if not isinstance(stored, dict) or not isinstance(stored.get("args"), dict):
        raise UsageError(f'{path!r} is not a run file of keras-vit train (no "args" object)')
    return stored


class OutputLock:
    """An exclusive lock on a run folder while one `keras-vit train` process writes it.

    It is an flock on LOCK_FILE in the folder, which the system releases when the
    process ends, killed or not: a second run on the folder is refused while the
    first is alive, and never after. The file is removed when the lock is
    released; one left by a killed process is locked again by the next run. Where
    the system has no flock (Windows) or the file system refuses it, runs are not
    locked.
    """

    def __init__(self):
        self._file = None
        self._path = None

    @property
    def held(self):
        return self._file is not None

    def acquire(self, folder):
        """Locks `folder` (which exists), or raises UsageError naming the holder."""
        try:
            import fcntl
        except ImportError:  # Windows
            return
        if self._file is not None:
            return
        path = os.path.join(folder, LOCK_FILE)
        while True:
            try:
                file = open(path, "a+", encoding="utf-8")
            except OSError as error:
                raise UsageError(
                    f"--output {folder!r} cannot be written: {error.strerror or error}"
                ) from None
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                file.seek(0)
                holder = file.read().strip() or "a process that has not said which yet"
                file.close()
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise UsageError(
                        f"another keras-vit train ({holder}) is writing {folder!r}; wait until "
                        "it ends, or choose another --output"
                    ) from None
                print(
                    f"Note: {folder!r} cannot be locked ({error.strerror or error}), so a "
                    "second keras-vit train on it would not be refused"
                )
                return
            try:  # the file locked must still be the one named: a holder removes it
                same = os.path.samestat(os.fstat(file.fileno()), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            file.close()
        file.seek(0)
        file.truncate()
        file.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        file.flush()
        self._file, self._path = file, path

    def release(self):
        if self._file is None:
            return
        try:  # removed while still locked, so no other process locks this file after
            os.remove(self._path)
        except OSError:
            pass
        self._file.close()  # closing the only descriptor releases the flock
        self._file = self._path = None


def _entries(folder):
    """What `folder` holds, less the lock file."""
    return sorted(entry for entry in os.listdir(folder) if entry != LOCK_FILE)


def _default_output():
    """runs/vit-<timestamp>, with -2, -3, ... when runs started in the same second."""
    base = os.path.join("runs", time.strftime("vit-%Y%m%d-%H%M%S"))
    candidate, number = base, 1
    while os.path.exists(candidate):
        number += 1
        candidate = f"{base}-{number}"
    return candidate


def _make_output(args, lock):
    """Creates and locks args.output, a folder that did not exist when the run was planned.

    A default output taken meanwhile by a run started in the same second moves on
    to the next free name; a given one made meanwhile is used if it is empty.
    """
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    while True:
        try:
            os.mkdir(args.output)
            break
        except FileExistsError:
            if not getattr(args, "_default_output", False):
                break
            args.output = _default_output()
    lock.acquire(args.output)
    # The folders of this run's other workers (multi-worker training) may be there already.
    if [entry for entry in _entries(args.output) if not entry.startswith("worker-")]:
        raise UsageError(
            f"--output {args.output!r} was made and written by another process while this "
            "run was getting ready; nothing was written. Choose another --output"
        )


def _flag(name, value):
    flag = "--" + name.replace("_", "-")
    return flag if value is True else f"{flag} {value}"  # True: a switch such as --mixup


def _same(name, value, stored):
    if name == "jit_compile":
        return _jit_compile(value) == _jit_compile(stored)
    return value == stored


def _plan_output(args, typed):
    """What to do with --output: "new", "overwrite", "resume" or "complete".

    Reads only; nothing is written or removed here (see `_commit_output`).
    For --resume the run's stored arguments replace those of `args`;
    `typed`, the options given on the command line, must not contradict them.
    """
    if args.resume and args.overwrite:
        raise UsageError(
            "--resume continues the run in --output and --overwrite replaces it: pass one of them"
        )
    if args.output is None:
        if args.resume:
            raise UsageError("--resume needs --output, the folder of the run to continue")
        args.output = _default_output()
        args._default_output = True
    output = args.output
    if os.path.exists(output) and not os.path.isdir(output):
        raise UsageError(f"--output must be a folder. Received: {output!r} (a file)")
    folder = os.path.abspath(output)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--output {output!r} cannot be written: {folder!r} is not writable")
    stored = read_run_file(output)
    if args.resume:
        if stored is None:
            raise UsageError(f"--resume: {output!r} is not a training run (no {RUN_FILE})")
        completed = bool(stored.get("completed", False))
        before = stored["args"]
        differ = [
            name
            for name in STORED
            if name in typed
            and name in before
            and not _same(name, getattr(args, name), before[name])
        ]
        if differ:
            flags = "; ".join(
                f"{_flag(name, getattr(args, name))} (the run has {before[name]})"
                for name in differ
            )
            if completed and differ == ["epochs"] and args.epochs > before["epochs"]:
                hint = (
                    f"A finished run cannot be extended: its learning rate decayed to 0 over "
                    f"{before['epochs']} epochs, and a longer run's schedule differs from the "
                    f"start. To train further, start a new run from its model: --weights "
                    f"{os.path.join(output, 'model.keras')} --output ANOTHER_FOLDER"
                )
            else:
                hint = (
                    "--resume continues the run with the arguments it was started with: drop "
                    "these options, or start a new run in another --output"
                )
            raise UsageError(
                f"--resume: options that differ from the run in {output!r}: {flags}. {hint}"
            )
        for name in STORED:
            if name in before:
                setattr(args, name, before[name])
        return "complete" if completed else "resume"
    if os.path.isdir(output) and _entries(output):
        if not args.overwrite:
            hint = "pass --resume to continue it, " if stored is not None else ""
            raise UsageError(
                f"the output folder {output!r} is not empty; {hint}choose another --output, "
                "or pass --overwrite to replace it"
            )
        if stored is None:
            raise UsageError(
                f"--overwrite replaces only the folder of an earlier keras-vit train run (one "
                f"with {RUN_FILE}); {output!r} holds other files "
                f"({', '.join(_entries(output)[:5])}), so nothing was deleted. Choose "
                "another --output, or empty the folder yourself"
            )
        return "overwrite"
    return "new"


def _commit_output(args, plan, lock, existed):
    """Carries out `_plan_output`'s plan, once every argument has been checked.

    `lock` (an OutputLock) holds the folder from here on, if it does not already;
    `existed`: whether the folder was there when the run was planned (if not, it
    is made now, and another run may have made it meanwhile).
    """
    if plan in ("new", "overwrite"):
        try:
            if existed:
                lock.acquire(args.output)  # held since the plan, where flock works
            else:
                _make_output(args, lock)
        except OSError as error:
            raise UsageError(
                f"--output {args.output!r}: cannot create the folder ({error.strerror or error})"
            ) from None
    output = args.output
    if plan == "overwrite":
        kept = []
        for entry in _entries(output):
            path = os.path.join(output, entry)
            if entry == RUN_FILE:  # replaced below, last, so the folder stays a run's
                continue
            if entry.startswith("worker-"):
                continue  # renewed by that worker (removing it races with its start)
            if entry not in RUN_ENTRIES:
                kept.append(entry)
            elif os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        if kept:
            print(
                f"--overwrite: kept {len(kept)} file(s) in {output} that a run does not write: "
                + ", ".join(kept[:10])
                + (", ..." if len(kept) > 10 else "")
            )
    if plan in ("new", "overwrite"):
        _write_run_file(args, completed=False)


def _write_run_file(args, completed, extra=None):
    record = {"args": {name: getattr(args, name) for name in STORED}, "completed": completed}
    if getattr(args, "_data_summary", None) is not None:
        record["data"] = args._data_summary
    record.update(extra or {})
    from keras_vit.training import write_json_atomic

    write_json_atomic(os.path.join(args.output, RUN_FILE), record, indent=2)


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


def _history_from_csv(path):
    import csv

    if not os.path.isfile(path):
        return {}
    history, seen = {}, {}
    with open(path, newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    for row in rows:  # a resumed epoch appears twice: keep the last row
        try:
            epoch = int(row.get("epoch") or "")
        except ValueError:
            continue  # a row cut short by a kill (or joined to the next one): no epoch's
        if None not in row:
            seen[epoch] = row
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
    from keras_vit.commands._common import explicit_flags
    from keras_vit.training import is_chief

    _check_args(args)
    if not is_chief():  # the chief owns the output folder; others write worker-*/ in it
        if args.output is None:
            raise UsageError("multi-worker training needs the same --output on every worker")
        if args.resume and os.path.isfile(os.path.join(args.output, RUN_FILE)):
            # The chief's run.json, in a folder the workers share: the run's arguments,
            # as the chief takes them (else this worker's command line must give them).
            plan = _plan_output(args, explicit_flags(args))
            if plan == "complete":
                return 0
            return train(args, resume=True)
        return train(args)
    # Nothing is written before every argument is checked, the data read and the
    # model built (with its --weights): train() calls prepare_output then. A folder
    # that exists is locked first, so that no other run writes it meanwhile.
    lock = OutputLock()
    existed = args.output is not None and os.path.isdir(args.output)
    try:
        if existed:
            lock.acquire(args.output)
        plan = _plan_output(args, explicit_flags(args))
        if plan == "complete":
            print(f"The run in {args.output} is already complete.")
            return 0
        if plan == "resume":
            try:
                _check_args(args, weights=not _has_backup(args.output))
            except UsageError as error:
                raise UsageError(
                    f"the run in {args.output!r} was started with arguments that are not valid "
                    f"now: {error}"
                ) from None
        return train(
            args,
            prepare_output=lambda: _commit_output(args, plan, lock, existed),
            resume=plan == "resume",
        )
    finally:
        lock.release()


def train(args, prepare_output=None, resume=False):
    """Trains as `args` say; `prepare_output()`, when given, is called once the data
    and the model are ready, before anything is written in `args.output`. `resume`:
    the run continues from its backup, when it has one (its --weights are not read)."""
    import keras
    import tensorflow as tf

    from keras_vit import data as data_module
    from keras_vit import training

    output = args.output
    cpu_streams = _configure_cpu_streams(args)  # before TensorFlow runs an operation
    try:  # first: MultiWorker needs it before ops
        strategy = training.get_strategy(args.strategy)
    except ValueError as error:  # a strategy of TensorFlow's on another Keras backend
        raise UsageError(f"--strategy {args.strategy}: {error}") from None
    chief = training.is_chief()
    work_dir = output if chief else os.path.join(output, f"worker-{_task_index()}")
    keras.utils.set_random_seed(args.seed)
    training.set_mixed_precision(args.mixed_precision)

    data = _load_data(args)
    args._data_summary = _data_summary(data)
    if resume and chief:
        _check_same_data(args)
    channels = data.train.element_spec[0].shape[-1]
    steps = data_module.steps_per_epoch(data, args.batch_size)
    total_steps = steps * args.epochs
    lr = training.scaled_learning_rate(args.lr, args.batch_size)

    with strategy.scope():
        model = build_model(
            args.model, args.image_size, data.num_classes, channels, args.dropout, args.remat
        )
        if args.weights and not (resume and _has_backup(work_dir)):
            _load_weights(model, args.weights, args.model)
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
        if prepare_output is not None:
            prepare_output()  # may move a default --output on to a free name
            output = args.output
            work_dir = output if chief else os.path.join(output, f"worker-{_task_index()}")
        os.makedirs(work_dir, exist_ok=True)
        if not chief and not resume:
            # A new run (or --overwrite): an earlier run's backup in this worker's folder
            # is not this run's, and Keras would restore it when fit begins.
            shutil.rmtree(os.path.join(work_dir, "backup"), ignore_errors=True)
        if chief:  # now, for best.keras of a run that is interrupted
            training.write_json_atomic(os.path.join(output, "classes.json"), data.class_names)
        done = _restore(model, work_dir)
    print(
        f"Training {args.model} ({model.count_params():,} parameters) on {args.data}: "
        f"{data.train_size} train / {data.validation_size} validation images, "
        f"{data.num_classes} classes, {args.epochs} epochs of {steps} steps, global batch "
        f"{args.batch_size} on {strategy.num_replicas_in_sync} replica(s), peak lr {lr:.2e}"
        + (f", {cpu_streams} CPU streams" if cpu_streams > 1 else "")
        + (f"; resuming at step {done}" if done else "")
    )
    if args.batch_size > data.train_size:
        print(
            f"Note: the global batch of {args.batch_size} is larger than the "
            f"{data.train_size} training images, so each batch holds some of them more than "
            f"once (a --batch-size of at most {data.train_size} does not)."
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
    training.write_atomic(model_path, model.save)
    if not chief:
        return 0
    history = _history_from_csv(os.path.join(output, "history.csv"))
    with open(os.path.join(output, "history.json"), "w", encoding="utf-8") as file:
        json.dump(history, file, indent=1)
    plot_curves(history, os.path.join(output, "curves.png"))
    saved_model = os.path.join(output, "saved_model")
    from keras_vit.export import export_saved_model

    # A resumed run that was stopped after its export replaces that SavedModel; the
    # new one is written aside and moved in, so a stop now still leaves the old one.
    export_saved_model(model, saved_model, class_names=data.class_names, overwrite=True)
    _write_run_file(
        args, completed=True, extra={"val_loss": float(loss), "val_accuracy": float(accuracy)}
    )
    # Only once the run is recorded as complete: killed before, it resumes from the
    # backups, the chief's and those of the other workers it can see (their last
    # backups came before the final evaluation, which waited for every worker).
    for folder in [output] + [
        os.path.join(output, entry) for entry in _entries(output) if entry.startswith("worker-")
    ]:
        shutil.rmtree(os.path.join(folder, "backup"), ignore_errors=True)
    del tf
    smoothing = f", with label smoothing {args.label_smoothing:g}" if args.label_smoothing else ""
    print(f"Final validation accuracy: {accuracy:.4f} (loss {loss:.4f}{smoothing})")
    for name in ("model.keras", "saved_model", "best.keras", "classes.json"):
        print(f"  {name:14s} {os.path.join(output, name)}")
    for name in ("history.csv", "history.json", "curves.png"):
        print(f"  {name:14s} {os.path.join(output, name)}")
    return 0


def _configure_cpu_streams(args):
    """Configures the CPU streams --cpu-streams asks for, before TensorFlow runs an
    operation; returns how many. "auto" configures `recommended_cpu_streams()` when
    the command owns its process (run from the command line, not `cli.main([...])`
    in a program whose threads are its own) and trains on one replica; and nothing,
    rather than an error, where TensorFlow has already started."""
    from keras_vit import streams

    requested = args.cpu_streams
    auto = requested == "auto"
    if auto:
        owned = getattr(args, "_own_process", False) and _one_replica(args.strategy)
        requested = streams.recommended_cpu_streams() if owned else 1
    if requested == 1:
        return 1
    try:
        streams.configure_cpu_streams(requested)
    except (ValueError, RuntimeError) as error:
        if auto:  # TensorFlow already runs: its threads stay as they are
            return 1
        raise UsageError(f"--cpu-streams: {error}") from None
    return requested


def _one_replica(strategy):
    """True when --strategy STRATEGY trains on one replica, as far as can be told before
    TensorFlow starts: "default", or "auto" without TF_CONFIG workers or a TPU in sight
    (several GPUs do not matter: with a GPU, no streams are recommended)."""
    if strategy == "default":
        return True
    if strategy != "auto":
        return False
    from keras_vit import training

    return training._tf_config_workers() <= 1 and not training._tpu_in_sight()


def _task_index():
    from keras_vit import training

    task = training._tf_config().get("task", {})
    return f"{task.get('type', 'worker')}-{task.get('index', 0)}"


def _data_summary(data):
    """What run.json records of the data, for --resume to check that it is the same."""
    return {
        "train_size": data.train_size,
        "validation_size": data.validation_size,
        "class_names": data.class_names,
    }


def _check_same_data(args):
    """A usage error when --data now gives other images or classes than when the run
    started (run.json of earlier versions records none: not checked)."""
    before = (read_run_file(args.output) or {}).get("data")
    now = args._data_summary
    if not isinstance(before, dict) or before == now:
        return

    def describe(value, key):
        if key != "class_names" or not isinstance(value, list):
            return repr(value)
        more = ", ..." if len(value) > 5 else ""
        return f"{len(value)} ({', '.join(map(str, value[:5]))}{more})"

    differ = [
        f"{key} {describe(before.get(key), key)} then, {describe(now[key], key)} now"
        for key in now
        if before.get(key) != now[key]
    ]
    raise UsageError(
        f"--resume: --data {args.data!r} is not the data the run in {args.output!r} started "
        f"with: {'; '.join(differ)}. A run continues only on the same data; start a new run "
        "in another --output (--weights DIR/best.keras to start from its best model)"
    )


def _load_data(args):
    """The training data, checked: the --image-size, 2 classes or more, validation images."""
    from keras_vit.commands._common import load_data, validation_hint

    size = args.image_size
    data = load_data(
        args.data,
        (size, size),
        seed=args.seed,
        skip_corrupt=args.skip_corrupt,
    )
    if data.num_classes < 2:
        raise UsageError(
            f"--data {args.data!r} has {data.num_classes} class "
            f"({', '.join(map(repr, data.class_names[:1]))}); a classifier needs 2 or more "
            "(a folder: one sub-folder of images per class; a .npz: labels 0, 1, ...)"
        )
    if data.validation_size == 0:
        raise UsageError(
            f"--data {args.data!r} gives {data.train_size} training images and 0 validation "
            f"images: {validation_hint(args.data, data)}"
        )
    return data


def _load_weights(model, path, model_name):
    """--weights: all of the file's weights, or none (a usage error says what differs).
    A preset name is downloaded first (once, into the cache)."""
    if not os.path.isfile(path):
        from keras_vit.weights import resolve

        try:
            path = resolve(path, argument="--weights")
        except (OSError, ValueError) as error:
            raise UsageError(f"--weights {path!r}: {error}") from None
    if path.endswith(".keras"):
        _load_keras_weights(model, path, model_name)
        return
    from keras_vit import cli
    from keras_vit.weights import load_weights

    try:
        load_weights(model, path)  # a head of another size is reset, with a warning
    except (ValueError, FileNotFoundError, TypeError) as error:
        if not cli.is_user_error(error):
            raise
        raise UsageError(f"--weights {path!r}: {error}") from None


def _shapes(shapes):
    return ", ".join("x".join(map(str, shape)) or "scalar" for shape in shapes)


def _load_keras_weights(model, path, model_name):
    """Loads a .keras model's weights layer by layer (by name), all or nothing.

    As `keras_vit.load_weights` does for .npz and .safetensors files: a head
    of another size (or none, or one that follows a pre-logits layer the
    model has not) is left at its initial zeros, and a position embedding of
    another grid is resized; any other layer missing, unused or of other
    shapes is a usage error, and nothing is loaded.
    """
    from keras_vit.commands._common import load_keras_file

    source = load_keras_file(path, flag="--weights", compile=False)
    ours = {layer.name: layer for layer in model.layers if layer.weights}
    theirs = {layer.name: layer for layer in source.layers if layer.weights}
    values, differ, missing, notes = {}, [], [], []
    head_reset = None
    for name, layer in ours.items():
        other = theirs.get(name)
        if other is None:
            if name == "head":
                head_reset = "the file's model has no head"
            else:
                missing.append(name)
            continue
        shapes = [tuple(w.shape) for w in layer.weights]
        found = [tuple(w.shape) for w in other.weights]
        arrays = other.get_weights()
        same_kind = type(layer).__name__ == type(other).__name__
        if same_kind and shapes == found:
            values[name] = arrays
            continue
        resized = _resized_position_embedding(layer, other, arrays) if same_kind else None
        if resized is not None:
            values[name], note = resized
            notes.append(note)
        elif name == "head" and same_kind:
            head_reset = (
                f"the file's head has {_shapes(found[:1])}, the model's {_shapes(shapes[:1])}"
            )
        else:
            differ.append(
                f"{name} (file: {type(other).__name__} {_shapes(found)}; "
                f"model: {type(layer).__name__} {_shapes(shapes)})"
            )
    unused = [name for name in theirs if name not in ours]
    if "pre_logits" in unused and "head" in ours:
        unused.remove("pre_logits")  # dropped, and the head after it cannot be used
        values.pop("head", None)
        head_reset = "the model has no pre-logits layer (representation_size)"
    if differ or missing or unused:
        raise UsageError(
            f"--weights {path!r} does not fit the model (--model {model_name}): "
            + "; ".join(
                part
                for part in (
                    differ and "layers whose weights differ: " + ", ".join(differ),
                    missing and "layers missing from the file: " + ", ".join(missing),
                    unused and "layers of the file the model has not: " + ", ".join(unused),
                )
                if part
            )
            + ". Nothing was loaded"
        )
    for name, arrays in values.items():
        ours[name].set_weights(arrays)
    for note in notes:
        print(note)
    if head_reset:
        print(
            f"The head was not loaded from {path} ({head_reset}); it keeps its initial zeros, "
            "to be fine-tuned."
        )


def _resized_position_embedding(layer, other, arrays):
    """(`other`'s patch-encoder weights with the position embedding resized to
    `layer`'s grid, a note), or None when anything else differs."""
    from keras_vit.weights import resize_position_embedding

    names = [w.name for w in layer.weights]
    if names != [w.name for w in other.weights] or "position_embedding" not in names:
        return None
    index = names.index("position_embedding")
    for i, (array, weight) in enumerate(zip(arrays, layer.weights)):
        if i != index and tuple(array.shape) != tuple(weight.shape):
            return None
    prefix = getattr(layer, "num_prefix_tokens", None)
    source, target = getattr(other, "grid_size", None), getattr(layer, "grid_size", None)
    if prefix is None or prefix != getattr(other, "num_prefix_tokens", None) or not source:
        return None
    source, target = tuple(source), tuple(target)
    embedding = arrays[index]
    if embedding.shape[-1] != layer.weights[index].shape[-1]:
        return None
    if embedding.shape[1] != prefix + source[0] * source[1]:
        return None
    arrays = list(arrays)
    arrays[index] = resize_position_embedding(embedding, source, target, prefix)
    return arrays, f"Resized the position embedding of --weights from a {source} grid to {target}."


def _backup_file(work_dir):
    return os.path.join(work_dir, "backup", "latest.weights.h5")


def _has_backup(work_dir):
    return os.path.isfile(_backup_file(work_dir))


def _restore(model, work_dir):
    """Loads the backup of an interrupted run, if any; returns the global step reached."""
    path = _backup_file(work_dir)
    if not os.path.isfile(path):
        return 0
    model.optimizer.build(model.trainable_variables)
    try:
        model.load_weights(path)
    except (OSError, ValueError) as error:
        first = (str(error).strip().splitlines() or [""])[0][:300]
        raise UsageError(
            f"the backup {path!r} of the run cannot be read ({type(error).__name__}: {first}). "
            "Nothing was changed; move the backup folder away to train the run again from "
            "its start"
        ) from None
    return int(model.optimizer.iterations.numpy())


def _best_accuracy(work_dir):
    """The best validation accuracy in history.csv, when best.keras holds a model of it."""
    if not os.path.isfile(os.path.join(work_dir, "best.keras")):
        return None
    values = [
        value
        for value in _history_from_csv(os.path.join(work_dir, "history.csv")).get(
            "val_accuracy", []
        )
        if value is not None
    ]
    return max(values) if values else None


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
        best_value=_best_accuracy(work_dir) if skip > 0 else None,
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
        shuffle=False,  # the pipeline shuffles; Keras warns that it ignores True for a Dataset
    )
    if model.stop_training:  # only TerminateOnNaN stops a run early
        step = int(model.optimizer.iterations.numpy())
        peak = training.scaled_learning_rate(args.lr, args.batch_size)
        raise UsageError(
            f"training diverged: the loss became NaN or infinite at step {step} with --lr "
            f"{args.lr} (a peak rate of {peak:.3g} at --batch-size {args.batch_size}). The run "
            f"in {args.output} is not complete and no model.keras was written; its backup "
            "and best.keras (if any) hold weights from before. Train again with a lower --lr "
            "(and --overwrite)"
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
