"""`keras-vit convert`: a checkpoint (.npz, .safetensors or a preset) to a .keras file."""

import json
import os

from keras_vit.cli import UsageError

HELP = "Convert an original .npz, timm or Hugging Face .safetensors checkpoint to a .keras file."


def add_arguments(parser):
    parser.add_argument("source", metavar="SRC", help="a .npz / .safetensors file or a preset name")
    parser.add_argument("destination", metavar="DST", help="the .keras file to write")
    parser.add_argument(
        "--model",
        help="a variant name such as ViT_B16; by default the architecture is read from SRC",
    )
    parser.add_argument("--config", help="JSON of VisionTransformer arguments (overrides)")
    parser.add_argument("--image-size", type=int, nargs="+", help="H [W] of the converted model")
    parser.add_argument("--num-classes", type=int, help="head size (another size resets the head)")
    parser.add_argument("--num-heads", type=int, help="heads, for timm/HF files of a custom model")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it already exists")
    parser.add_argument(
        "--approximate-gelu",
        action="store_true",
        help="tanh GELU as the original Flax code (default: exact, as timm and HF)",
    )


# keras_vit's argument names in its messages, and the options that set them here.
OPTION_HINTS = {"`num_heads`": "--num-heads", "`image_size`": "--image-size H W"}


def _check_destination(destination, overwrite):
    if not destination.endswith(".keras"):
        raise UsageError(f"DST must end in .keras. Received: {destination}")
    if os.path.isdir(destination):
        raise UsageError(f"DST must be a .keras file. Received: {destination!r} (a folder)")
    if os.path.exists(destination) and not overwrite:
        raise UsageError(f"DST {destination!r} already exists (pass --overwrite to replace it)")
    folder = os.path.dirname(os.path.abspath(destination))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(
            f"DST {destination!r} cannot be written: {folder!r} is not a writable folder"
        )


def _parse_config(text):
    """The --config JSON: an object of VisionTransformer arguments."""
    import inspect

    import keras_vit

    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"--config is not valid JSON ({error}). Received: {text}") from None
    if not isinstance(config, dict):
        raise UsageError(
            "--config must be a JSON object of VisionTransformer arguments, such as "
            f'{{"num_heads": 3}}. Received: {text}'
        )
    known = [
        name
        for name in inspect.signature(keras_vit.VisionTransformer).parameters
        if name not in ("weights", "name")
    ]
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise UsageError(
            f"--config: unknown argument(s) {', '.join(unknown)}; VisionTransformer takes "
            f"{', '.join(known)}. Received: {text}"
        )
    return config


def _source_error(source, error):
    message = str(error)
    for name, option in OPTION_HINTS.items():
        message = message.replace(f"pass {name}", f"pass {option}")
    return UsageError(f"SRC {source!r}: {message}")


def run(args):
    import tempfile

    import keras_vit
    from keras_vit import cli
    from keras_vit.models import VARIANTS
    from keras_vit.weights import infer_config, resolve

    _check_destination(args.destination, args.overwrite)
    if args.model is not None and args.model not in VARIANTS:
        raise UsageError(
            f"--model must be one of {', '.join(VARIANTS)}. Received: --model {args.model}"
        )
    overrides = _parse_config(args.config) if args.config else {}
    if args.image_size:
        if len(args.image_size) > 2 or min(args.image_size) < 1:
            raise UsageError(
                f"--image-size takes H or H W, positive integers. Received: {args.image_size}"
            )
        overrides["image_size"] = tuple(args.image_size) * (3 - len(args.image_size))
    if args.num_classes is not None:
        if args.num_classes < 0:
            raise UsageError(
                f"--num-classes must be >= 0 (0: no head). Received: {args.num_classes}"
            )
        overrides["num_classes"] = args.num_classes
    if args.num_heads is not None and args.num_heads < 1:
        raise UsageError(f"--num-heads must be a positive integer. Received: {args.num_heads}")
    if args.approximate_gelu:
        overrides["approximate_gelu"] = True

    try:
        path = resolve(args.source, argument="SRC")
    except ValueError as error:  # neither a file nor a preset (close matches listed)
        raise UsageError(str(error)) from None
    except OSError as error:  # a preset whose download failed (named with its URL)
        raise UsageError(f"SRC {args.source!r}: {error}") from None
    try:
        # The size is needed to read a non-square checkpoint's grid.
        inferred = infer_config(
            path, num_heads=args.num_heads, image_size=overrides.get("image_size")
        )
    except (ValueError, FileNotFoundError) as error:
        if not cli.is_user_error(error):
            raise
        raise _source_error(args.source, error) from None
    if args.model is not None:
        config = dict(VARIANTS[args.model])
        for key in ("num_classes", "representation_size", "pooling", "image_size"):
            config[key] = inferred[key]
    else:
        config = inferred
    config.update(overrides)
    name = (args.model or "vision_transformer").lower()
    try:
        model = keras_vit.VisionTransformer(**config, name=name)
    except (ValueError, TypeError) as error:
        given = " with --config" if args.config else ""
        raise UsageError(
            f"the model read from SRC{given} cannot be built: {error}. "
            f"Received: {', '.join(f'{k}={v!r}' for k, v in overrides.items()) or 'no overrides'}"
        ) from None
    try:
        report = keras_vit.load_weights(model, path)
    except (ValueError, FileNotFoundError) as error:
        if not cli.is_user_error(error):
            raise
        raise _source_error(args.source, error) from None
    # Written beside DST, then renamed: a failed write leaves an existing DST as it was.
    directory = os.path.dirname(os.path.abspath(args.destination))
    temporary = None
    try:
        os.makedirs(directory, exist_ok=True)
        handle, temporary = tempfile.mkstemp(suffix=".keras", prefix=".convert-", dir=directory)
        os.close(handle)
        model.save(temporary)
        os.replace(temporary, args.destination)
    except OSError as error:
        raise UsageError(
            f"DST {args.destination!r} cannot be written: {error.strerror or error}"
        ) from None
    finally:
        if temporary is not None and os.path.exists(temporary):
            os.remove(temporary)
    print(
        f"Wrote {args.destination}: {report['format']} checkpoint, head {report['head']}, "
        f"pre-logits {report['pre_logits']}"
        + (f", position embedding resized {report['resized']}" if report["resized"] else "")
    )
    if report["format"] != "original" and args.num_heads is None and args.model is None:
        # timm and Hugging Face files do not store it, and any count loads.
        print(
            f"Note: {config['num_heads']} heads of {config['hidden_dim'] // config['num_heads']} "
            "assumed (a timm or Hugging Face file does not store the head count); if its "
            "model had another, convert again with --num-heads N"
        )
    return 0
