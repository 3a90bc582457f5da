"""Presets: the public checkpoints of google-research/vision_transformer, as data.

name -> url, constructor (a `keras_vit.ViT_*` name), image_size, num_classes,
representation_size, sha256 (None when not recorded: the file is then not
verified). The files live on the public bucket gs://vit_models.
"""

_BASE = "https://storage.googleapis.com/vit_models"

PRESETS = {
    # ImageNet-21k pre-training (with the pre-logits layer), 224.
    "ViT-B_16": dict(
        url=f"{_BASE}/imagenet21k/ViT-B_16.npz",
        constructor="ViT_B16",
        image_size=224,
        num_classes=21843,
        representation_size=768,
        sha256=None,
    ),
    "ViT-B_32": dict(
        url=f"{_BASE}/imagenet21k/ViT-B_32.npz",
        constructor="ViT_B32",
        image_size=224,
        num_classes=21843,
        representation_size=768,
        sha256=None,
    ),
    "ViT-L_16": dict(
        url=f"{_BASE}/imagenet21k/ViT-L_16.npz",
        constructor="ViT_L16",
        image_size=224,
        num_classes=21843,
        representation_size=1024,
        sha256=None,
    ),
    "ViT-L_32": dict(
        url=f"{_BASE}/imagenet21k/ViT-L_32.npz",
        constructor="ViT_L32",
        image_size=224,
        num_classes=21843,
        representation_size=1024,
        sha256=None,
    ),
    "ViT-H_14": dict(
        url=f"{_BASE}/imagenet21k/ViT-H_14.npz",
        constructor="ViT_H14",
        image_size=224,
        num_classes=21843,
        representation_size=1280,
        sha256=None,
    ),
    "R50+ViT-B_16": dict(
        url=f"{_BASE}/imagenet21k/R50+ViT-B_16.npz",
        constructor="ViT_R50_B16",
        image_size=224,
        num_classes=21843,
        representation_size=768,
        sha256=None,
    ),
    # ImageNet-21k pre-training, fine-tuned on ImageNet-1k at 384 (no pre-logits).
    "ViT-B_16-384": dict(
        url=f"{_BASE}/imagenet21k+imagenet2012/ViT-B_16.npz",
        constructor="ViT_B16",
        image_size=384,
        num_classes=1000,
        representation_size=None,
        sha256=None,
    ),
    "ViT-B_32-384": dict(
        url=f"{_BASE}/imagenet21k+imagenet2012/ViT-B_32.npz",
        constructor="ViT_B32",
        image_size=384,
        num_classes=1000,
        representation_size=None,
        sha256=None,
    ),
    "ViT-L_16-384": dict(
        url=f"{_BASE}/imagenet21k+imagenet2012/ViT-L_16.npz",
        constructor="ViT_L16",
        image_size=384,
        num_classes=1000,
        representation_size=None,
        sha256=None,
    ),
    "ViT-L_32-384": dict(
        url=f"{_BASE}/imagenet21k+imagenet2012/ViT-L_32.npz",
        constructor="ViT_L32",
        image_size=384,
        num_classes=1000,
        representation_size=None,
        sha256=None,
    ),
    "R50+ViT-B_16-384": dict(
        url=f"{_BASE}/imagenet21k+imagenet2012/R50+ViT-B_16.npz",
        constructor="ViT_R50_B16",
        image_size=384,
        num_classes=1000,
        representation_size=None,
        sha256=None,
    ),
    # The same fine-tuned at 224.
    "ViT-B_16-224": dict(
        url=f"{_BASE}/imagenet21k+imagenet2012/ViT-B_16-224.npz",
        constructor="ViT_B16",
        image_size=224,
        num_classes=1000,
        representation_size=None,
        sha256=None,
    ),
    "ViT-L_16-224": dict(
        url=f"{_BASE}/imagenet21k+imagenet2012/ViT-L_16-224.npz",
        constructor="ViT_L16",
        image_size=224,
        num_classes=1000,
        representation_size=None,
        sha256=None,
    ),
}

# AugReg ("How to train your ViT?"): the recommended checkpoints per model,
# ImageNet-21k pre-training and its ImageNet-1k fine-tuning at 224.
_AUGREG = {
    "Ti_16": ("ViT_Ti16", "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0"),
    "S_16": ("ViT_S16", "S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0"),
    "S_32": ("ViT_S32", "S_32-i21k-300ep-lr_0.001-aug_none-wd_0.1-do_0.0-sd_0.0"),
    "B_16": ("ViT_B16", "B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0"),
    "B_32": ("ViT_B32", "B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0"),
    "L_16": ("ViT_L16", "L_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1"),
}
for _short, (_constructor, _stem) in _AUGREG.items():
    PRESETS[f"augreg_in21k_{_short}"] = dict(
        url=f"{_BASE}/augreg/{_stem}.npz",
        constructor=_constructor,
        image_size=224,
        num_classes=21843,
        representation_size=None,
        sha256=None,
    )
    PRESETS[f"augreg_in21k_ft_in1k_{_short}"] = dict(
        url=f"{_BASE}/augreg/{_stem}--imagenet2012-steps_20k-lr_0.01-res_224.npz",
        constructor=_constructor,
        image_size=224,
        num_classes=1000,
        representation_size=None,
        sha256=None,
    )
