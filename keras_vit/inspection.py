"""Looking inside a ViT: attention maps, attention rollout, intermediate features.

Everything here reuses the layers (and so the weights) of the model it is
given: nothing is copied or retrained, and it works on any model built by
keras_vit, including one loaded from a `.keras` file, gap models and hybrids.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_vit.layers import PatchEncoder, TransformerBlock
from keras_vit.layers.patches import PatchGrid

HEAD_FUSIONS = ("mean", "max", "min")


def transformer_blocks(model):
    """The model's TransformerBlock layers, in order; ValueError if none."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: {type(model).__name__}")
    blocks = [layer for layer in model.layers if isinstance(layer, TransformerBlock)]
    if not blocks:
        raise ValueError(
            "`model` must be a ViT built by keras_vit (it has no TransformerBlock layers). "
            f"Received: model {model.name!r} with layers {[layer.name for layer in model.layers][:8]}"
        )
    return blocks


def patch_encoder(model):
    """The model's PatchEncoder layer; ValueError if it has none."""
    encoders = [layer for layer in model.layers if isinstance(layer, PatchEncoder)]
    if len(encoders) != 1:
        raise ValueError(
            "`model` must be a ViT built by keras_vit with one PatchEncoder layer. "
            f"Received: model {model.name!r}"
        )
    return encoders[0]


def _check_images(model, images):
    images = np.asarray(images) if not hasattr(images, "shape") else images
    expected = tuple(model.input_shape[1:])
    if len(images.shape) != 4 or tuple(images.shape[1:]) != expected:
        raise ValueError(
            f"`images` must be a batch of shape (batch, {', '.join(map(str, expected))}), "
            f"preprocessed to [-1, 1]. Received: images.shape={tuple(images.shape)}"
        )
    return ops.convert_to_tensor(images, dtype="float32")


def attention_maps(model, images, batch_size=32):
    """The attention weights of every transformer block, computed exactly.

    The token inputs of each block are taken from the model itself, then the
    block's own first LayerNorm and attention projections give the softmax
    weights, so the result is exact whatever kernel the model's fast path
    uses.

    Args:
        model: a ViT built by keras_vit.
        images: (batch, height, width, channels) images in [-1, 1], at the
            model's input size.
        batch_size: images per forward pass.

    Returns:
        A list with one float32 NumPy array per block, each of shape
        (batch, heads, tokens, tokens); every row sums to 1.

    Example:
    >>> import numpy as np, keras_vit
    >>> model = keras_vit.VisionTransformer(image_size=32, patch_size=8,
    ...     num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=3)
    >>> [m.shape for m in attention_maps(model, np.zeros((1, 32, 32, 3)))]
    [(1, 2, 17, 17), (1, 2, 17, 17)]
    """
    blocks = transformer_blocks(model)
    images = _check_images(model, images)
    block_inputs = keras.Model(model.inputs, [block.input for block in blocks])
    per_batch = []
    for start in range(0, images.shape[0], batch_size):
        tokens = block_inputs(images[start : start + batch_size], training=False)
        tokens = tokens if isinstance(tokens, (list, tuple)) else [tokens]
        per_batch.append(
            [
                ops.convert_to_numpy(block.attention.attention_weights(block.norm1(x)))
                for block, x in zip(blocks, tokens)
            ]
        )
    return [np.concatenate(layer, axis=0).astype("float32") for layer in zip(*per_batch)]


def _grid_and_prefix(num_tokens, grid_size):
    if grid_size is not None:
        grid_size = tuple(int(g) for g in grid_size)
        prefix = num_tokens - grid_size[0] * grid_size[1]
        if prefix < 0:
            raise ValueError(
                f"`grid_size` {grid_size} has more patches than the maps have tokens "
                f"({num_tokens})."
            )
        return grid_size, prefix
    for prefix in (0, 1):
        side = math.isqrt(num_tokens - prefix)
        if side * side == num_tokens - prefix:
            return (side, side), prefix
    raise ValueError(
        f"Cannot infer a square patch grid from {num_tokens} tokens; pass `grid_size`."
    )


def attention_rollout(maps, discard_ratio=0.0, head_fusion="mean", grid_size=None):
    """Attention rollout (Abnar & Zuidema, 2020) through all the layers.

    Per layer the heads are fused (mean, max or min), optionally the lowest
    `discard_ratio` of the weights are set to zero (never a token's attention
    to itself), the identity is added for the residual connection, each row
    is renormalised to sum to 1, and the layers are multiplied through from
    the first to the last.

    Args:
        maps: the per-layer (batch, heads, tokens, tokens) attention weights
            of `attention_maps`.
        discard_ratio: fraction in [0, 1) of the weights of each map to drop.
        head_fusion: "mean", "max" or "min" over the heads.
        grid_size: (h, w) of the patch grid; inferred from the token count
            when the grid is square.

    Returns:
        A (batch, h, w) float32 array: for models with a class token, how much
        the class token draws on each patch; for gap models, the mean over
        all tokens.
    """
    if isinstance(head_fusion, str) and head_fusion in HEAD_FUSIONS:
        fuse = getattr(np, head_fusion)
    else:
        raise ValueError(
            f"`head_fusion` must be one of {HEAD_FUSIONS}. Received: head_fusion={head_fusion!r}"
        )
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(
            f"`discard_ratio` must be in [0, 1). Received: discard_ratio={discard_ratio}"
        )
    maps = [np.asarray(m, dtype="float64") for m in maps]
    if not maps or any(m.ndim != 4 or m.shape[-1] != m.shape[-2] for m in maps):
        raise ValueError(
            "`maps` must be a non-empty list of (batch, heads, tokens, tokens) arrays. "
            f"Received shapes: {[np.shape(m) for m in maps]}"
        )
    batch, _, num_tokens, _ = maps[0].shape
    (grid_h, grid_w), prefix = _grid_and_prefix(num_tokens, grid_size)
    identity = np.eye(num_tokens)
    rollout = np.broadcast_to(identity, (batch, num_tokens, num_tokens)).copy()
    for layer_maps in maps:
        fused = fuse(layer_maps, axis=1)
        if discard_ratio > 0:
            flat = fused.reshape(batch, -1).copy()
            count = int(flat.shape[1] * discard_ratio)
            lowest = np.argsort(flat, axis=1)[:, :count]
            keep_diagonal = (lowest % (num_tokens + 1)) == 0
            for b in range(batch):
                flat[b, lowest[b][~keep_diagonal[b]]] = 0.0
            fused = flat.reshape(fused.shape)
        attention = fused + identity
        attention = attention / attention.sum(axis=-1, keepdims=True)
        rollout = attention @ rollout
    if prefix:
        result = rollout[:, 0, prefix:]
    else:
        result = rollout.mean(axis=1)
    return result.reshape(batch, grid_h, grid_w).astype("float32")


def _block_index(blocks, layer):
    names = [block.name for block in blocks]
    if isinstance(layer, str):
        if layer not in names:
            raise ValueError(f"`layers`: no block named {layer!r}. The blocks are {names}")
        return names.index(layer)
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"`layers` must hold block indices or names. Received: {layer!r}")
    if not -len(blocks) <= layer < len(blocks):
        raise ValueError(
            f"`layers`: block index {layer} is out of range for a model with {len(blocks)} blocks."
        )
    return int(layer) % len(blocks)


def feature_extractor(model, layers=None, patch_grid=False, name=None):
    """A model returning the token outputs of chosen transformer blocks.

    It shares the layers (and weights) of `model`.

    Args:
        model: a ViT built by keras_vit.
        layers: None for every block, or a list of block indices (negative
            counts from the end) or block names such as
            "transformer_block_3". A single int or name gives one output.
        patch_grid: False for the (batch, tokens, D) token sequence; True for
            the patch tokens only (class token dropped) as a
            (batch, h, w, D) grid, the input detection and segmentation heads
            expect.
        name: name of the new model.

    Returns:
        A functional `keras.Model` with one output per chosen block (a single
        output when `layers` is one int or name).
    """
    blocks = transformer_blocks(model)
    single = layers is not None and not isinstance(layers, (list, tuple))
    chosen = range(len(blocks)) if layers is None else [layers] if single else layers
    indices = [_block_index(blocks, layer) for layer in chosen]
    if not indices:
        raise ValueError("`layers` must name at least one block. Received: layers=[]")
    outputs = [blocks[i].output for i in indices]
    if patch_grid:
        encoder = patch_encoder(model)
        grid = PatchGrid(encoder.grid_size, encoder.num_prefix_tokens, name=None)
        outputs = [grid(x) for x in outputs]
    return keras.Model(
        model.inputs, outputs[0] if single else outputs, name=name or f"{model.name}_features"
    )


def mean_attention_distance(model, images, maps=None):
    """Mean attention distance in pixels, per layer and head (ViT paper, Fig. 7).

    For each patch query, the attention-weighted mean of its distance to
    every patch key (patch centres, in pixels of the input image; weights
    renormalised over the patch keys), averaged over queries and images.

    Returns:
        A (layers, heads) float32 array.
    """
    encoder = patch_encoder(model)
    grid_h, grid_w = encoder.grid_size
    if maps is None:
        maps = attention_maps(model, images)
    prefix = encoder.num_prefix_tokens
    # Pixel size of one patch step on the input image (hybrids: the stem's stride).
    pixels_h = model.input_shape[1] / grid_h
    pixels_w = model.input_shape[2] / grid_w
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    centres = np.stack([rows.ravel() * pixels_h, cols.ravel() * pixels_w], axis=-1)
    distance = np.linalg.norm(centres[:, None] - centres[None], axis=-1)
    result = []
    for layer_maps in maps:
        patches = np.asarray(layer_maps, "float64")[:, :, prefix:, prefix:]
        patches = patches / patches.sum(axis=-1, keepdims=True)
        result.append((patches * distance).sum(-1).mean(axis=(0, 2)))
    return np.asarray(result, dtype="float32")


def position_embedding_similarity(model):
    """Cosine similarity of each patch position's embedding with all others.

    Returns:
        A (h, w, h, w) float32 array: [i, j] is the similarity map of the
        position (i, j) with every position.
    """
    encoder = patch_encoder(model)
    grid_h, grid_w = encoder.grid_size
    embedding = ops.convert_to_numpy(encoder.position_embedding)[0, encoder.num_prefix_tokens :]
    unit = embedding / np.linalg.norm(embedding, axis=-1, keepdims=True)
    return (unit @ unit.T).reshape(grid_h, grid_w, grid_h, grid_w).astype("float32")
