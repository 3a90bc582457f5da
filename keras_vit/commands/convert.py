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
    parser.add_argument(
        "--approximate-gelu",
        action="store_true",
        help="tanh GELU as the original Flax code (default: exact, as timm and HF)",
    )


def run(args):
    import keras_vit
    from keras_vit.models import VARIANTS
    from keras_vit.weights import infer_config, resolve

    if not args.destination.endswith(".keras"):
        raise UsageError(f"DST must end in .keras. Received: {args.destination}")
    path = resolve(args.source)
    inferred = infer_config(path, num_heads=args.num_heads)
    if args.model is not None:
        if args.model not in VARIANTS:
            raise UsageError(
                f"--model must be one of {', '.join(VARIANTS)}. Received: --model {args.model}"
            )
        config = dict(VARIANTS[args.model])
        for key in ("num_classes", "representation_size", "pooling", "image_size"):
            config[key] = inferred[key]
    else:
        config = inferred
    if args.config:
        try:
            config.update(json.loads(args.config))
        except json.JSONDecodeError as error:
            raise UsageError(
                f"--config is not valid JSON ({error}). Received: {args.config}"
            ) from None
    if args.image_size:
        if len(args.image_size) > 2:
            raise UsageError(f"--image-size takes H or H W. Received: {args.image_size}")
        config["image_size"] = tuple(args.image_size) * (3 - len(args.image_size))
    if args.num_classes is not None:
        config["num_classes"] = args.num_classes
    if args.approximate_gelu:
        config["approximate_gelu"] = True
    name = (args.model or "vision_transformer").lower()
    model = keras_vit.VisionTransformer(**config, name=name)
    report = keras_vit.load_weights(model, path)
    directory = os.path.dirname(os.path.abspath(args.destination))
    os.makedirs(directory, exist_ok=True)
    model.save(args.destination)
    print(
        f"Wrote {args.destination}: {report['format']} checkpoint, head {report['head']}, "
        f"pre-logits {report['pre_logits']}"
        + (f", position embedding resized {report['resized']}" if report["resized"] else "")
    )
    return 0
