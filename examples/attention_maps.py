"""Where does a ViT look? Attention maps, rollout and the paper's Figure 7 plots.

    python examples/attention_maps.py                      # an untrained tiny ViT
    python examples/attention_maps.py --model runs/vit-... IMAGE.png ...

With `--model` (a `.keras` file or a `keras-vit train` output folder) the
plots show a trained model; without, a freshly built one on generated images,
which shows the mechanics but no learned structure.
"""

import argparse
import os

import numpy as np

import keras_vit


def generated_images(height, width):
    """Two uint8 test pictures of (height, width): a bright disc and a diagonal bar."""
    rows, cols = np.indices((height, width))
    size = min(height, width)
    disc = ((rows - height * 0.35) ** 2 + (cols - width * 0.6) ** 2 < (size * 0.2) ** 2) * 255
    bar = (np.abs(rows * width / height - cols) < width * 0.08) * 255
    return np.stack([np.repeat(m[..., None], 3, -1) for m in (disc, bar)]).astype("uint8")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("images", nargs="*", help="image files (default: generated ones)")
    parser.add_argument("--model", help="a .keras file or a training output folder")
    parser.add_argument("--output", default="attention_maps", help="folder for the PNGs")
    args = parser.parse_args(argv)

    if args.model:
        model, _ = keras_vit.export.load_trained(args.model)
    else:
        model = keras_vit.VisionTransformer(
            image_size=64,
            patch_size=8,
            num_layers=4,
            num_heads=4,
            hidden_dim=64,
            mlp_dim=128,
            num_classes=10,
        )
    # The size it was built for (a dynamic_image_size model's input has none).
    size = keras_vit.models.model_image_size(model)
    if args.images:
        from keras_vit.commands.explain import load_image, resize

        images = np.stack([resize(load_image(path), size) for path in args.images])
    else:
        images = generated_images(*size)
    inputs = keras_vit.preprocess_inputs(images)

    maps = keras_vit.attention_maps(model, inputs)  # one (batch, heads, T, T) array per block
    print(f"{len(maps)} blocks, attention maps of shape {maps[0].shape}")
    # grid_size=model: the model's patch grid, square or not.
    rollout = keras_vit.attention_rollout(maps, discard_ratio=0.5, grid_size=model)
    os.makedirs(args.output, exist_ok=True)
    for index, (image, attention) in enumerate(zip(images, rollout)):
        keras_vit.plot_attention(image, attention, path=f"{args.output}/rollout_{index}.png")
    keras_vit.plot_position_embedding_similarity(
        model, path=f"{args.output}/position_similarity.png"
    )
    keras_vit.plot_mean_attention_distance(
        model, inputs, maps=maps, path=f"{args.output}/attention_distance.png"
    )
    # A grid of patch tokens needs a fixed image size; a dynamic model gives the tokens.
    fixed = model.input_shape[1] is not None
    features = keras_vit.feature_extractor(model, layers=-1, patch_grid=fixed)(inputs)
    what = "patch-token grid" if fixed else "tokens"
    print(f"{what} of the last block: {tuple(features.shape)}")
    print(f"wrote the plots to {args.output}/")


if __name__ == "__main__":
    main()
