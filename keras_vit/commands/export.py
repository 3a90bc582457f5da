"""`keras-vit export`: a trained model to a SavedModel or a TFLite file."""

import errno
import os

from keras_vit.cli import UsageError

HELP = "Export a trained model (.keras file or training folder) to SavedModel or TFLite."

FORMATS = ("saved_model", "tflite")
# Why the system may refuse to write --output: reported as usage errors.
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.ENOENT)


def add_arguments(parser):
    parser.add_argument(
        "--model",
        required=True,
        metavar="DIR_OR_FILE",
        help="a .keras file, or a training output folder holding model.keras "
        "(and optionally classes.json, a JSON list of class names)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="saved_model",
        help="what to write (default saved_model)",
    )
    parser.add_argument(
        "--output",
        required=True,
        metavar="PATH",
        help="the SavedModel folder or the .tflite file to write",
    )
    parser.add_argument(
        "--quantization",
        choices=("none", "dynamic", "float16"),
        default="none",
        help="TFLite only: dynamic-range int8 weights or float16 weights (default none)",
    )
    parser.add_argument(
        "--no-preprocessing",
        dest="preprocessing",
        action="store_false",
        help="SavedModel only: serving_default takes float images in [-1, 1] at the model's "
        "size instead of uint8 images of any size",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=5,
        help="SavedModel only: classes in the top-k outputs (default 5)",
    )
    parser.add_argument(
        "--class-names",
        metavar="JSON",
        help="SavedModel only: a JSON file of class names (overrides the training folder's "
        "classes.json)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace --output if it already exists"
    )


# Options of one format only: typed with the other format, they are refused.
SAVED_MODEL_ONLY = {
    "preprocessing": "--no-preprocessing",
    "top_k": "--top-k",
    "class_names": "--class-names",
}
TFLITE_ONLY = {"quantization": "--quantization"}


def run(args):
    from keras_vit import export
    from keras_vit.commands._common import explicit_flags, load_trained

    typed = explicit_flags(args)
    others = TFLITE_ONLY if args.format == "saved_model" else SAVED_MODEL_ONLY
    misplaced = [flag for name, flag in others.items() if name in typed]
    if misplaced:
        other = "tflite" if args.format == "saved_model" else "saved_model"
        raise UsageError(
            f"{', '.join(misplaced)} {'applies' if len(misplaced) == 1 else 'apply'} to "
            f"--format {other} only. Received: --format {args.format} {' '.join(misplaced)}"
        )
    quantization = None if args.quantization == "none" else args.quantization
    # The output is checked before the model is read: a file where a folder goes,
    # a path under a file, an existing output without --overwrite.
    try:
        export.check_target(
            args.output, args.overwrite, directory=args.format == "saved_model", argument="--output"
        )
    except FileExistsError:
        if os.path.isdir(args.output):
            what, replaced = "a folder that is not empty", "the SavedModel in it (other files stay)"
        else:
            what, replaced = "a file", "it"
        raise UsageError(
            f"--output {args.output!r} already exists: {what}. Pass --overwrite to replace "
            f"{replaced}, or choose another path"
        ) from None
    if args.top_k < 1:
        raise UsageError(f"--top-k must be a positive integer. Received: --top-k {args.top_k}")

    model, class_names = load_trained(args.model, class_names_file=args.class_names)
    if class_names is not None and not export.has_head(model):
        if args.class_names is not None:
            raise UsageError(
                "--class-names needs a model with a classification head; "
                f"{args.model!r} has none (num_classes=0, features out). "
                f"Received: --class-names {args.class_names!r}"
            )
        class_names = None  # a classes.json beside a features model: no classes to name
    try:
        if args.format == "saved_model":
            export.export_saved_model(
                model,
                args.output,
                preprocessing=args.preprocessing,
                class_names=class_names,
                top_k=args.top_k,
                overwrite=args.overwrite,
            )
        else:
            export.export_tflite(
                model, args.output, quantization=quantization, overwrite=args.overwrite
            )
    except OSError as error:
        # The system refused a write under --output (no permission, a read-only
        # file system, no space left): what was there is left as it was.
        if error.errno not in UNWRITABLE:
            raise
        raise UsageError(
            f"--output {args.output!r} cannot be written: {error.strerror} ({error.filename})"
        ) from None
    names = f", {len(class_names)} class names" if class_names and args.format != "tflite" else ""
    print(f"Wrote {args.format} to {args.output}{names}")
    return 0
