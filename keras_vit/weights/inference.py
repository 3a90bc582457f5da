"""The architecture of a checkpoint, read from its tensor shapes."""

import numpy as np

from keras_vit.layers._checks import as_pair, positive_int
from keras_vit.weights.readers import detect_format, read_checkpoint

# (patch kernel, class token, position embedding, block pattern, fc1 weight,
#  pre-logits weight, head weight, whether torch (out, in) layouts)
_KEYS = {
    "original": (
        "embedding/kernel",
        "cls",
        "Transformer/posembed_input/pos_embedding",
        "Transformer/encoderblock_{}/",
        None,
        "pre_logits/kernel",
        "head/kernel",
        False,
    ),
    "timm": (
        "patch_embed.proj.weight",
        "cls_token",
        "pos_embed",
        "blocks.{}.",
        "blocks.0.mlp.fc1.weight",
        "pre_logits.fc.weight",
        "head.weight",
        True,
    ),
    "hf": (
        "embeddings.patch_embeddings.projection.weight",
        "embeddings.cls_token",
        "embeddings.position_embeddings",
        "encoder.layer.{}.",
        "encoder.layer.0.intermediate.dense.weight",
        "pooler.dense.weight",
        "classifier.weight",
        True,
    ),
}


# The heads of the published ViTs whose head size is not 64, by width: ViT-H/14 (16
# heads of 80), ViT-g/14 (16 of 88) and ViT-G/14 (16 of 104).
PUBLISHED_HEADS = {1280: 16, 1408: 16, 1664: 16}


def infer_config(path, num_heads=None, image_size=None):
    """`VisionTransformer` keyword arguments matching a checkpoint file.

    Everything is read from the shapes except the number of heads of a timm
    or Hugging Face file, which do not store it: `num_heads` then defaults
    to the published count for the width (`PUBLISHED_HEADS`: 16 heads at
    1280, 1408 and 1664, as in ViT-H/14, ViT-g/14 and ViT-G/14) and to
    hidden_dim / 64 at any other (true of ViT-Ti, S, B and L). The image
    size is the checkpoint's square grid times the patch size unless
    `image_size` is given.

    Returns:
        A dict: image_size, patch_size, num_layers, num_heads, hidden_dim,
        mlp_dim, num_classes, pooling, representation_size, num_channels.
    """
    if num_heads is not None:
        num_heads = positive_int("num_heads", num_heads)
    if image_size is not None:
        image_size = as_pair("image_size", image_size)
    params = read_checkpoint(path)
    layout = detect_format(params)
    patch, cls, pos, block, fc1, pre, head, torch_layout = _KEYS[layout]
    if layout == "hf" and any(k.startswith("vit.") for k in params):
        patch, cls, pos, block, fc1, pre = (
            "vit." + key for key in (patch, cls, pos, block, fc1, pre)
        )
    if layout == "original" and pos not in params:
        pos = "pos_embedding"
    if "conv_root/kernel" in params:
        raise ValueError(f"{path} is a hybrid checkpoint; build ViT_R50_B16 for it instead.")
    kernel = params[patch]
    if torch_layout:
        hidden_dim, num_channels, ph, pw = kernel.shape
    else:
        ph, pw, num_channels, hidden_dim = kernel.shape
    num_layers = 0
    while any(key.startswith(block.format(num_layers)) for key in params):
        num_layers += 1
    if layout == "original":
        query = next(
            key
            for key in params
            if key.startswith(block.format(0)) and key.endswith("query/kernel")
        )
        heads = params[query].shape[1]
        dense = next(
            key
            for key in params
            if key.startswith(block.format(0)) and key.endswith("Dense_0/kernel")
        )
        mlp_dim = params[dense].shape[1]
    else:
        heads = PUBLISHED_HEADS.get(int(hidden_dim))
        if heads is None and hidden_dim % 64 == 0:
            heads = hidden_dim // 64
        mlp_dim = params[fc1].shape[0]
    if num_heads is not None:
        heads = num_heads
    if heads is not None and hidden_dim % heads:
        raise ValueError(
            f"`num_heads` must divide the checkpoint's width hidden_dim={hidden_dim}. "
            f"Received: num_heads={heads}"
        )
    if heads is None:
        raise ValueError(
            f"The number of heads of {path} cannot be read from it; pass `num_heads`. "
            f"Received: num_heads=None (hidden_dim={hidden_dim})"
        )
    pooling = "token" if cls in params else "gap"
    num_grid = params[pos].shape[1] - (1 if pooling == "token" else 0)
    if image_size is None:
        side = int(round(np.sqrt(num_grid)))
        if side * side != num_grid:
            raise ValueError(
                f"{path} has a non-square grid of {num_grid} patches; pass `image_size`. "
                "Received: image_size=None"
            )
        image_size = (side * ph, side * pw)
    num_classes = 0
    if head in params:
        num_classes = params[head].shape[0 if torch_layout else 1]
    representation_size = None
    if pre in params:
        representation_size = params[pre].shape[0 if torch_layout else 1]
    return dict(
        image_size=image_size,
        patch_size=(int(ph), int(pw)),
        num_layers=num_layers,
        num_heads=int(heads),
        hidden_dim=int(hidden_dim),
        mlp_dim=int(mlp_dim),
        num_classes=int(num_classes),
        pooling=pooling,
        representation_size=None if representation_size is None else int(representation_size),
        num_channels=int(num_channels),
    )
