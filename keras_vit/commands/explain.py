"""`keras-vit explain`: attention-rollout overlays and top-k classes for images."""

import os

import numpy as np

from keras_vit.cli import UsageError
from keras_vit.commands._common import (
    class_probabilities,
    model_images,
    resize,  # noqa: F401  (examples/attention_maps.py)
)
from keras_vit.commands._common import read_image as load_image  # noqa: F401  (examples/)

HELP = "Write attention-rollout overlays of images and print their top-k classes."


def add_arguments(parser):
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="JPEG or PNG files")
    parser.add_argument(
        "--model", required=True, help="a .keras file or a `keras-vit train` output folder"
    )
    parser.add_argument("--output", required=True, help="folder for the overlay PNGs")
    parser.add_argument("--top-k", type=int, default=5, help="classes to print (default 5)")
    parser.add_argument(
        "--discard-ratio",
        type=float,
        default=0.0,
        help="rollout: drop this fraction of weights (default 0)",
    )
    parser.add_argument(
        "--head-fusion",
        choices=("mean", "max", "min"),
        default="mean",
        help="rollout head fusion (default mean)",
    )


def output_stems(paths):
    """File-name stems for the outputs, made unique (a/x.png, b/x.png -> x, x_1)."""
    stems, seen = [], set()
    for path in paths:
        stem = base = os.path.splitext(os.path.basename(path))[0]
        suffix = 1
        while stem in seen:
            stem, suffix = f"{base}_{suffix}", suffix + 1
        seen.add(stem)
        stems.append(stem)
    return stems


EXPLAIN_CHUNK = 8  # images explained at a time


def run(args):
    from PIL import Image

    from keras_vit.commands._common import load_trained
    from keras_vit.inspection import (
        attention_maps,
        attention_rollout,
        patch_encoder,
        transformer_blocks,
    )
    from keras_vit.models import model_image_size
    from keras_vit.preprocessing import preprocess_inputs
    from keras_vit.visualize import attention_overlay, plot_attention

    if args.top_k < 1:
        raise UsageError(f"--top-k must be a positive integer. Received: {args.top_k}")
    if not 0.0 <= args.discard_ratio < 1.0:  # NaN too
        raise UsageError(
            f"--discard-ratio must be a number in [0, 1). Received: {args.discard_ratio}"
        )
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise UsageError(
            f"--output must be a folder (for the overlay PNGs). Received: --output "
            f"{args.output!r}, an existing file"
        )
    for path in args.images:  # every argument is checked before the model is read
        load_image(path)
    model, class_names = load_trained(args.model)
    try:
        transformer_blocks(model)
        patch_encoder(model)
    except ValueError as error:
        raise UsageError(f"--model {args.model!r}: {error}") from None
    # A model built with dynamic_image_size=True explains at the size it was built for.
    size, channels = model_image_size(model), model.input_shape[3]
    try:
        os.makedirs(args.output, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"--output {args.output!r}: cannot create the folder ({error.strerror or error})"
        ) from None
    stems = output_stems(args.images)
    # A few images at a time: each keeps its decoded original (for the overlay at its
    # own size) and every block's attention maps (22 MB an image at ViT-B/16 224).
    for start in range(0, len(args.images), EXPLAIN_CHUNK):
        paths = args.images[start : start + EXPLAIN_CHUNK]
        originals = [load_image(path) for path in paths]
        inputs = preprocess_inputs(model_images(originals, size, channels))
        probs = class_probabilities(model, inputs)
        top_k = min(args.top_k, probs.shape[-1])
        rollout = attention_rollout(
            attention_maps(model, inputs),
            discard_ratio=args.discard_ratio,
            head_fusion=args.head_fusion,
            grid_size=model,
        )
        chunk = zip(paths, stems[start:], originals, probs, rollout)
        for path, stem, image, prob, attention in chunk:
            order = np.argsort(-prob)[:top_k]
            names = [class_names[i] if class_names else str(i) for i in order]
            # The overlay at the image's own size, and a titled side-by-side panel.
            overlay = os.path.join(args.output, f"{stem}_attention.png")
            Image.fromarray(attention_overlay(image, attention)).save(overlay)
            panel = os.path.join(args.output, f"{stem}_explain.png")
            title = f"{names[0]} ({prob[order[0]]:.1%})"
            plot_attention(image, attention, path=panel, title=title)
            print(f"{path}: " + ", ".join(f"{n} {prob[i]:.3f}" for n, i in zip(names, order)))
            print(f"  overlay: {overlay}  panel: {panel}")
    return 0
