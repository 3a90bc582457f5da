"""Compare keras_vit hybrids with the original Flax implementation.

Needs `flax` and a checkout of google-research/vision_transformer (its
`vit_jax` package is imported from there; nothing of it is copied here):

    pip install flax
    python tools/compare_hybrid_with_flax.py --vit-jax /path/to/vision_transformer [--r50]

For each configuration the original `VisionTransformer` is initialised, every
parameter is perturbed (so that the zero-initialised head and gn3 scales
matter), the parameters are written as a released-layout .npz (pre-linen
block names), loaded with `keras_vit.load_weights` into a model built with
`approximate_gelu=True`, and the max |logit difference| is printed. Exits
with 1 when a difference exceeds --tolerance.
"""

import argparse
import collections
import os
import sys
import tempfile

import numpy as np

# (resnet_layers, resnet_width, patch, image, hidden, heads, mlp, layers, classes)
CONFIGS = {
    "root only (as R+ViT-Ti)": ((), 1, 2, 32, 32, 2, 64, 2, 10),
    "two stages": ((1, 1), 0.5, 1, 32, 32, 2, 64, 2, 10),
    "three stages, 64x64": ((2, 1, 1), 0.5, 1, 64, 48, 3, 96, 2, 7),
}
R50_B16 = ((3, 4, 9), 1, 1, 224, 768, 12, 3072, 12, 1000)

# Linen module names -> the names in the released checkpoints.
RELEASED_NAMES = {
    "MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1",
    "LayerNorm_1": "LayerNorm_2",
    "MlpBlock_0": "MlpBlock_3",
}


def released_key(key):
    for linen, released in RELEASED_NAMES.items():
        key = key.replace(f"/{linen}/", f"/{released}/")
    return key


def perturb(key, value, rng):
    if key.endswith("scale"):
        return 1 + 0.2 * rng.normal(size=value.shape)
    if key.endswith("bias"):
        return 0.1 * rng.normal(size=value.shape)
    if key == "cls" or key.endswith("pos_embedding"):
        return 0.5 * rng.normal(size=value.shape)
    if key.startswith("head/"):
        return rng.normal(0, 1 / np.sqrt(value.shape[0]), value.shape)
    if key.startswith(("conv_root/", "block")):
        return value + rng.normal(0, 0.05, value.shape[-1:])  # removed by the standardisation
    return value


def compare(models_vit, config, batch, seed=0):
    import jax
    import keras
    from flax.traverse_util import flatten_dict, unflatten_dict

    import keras_vit

    resnet_layers, width, patch, image, hidden, heads, mlp, num_layers, classes = config
    resnet = collections.namedtuple("ResNet", "num_layers width_factor")(resnet_layers, width)
    patches = collections.namedtuple("Patches", "size")((patch, patch))
    original = models_vit.VisionTransformer(
        num_classes=classes,
        patches=patches,
        hidden_size=hidden,
        transformer=dict(
            num_layers=num_layers,
            mlp_dim=mlp,
            num_heads=heads,
            dropout_rate=0.0,
            attention_dropout_rate=0.0,
        ),
        resnet=resnet,
    )
    rng = np.random.default_rng(seed)
    images = rng.uniform(-1, 1, (batch, image, image, 3)).astype("float32")
    initial = flatten_dict(
        original.init(jax.random.PRNGKey(seed), images, train=False)["params"], sep="/"
    )
    params = {
        key: np.asarray(perturb(key, np.asarray(v), rng), "float32") for key, v in initial.items()
    }
    reference = np.asarray(
        original.apply({"params": unflatten_dict(params, sep="/")}, images, train=False)
    )
    model = keras_vit.VisionTransformer(
        image_size=image,
        patch_size=patch,
        num_layers=num_layers,
        num_heads=heads,
        hidden_dim=hidden,
        mlp_dim=mlp,
        num_classes=classes,
        resnet_layers=resnet_layers,
        resnet_width=width,
        approximate_gelu=True,
    )
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "hybrid.npz")
        np.savez(path, **{released_key(key): value for key, value in params.items()})
        keras_vit.load_weights(model, path)
    logits = keras.ops.convert_to_numpy(model(images))
    return float(np.abs(logits - reference).max()), float(np.abs(reference).max())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vit-jax", required=True, help="checkout of vision_transformer")
    parser.add_argument("--r50", action="store_true", help="also R50+ViT-B/16 at 224 (slow)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args(argv)
    sys.path.insert(0, args.vit_jax)
    import keras
    from vit_jax import models_vit

    configs = dict(CONFIGS)
    if args.r50:
        configs["R50+ViT-B/16 at 224"] = R50_B16
    worst = 0.0
    for name, config in configs.items():
        difference, scale = compare(models_vit, config, batch=1 if config == R50_B16 else 2)
        worst = max(worst, difference)
        print(
            f"{keras.backend.backend():10s} {name:28s} max|logit| {scale:7.3f}  "
            f"max|difference| {difference:.2e}"
        )
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
