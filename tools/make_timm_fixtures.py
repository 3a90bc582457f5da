"""Generate the timm golden fixtures of tests/test_weights.py (needs torch and timm).

    python tools/make_timm_fixtures.py

For each tiny configuration a timm VisionTransformer is built, every
parameter is perturbed from its initialisation (normal noise on all of them,
so each tensor changes the logits), and stored under tests/data/:

    timm_{name}.safetensors          the state dict
    timm_{name}_inputs.npy           NHWC float32 images in [-1, 1]
    timm_{name}_logits.npy           timm's logits for them (float32 forward)

plus timm_resample_*.npy: timm's own `resample_abs_pos_embed` of the "square"
model's position embedding to a 6x6 grid (bilinear, no antialias), the golden
of keras_vit's half-pixel resize, and the logits of that resized timm model
on 48x48 inputs, and timm_dynamic.npz: the "square" model's weights in a timm
model with `dynamic_img_size=True` (its position embedding resized to each
input's grid, bicubic with antialiasing), inputs of several sizes and their
logits. The "gap" model uses fc_norm=False so that timm normalises
before pooling, as the original ViT does. timm's GELU is the exact erf one.
"""

import json
import os

import numpy as np
import timm  # noqa: F401
import torch
from safetensors.torch import load_file, save_file
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, os.pardir, "tests", "data")

BASE = dict(patch_size=8, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0)
CONFIGS = {
    "square": dict(img_size=32, num_classes=10),
    "nonsquare": dict(img_size=(32, 48), num_classes=10),
    "gap": dict(img_size=32, num_classes=10, class_token=False, global_pool="avg", fc_norm=False),
    "classes7": dict(img_size=32, num_classes=7),
}


def perturb(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            noise = torch.randn(parameter.shape, generator=generator) * 0.2
            parameter.add_(noise)


def main():
    os.makedirs(DATA, exist_ok=True)
    torch.manual_seed(0)
    manifest = {}
    for seed, (name, overrides) in enumerate(CONFIGS.items()):
        config = {**BASE, **overrides}
        model = VisionTransformer(**config).eval()
        perturb(model, seed)
        size = config["img_size"] if isinstance(config["img_size"], tuple) else (32, 32)
        rng = np.random.default_rng(seed)
        inputs = rng.uniform(-1, 1, (2, *size, 3)).astype("float32")
        with torch.no_grad():
            logits = model(torch.from_numpy(inputs).permute(0, 3, 1, 2)).numpy()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, os.path.join(DATA, f"timm_{name}.safetensors"))
        np.save(os.path.join(DATA, f"timm_{name}_inputs.npy"), inputs)
        np.save(os.path.join(DATA, f"timm_{name}_logits.npy"), logits.astype("float32"))
        manifest[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
        if name == "square":
            posemb = model.pos_embed.detach()
            resampled = resample_abs_pos_embed(
                posemb,
                new_size=[6, 6],
                old_size=[4, 4],
                num_prefix_tokens=1,
                interpolation="bilinear",
                antialias=False,
            )
            np.save(os.path.join(DATA, "timm_resample_posemb.npy"), resampled.numpy())
            big = VisionTransformer(**{**config, "img_size": 48}).eval()
            state48 = dict(model.state_dict(), pos_embed=resampled)
            big.load_state_dict(state48)
            inputs48 = rng.uniform(-1, 1, (2, 48, 48, 3)).astype("float32")
            with torch.no_grad():
                logits48 = big(torch.from_numpy(inputs48).permute(0, 3, 1, 2)).numpy()
            np.save(os.path.join(DATA, "timm_resample_inputs.npy"), inputs48)
            np.save(os.path.join(DATA, "timm_resample_logits.npy"), logits48.astype("float32"))
    manifest["dynamic"] = write_dynamic()
    with open(os.path.join(DATA, "timm_fixtures.json"), "w") as file:
        json.dump(
            {"timm": timm.__version__, "torch": torch.__version__, "configs": manifest},
            file,
            indent=1,
        )
        file.write("\n")


# Input sizes (height, width) of the dynamic fixture: larger, smaller, the
# model's own, non-square, and a single patch.
DYNAMIC_SIZES = [(48, 40), (16, 24), (32, 32), (24, 56), (8, 8)]


def write_dynamic():
    """timm_dynamic.npz from timm_square.safetensors; returns the timm config."""
    config = {**BASE, **CONFIGS["square"], "dynamic_img_size": True}
    model = VisionTransformer(**config).eval()
    model.load_state_dict(load_file(os.path.join(DATA, "timm_square.safetensors")))
    rng = np.random.default_rng(100)
    arrays = {}
    for height, width in DYNAMIC_SIZES:
        inputs = rng.uniform(-1, 1, (2, height, width, 3)).astype("float32")
        with torch.no_grad():
            logits = model(torch.from_numpy(inputs).permute(0, 3, 1, 2)).numpy()
        arrays[f"inputs_{height}x{width}"] = inputs
        arrays[f"logits_{height}x{width}"] = logits.astype("float32")
    np.savez(os.path.join(DATA, "timm_dynamic.npz"), **arrays)
    return config


if __name__ == "__main__":
    main()
