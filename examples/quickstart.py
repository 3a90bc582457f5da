"""Build a ViT, print its summary and run it on a few generated images.

    python examples/quickstart.py

Runs offline with freshly initialised weights. The head starts at zero, as
in the original, so an untrained model gives zero logits: the script shows
the pooled features instead (their cosine similarities). Pass a checkpoint
(`weights="path/to/ViT-B_16.npz"`) for real predictions.
"""

import argparse

import numpy as np

import keras_vit


def main():
    model = keras_vit.ViT_Ti16(image_size=224, num_classes=0)
    model.summary(line_length=100)
    # Four generated uint8 images: stripes, a gradient, a checkerboard, noise.
    rng = np.random.default_rng(0)
    grid = np.indices((224, 224)).sum(0)
    images = np.stack(
        [
            np.repeat(((grid % 32) < 16)[..., None] * 255, 3, axis=-1),
            np.repeat(np.linspace(0, 255, 224)[None, :, None], 224, axis=0).repeat(3, -1),
            np.repeat((((grid // 28) % 2) * 255)[..., None], 3, axis=-1),
            rng.integers(0, 256, size=(224, 224, 3)),
        ]
    ).astype("uint8")
    features = model.predict(keras_vit.preprocess_inputs(images), verbose=0)
    print(f"features: {features.shape} (one {features.shape[1]}-d vector per image)")
    unit = features / np.linalg.norm(features, axis=1, keepdims=True)
    names = ["stripes", "gradient", "checkerboard", "noise"]
    print("cosine similarity of the features:")
    print(" " * 13 + "".join(f"{name:>13}" for name in names))
    for name, row in zip(names, unit @ unit.T):
        print(f"{name:>13}" + "".join(f"{value:13.3f}" for value in row))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help only
    main()
