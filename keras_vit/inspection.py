"""Looking inside a ViT: attention maps, attention rollout, intermediate features.

Everything here reuses the layers (and so the weights) of the model it is
given: nothing is copied or retrained, and it works on any model built by
keras_vit, including one loaded from a `.keras` file, gap models and hybrids.
"""

import math
import numbers

import keras
import numpy as np
from keras import ops

from keras_vit.layers import PatchEncoder, TransformerBlock
from keras_vit.layers._checks import boolean, positive_int
from keras_vit.layers.patches import PatchGrid
from keras_vit.models import _grid_stride, _takes_any_size

HEAD_FUSIONS = ("mean", "max", "min")
# Images scaled to [-1, 1] stay within it; beyond this bound they were not scaled.
SCALED_BOUND = 1.5


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model built by keras_vit. "
            f"Received: model={model!r} of type {type(model).__name__}"
        )


def transformer_blocks(model):
    """The model's TransformerBlock layers, in order; ValueError if none."""
    _check_model(model)
    blocks = [layer for layer in model.layers if isinstance(layer, TransformerBlock)]
    if not blocks:
        raise ValueError(
            "`model` must be a ViT built by keras_vit (it has no TransformerBlock layers). "
            f"Received: model {model.name!r} with layers {[layer.name for layer in model.layers][:8]}"
        )
    return blocks


def patch_encoder(model):
    """The model's PatchEncoder layer; ValueError if it has none."""
    _check_model(model)
    encoders = [layer for layer in model.layers if isinstance(layer, PatchEncoder)]
    if len(encoders) != 1:
        raise ValueError(
            "`model` must be a ViT built by keras_vit with one PatchEncoder layer. "
            f"Received: model {model.name!r}"
        )
    return encoders[0]


def _model_input(model):
    """The model's input tensor (a list only for a multi-input model)."""
    return model.inputs[0] if len(model.inputs) == 1 else model.inputs


def _stride(model):
    """Input pixels per patch-grid step, (rows, columns)."""
    patch_encoder(model)  # the clear error for a model that is not a ViT
    return _grid_stride(model)


def _image_grid(model, image_shape):
    """The patch grid a batch of `image_shape` (batch, H, W, C) gives in `model`.

    A model of a fixed size takes only its own size. A model built with
    `dynamic_image_size=True` takes any height and width that are positive
    multiples of its stride.
    """
    expected = tuple(model.input_shape[1:])
    shape = tuple(image_shape)
    one_image = " (one image? add a batch axis: images[None])" if len(shape) == 3 else ""
    if not _takes_any_size(model):
        if len(shape) != 4 or shape[1:] != expected:
            raise ValueError(
                f"`images` must be a batch of shape (batch, {', '.join(map(str, expected))}), "
                f"preprocessed to [-1, 1]. Received: images.shape={shape}{one_image}"
            )
        return tuple(patch_encoder(model).grid_size)
    stride = _stride(model)
    if (
        len(shape) != 4
        or shape[3] != expected[2]
        or any(side < step or side % step for side, step in zip(shape[1:3], stride))
    ):
        raise ValueError(
            "`images` must be a batch of shape (batch, height, width, "
            f"{expected[2]}) whose height and width are positive multiples of {stride} "
            "(this model takes any such size), preprocessed to [-1, 1]. "
            f"Received: images.shape={shape}{one_image}"
        )
    return tuple(side // step for side, step in zip(shape[1:3], stride))


def check_scaled(name, images):
    """Raise a ValueError unless `images` look scaled to [-1, 1].

    uint8 images are refused; so are concrete values beyond +-1.5 (pixels of
    0..255 that were not scaled). A symbolic tensor is not checked.
    """
    try:
        dtype = keras.backend.standardize_dtype(images.dtype)
    except (TypeError, ValueError):
        dtype = str(images.dtype)
    hint = f"scale 0..255 pixels with keras_vit.preprocess_inputs({name})"
    if dtype == "uint8":
        raise ValueError(
            f"`{name}` must be float images scaled to [-1, 1]; {hint}. "
            f"Received: uint8 {name} of shape {tuple(images.shape)}"
        )
    try:
        values = images if isinstance(images, np.ndarray) else ops.convert_to_numpy(images)
    except (TypeError, ValueError, NotImplementedError):  # symbolic: no values to check
        return
    if values.size == 0 or not np.issubdtype(values.dtype, np.number):
        return
    if not np.all(np.isfinite(values)):
        raise ValueError(
            f"`{name}` must hold finite values (images scaled to [-1, 1]). "
            f"Received: {name} with {int(np.size(values) - np.isfinite(values).sum())} "
            "NaN or infinite values"
        )
    low, high = float(np.min(values)), float(np.max(values))
    if high > SCALED_BOUND or low < -SCALED_BOUND:
        raise ValueError(
            f"`{name}` must be images scaled to [-1, 1]; {hint}. "
            f"Received: {name} with values in [{low:g}, {high:g}]"
        )


def _check_images(model, images):
    original = images
    if not hasattr(images, "shape") or not hasattr(images, "dtype"):
        try:  # nested lists of numbers
            images = np.asarray(images)
        except (TypeError, ValueError):  # ragged
            images = None
    try:
        dtype = keras.backend.standardize_dtype(images.dtype)
    except (AttributeError, TypeError, ValueError):
        dtype = None
    if dtype is None or dtype == "bool" or not dtype.startswith(("float", "int", "uint")):
        received = f"{type(original).__name__}" + (f" of dtype {dtype}" if dtype else "")
        raise TypeError(
            "`images` must be a (batch, height, width, channels) array of float images "
            f"scaled to [-1, 1]. Received: images of type {received}"
        )
    _image_grid(model, images.shape)
    if images.shape[0] == 0:
        raise ValueError(
            f"`images` must hold at least one image. Received: images.shape={tuple(images.shape)}"
        )
    check_scaled("images", images)
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
            model's input size; for a model built with
            `dynamic_image_size=True`, at any size it takes (sides multiple
            of the patch size), all images of one call at the same size.
            uint8 images and values beyond +-1.5 are refused (a ValueError):
            `keras_vit.preprocess_inputs` scales 0..255 pixels.
        batch_size: images per forward pass.

    Returns:
        A list with one float32 NumPy array per block, each of shape
        (batch, heads, tokens, tokens); every row sums to 1.

    Example:
    >>> import numpy as np, keras_vit
    >>> model = keras_vit.VisionTransformer(image_size=32, patch_size=8,
    ...     num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=3)
    >>> [m.shape for m in keras_vit.attention_maps(model, np.zeros((1, 32, 32, 3)))]
    [(1, 2, 17, 17), (1, 2, 17, 17)]
    """
    blocks = transformer_blocks(model)
    images = _check_images(model, images)
    batch_size = positive_int("batch_size", batch_size)
    block_inputs = keras.Model(_model_input(model), [block.input for block in blocks])
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


# Rows of softmax weights sum to 1; this leaves room for bfloat16 maps.
ROW_SUM_TOLERANCE = 1e-2


def _check_weights(maps):
    """ValueError unless every (…, tokens, tokens) array of `maps` holds attention
    weights: finite, non-negative, each row summing to 1 (not logits, not scores)."""
    expected = (
        "`maps` must hold attention weights as keras_vit.attention_maps returns them "
        "(softmax outputs: finite, non-negative, each row summing to 1)"
    )
    for index, layer_maps in enumerate(maps):
        if not np.all(np.isfinite(layer_maps)):
            raise ValueError(f"{expected}. Received: NaN or infinite values in maps[{index}]")
        low = float(layer_maps.min())
        if low < 0:
            raise ValueError(f"{expected}. Received: maps[{index}] with values down to {low:g}")
        sums = layer_maps.sum(axis=-1)
        if np.any(np.abs(sums - 1.0) > ROW_SUM_TOLERANCE):
            raise ValueError(
                f"{expected}. Received: maps[{index}] with rows summing to "
                f"{float(sums.min()):g} .. {float(sums.max()):g}"
            )


def _grid_and_prefix(num_tokens, grid_size):
    if isinstance(grid_size, keras.Model):
        encoder = patch_encoder(grid_size)
        cells = encoder.grid_size[0] * encoder.grid_size[1]
        if _takes_any_size(grid_size) and num_tokens != encoder.num_prefix_tokens + cells:
            stride = _stride(grid_size)
            raise ValueError(
                f"The maps have {num_tokens} tokens and `grid_size` is a model that takes "
                "images of any size, so the grid cannot be read from it: pass "
                f"grid_size=(height // {stride[0]}, width // {stride[1]}) of the images."
            )
        grid_size = encoder.grid_size
    if grid_size is not None:
        try:
            grid_h, grid_w = grid_size
            if not all(
                isinstance(g, numbers.Integral) and not isinstance(g, bool) for g in grid_size
            ):
                raise TypeError
            grid_h, grid_w = int(grid_h), int(grid_w)
        except (TypeError, ValueError):
            raise ValueError(
                "`grid_size` must be (height, width) of the patch grid or a keras_vit model. "
                f"Received: grid_size={grid_size!r}"
            ) from None
        prefix = num_tokens - grid_h * grid_w
        if grid_h < 1 or grid_w < 1 or prefix not in (0, 1):
            raise ValueError(
                f"`grid_size` {(grid_h, grid_w)} does not fit maps of {num_tokens} tokens "
                "(expected h * w patches, plus 1 for a class token). "
                f"Received: grid_size={grid_size!r}"
            )
        return (grid_h, grid_w), prefix
    for prefix in (0, 1):
        side = math.isqrt(num_tokens - prefix)
        if side * side == num_tokens - prefix:
            return (side, side), prefix
    raise ValueError(
        f"Cannot infer a square patch grid from maps of {num_tokens} tokens; pass "
        "`grid_size=(h, w)` or `grid_size=model`. Received: grid_size=None"
    )


def attention_rollout(maps, discard_ratio=0.0, head_fusion="mean", grid_size=None):
    """Attention rollout (Abnar & Zuidema, 2020) through all the layers.

    Per layer: the heads are fused (mean, max or min); optionally the lowest
    `discard_ratio` of the fused weights of each image are set to zero,
    except the class token's attention to itself (as in the widely used
    vit-explain implementation, so that the class token row never goes
    empty); the identity is added for the residual connection; each row is
    renormalised to sum to 1 (the paper's 0.5 * A + 0.5 * I when no weight
    was discarded). The layers are then multiplied through, first to last:
    rollout = A_L @ ... @ A_1.

    Args:
        maps: the list of per-layer (batch, heads, tokens, tokens) attention
            weights that `attention_maps` returns (not the model). Weights
            that are negative, not finite, or whose rows do not sum to 1
            (logits, unnormalised scores) are refused with a ValueError.
        discard_ratio: fraction in [0, 1) of the weights of each map to drop.
        head_fusion: "mean", "max" or "min" over the heads.
        grid_size: (h, w) of the patch grid, or the keras_vit model the maps
            come from (for a `dynamic_image_size` model, only at the size it
            was built for); None infers a square grid from the token count (a
            class token is assumed when the count is a square plus one).
            Pass it for non-square grids.

    Returns:
        A (batch, h, w) float32 array, not rescaled: for models with a class
        token, the class token's row of the rollout over the patches; for gap
        models, the mean of all rows. Each row of the rollout sums to 1, so
        the values of one map sum to at most 1.

    Example:
    >>> import numpy as np, keras_vit
    >>> uniform = np.full((1, 2, 17, 17), 1 / 17)
    >>> keras_vit.attention_rollout([uniform, uniform]).shape
    (1, 4, 4)
    """
    if isinstance(head_fusion, str) and head_fusion in HEAD_FUSIONS:
        fuse = getattr(np, head_fusion)
    else:
        raise ValueError(
            f"`head_fusion` must be one of {HEAD_FUSIONS}. Received: head_fusion={head_fusion!r}"
        )
    if isinstance(discard_ratio, bool) or not isinstance(discard_ratio, (int, float, np.number)):
        raise ValueError(
            f"`discard_ratio` must be a number in [0, 1). Received: discard_ratio={discard_ratio!r}"
        )
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(
            f"`discard_ratio` must be in [0, 1). Received: discard_ratio={discard_ratio}"
        )
    if isinstance(maps, keras.Model):
        raise TypeError(
            "`maps` must be the list of per-block attention weights that "
            "keras_vit.attention_maps(model, images) returns, not a model. "
            f"Received: maps=<model {maps.name!r}>"
        )
    try:
        maps = [np.asarray(m, dtype="float64") for m in maps]
    except (TypeError, ValueError):
        raise TypeError(
            "`maps` must be a list of (batch, heads, tokens, tokens) arrays, as "
            "keras_vit.attention_maps returns. "
            f"Received: maps of type {type(maps).__name__}"
        ) from None
    if (
        not maps
        or any(m.ndim != 4 or m.shape[-1] != m.shape[-2] for m in maps)
        or any(m.shape[0] != maps[0].shape[0] or m.shape[-1] != maps[0].shape[-1] for m in maps)
    ):
        one_layer = " (one layer's maps? pass them in a list)" if maps and maps[0].ndim == 3 else ""
        raise ValueError(
            "`maps` must be a non-empty list of (batch, heads, tokens, tokens) arrays, "
            "the same batch and tokens in every layer. "
            f"Received shapes: {[np.shape(m) for m in maps]}{one_layer}"
        )
    _check_weights(maps)
    batch, _, num_tokens, _ = maps[0].shape
    (grid_h, grid_w), prefix = _grid_and_prefix(num_tokens, grid_size)
    identity = np.eye(num_tokens)
    rollout = np.broadcast_to(identity, (batch, num_tokens, num_tokens)).copy()
    for layer_maps in maps:
        fused = fuse(layer_maps, axis=1)
        if discard_ratio > 0:
            flat = fused.reshape(batch, -1).copy()
            count = int(flat.shape[1] * discard_ratio)
            lowest = np.argsort(flat, axis=1, kind="stable")[:, :count]
            for b in range(batch):
                # Flat index 0 is the class token's attention to itself: kept.
                flat[b, lowest[b][lowest[b] != 0] if prefix else lowest[b]] = 0.0
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
        raise TypeError(
            f"`layers` must hold block indices or names. Received: {layer!r} "
            f"of type {type(layer).__name__}"
        )
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
        layers: None for every block, or a list (tuple, range, 1-D array)
            of block indices (negative counts from the end) or block names such as
            "transformer_block_3". A single int or name gives one output.
        patch_grid: False for the (batch, tokens, D) token sequence; True (a
            bool: anything else is refused) for
            the patch tokens only (class token dropped) as a
            (batch, h, w, D) grid, the input detection and segmentation heads
            expect. Only for a model of a fixed image size: a
            `dynamic_image_size` model's grid changes with its input.
        name: name of the new model.

    Returns:
        A functional `keras.Model` with one output per chosen block, in the
        order given. With one block (an int, a name, or a list of one) it
        returns a single tensor: Keras unwraps one-output lists.

    Example:
    >>> import numpy as np, keras_vit
    >>> model = keras_vit.VisionTransformer(image_size=32, patch_size=8,
    ...     num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=3)
    >>> extractor = keras_vit.feature_extractor(model, layers=-1, patch_grid=True)
    >>> tuple(extractor(np.zeros((1, 32, 32, 3), "float32")).shape)
    (1, 4, 4, 16)
    """
    blocks = transformer_blocks(model)
    patch_grid = boolean("patch_grid", patch_grid)
    if (isinstance(layers, np.ndarray) and layers.ndim == 1) or isinstance(layers, range):
        layers = list(layers)
    elif isinstance(layers, (set, frozenset, dict)):
        raise TypeError(
            "`layers` must be a block index or name, or a list of them in the order "
            f"wanted (a {type(layers).__name__} has no order). Received: layers={layers!r}"
        )
    single = layers is not None and not isinstance(layers, (list, tuple))
    chosen = range(len(blocks)) if layers is None else [layers] if single else layers
    indices = [_block_index(blocks, layer) for layer in chosen]
    if not indices:
        raise ValueError("`layers` must name at least one block. Received: layers=[]")
    if len(set(indices)) != len(indices):
        raise ValueError(f"`layers` names a block twice. Received: layers={layers!r}")
    # A class-token model's last block computes the class token only; here it
    # is called again (same weights) for every token.
    outputs = [
        blocks[i](blocks[i].input, first_token_only=False)
        if blocks[i].first_token_only
        else blocks[i].output
        for i in indices
    ]
    if patch_grid:
        encoder = patch_encoder(model)
        if _takes_any_size(model):
            rows, columns = _stride(model)
            raise ValueError(
                "`patch_grid=True` needs a model of a fixed image size: this one takes any "
                "size, so its grid changes with the input. Use patch_grid=False and reshape "
                "the patch tokens (after the class token) to (batch, height // "
                f"{rows}, width // {columns}, D)."
            )
        grid = PatchGrid(encoder.grid_size, encoder.num_prefix_tokens, name=None)
        outputs = [grid(x) for x in outputs]
    return keras.Model(
        _model_input(model),
        outputs[0] if single else outputs,
        name=name or f"{model.name}_features",
    )


def mean_attention_distance(model, images, maps=None):
    """Mean attention distance in pixels, per layer and head (ViT paper, Fig. 7).

    For each patch query, the attention-weighted mean of its distance to
    every patch key, averaged over the queries and the images. Distances are
    between patch centres, in pixels of the input image (one grid step is the
    patch size; for hybrids, the stem's stride). The class token is left out
    as query and as key, and each query's weights are renormalised over the
    patch keys (implementations that do not renormalise count the attention
    to the class token as distance 0 and so report slightly less). A query
    with no weight on any patch is left out (NaN for a head of only such).

    Args:
        model: a ViT built by keras_vit.
        images: (batch, height, width, channels) images in [-1, 1]; unused
            when `maps` is given, except to tell the grid of a model built
            with `dynamic_image_size=True`.
        maps: the `attention_maps` of `model` for the images, to reuse;
            checked as `attention_rollout` checks them.

    Returns:
        A (layers, heads) float32 array.
    """
    encoder = patch_encoder(model)
    if images is None and maps is None:
        raise ValueError("`images` must be given when `maps` is not. Received: images=None")
    stride_h, stride_w = _stride(model)
    if not _takes_any_size(model):
        if images is not None:  # unused with `maps`, but not to be of another model
            _image_grid(model, np.shape(images))
        grid_h, grid_w = encoder.grid_size
    elif images is not None:
        grid_h, grid_w = _image_grid(model, np.shape(images))
    else:
        # No images: a square grid, from the token count.
        cells = (
            np.shape(maps[0])[-1] - encoder.num_prefix_tokens
            if maps is not None and len(maps)
            else 0
        )
        grid_h = grid_w = math.isqrt(max(cells, 0))
        if cells < 1 or grid_h * grid_w != cells:
            raise ValueError(
                "This model takes images of any size: pass `images` (their size gives the "
                "grid) with `maps` that are not of a square grid."
            )
    if maps is None:
        maps = attention_maps(model, images)
    prefix = encoder.num_prefix_tokens
    num_tokens = prefix + grid_h * grid_w
    shapes = [np.shape(m) for m in maps]
    if not shapes or any(len(s) != 4 or s[-2:] != (num_tokens, num_tokens) for s in shapes):
        raise ValueError(
            f"`maps` must be (batch, heads, {num_tokens}, {num_tokens}) arrays for this model. "
            f"Received shapes: {shapes}"
        )
    maps = [np.asarray(layer_maps, "float64") for layer_maps in maps]
    _check_weights(maps)
    # Pixel size of one patch step on the input image (hybrids: the stem's stride).
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    centres = np.stack([rows.ravel() * stride_h, cols.ravel() * stride_w], axis=-1)
    distance = np.linalg.norm(centres[:, None] - centres[None], axis=-1)
    result = []
    for layer_maps in maps:
        patches = layer_maps[:, :, prefix:, prefix:]
        # A query that gives the patches no weight at all (all on the class token) has
        # no distance: it is left out of the mean (a head of only such queries: NaN).
        mass = patches.sum(axis=-1)
        attends = mass > 0
        per_query = (patches * distance).sum(-1) / np.where(attends, mass, 1.0)
        counts = attends.sum(axis=(0, 2))
        total = np.where(attends, per_query, 0.0).sum(axis=(0, 2))
        result.append(np.where(counts > 0, total / np.maximum(counts, 1), np.nan))
    return np.asarray(result, dtype="float32")


def position_embedding_similarity(model):
    """Cosine similarity of each patch position's embedding with all others.

    The class token's embedding is left out (ViT paper, Figure 7 centre).

    Args:
        model: a ViT built by keras_vit.

    Returns:
        A (h, w, h, w) float32 array: [i, j] is the similarity map of the
        position (i, j) with every position.
    """
    encoder = patch_encoder(model)
    grid_h, grid_w = encoder.grid_size
    embedding = ops.convert_to_numpy(encoder.position_embedding)[0, encoder.num_prefix_tokens :]
    unit = embedding / np.linalg.norm(embedding, axis=-1, keepdims=True)
    return (unit @ unit.T).reshape(grid_h, grid_w, grid_h, grid_w).astype("float32")
