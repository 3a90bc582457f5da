"""Resizing the position embedding of a checkpoint to another patch grid."""

import numpy as np

from keras_vit.layers._checks import as_pair, non_negative_int

METHODS = ("align_corners", "half_pixel")


def _linear_weights(source, target, method):
    """(index_low, index_high, fraction) of a 1-D linear resize source -> target."""
    out = np.arange(target, dtype="float64")
    if method == "align_corners":
        # scipy.ndimage.zoom(order=1), as the original vit_jax code: the end
        # points of both grids coincide.
        coords = out * (source - 1) / (target - 1) if target > 1 else np.zeros(1)
    else:
        # torch F.interpolate(align_corners=False) / jax.image.resize: pixel centres.
        coords = np.clip((out + 0.5) * source / target - 0.5, 0, source - 1)
    low = np.clip(np.floor(coords).astype(int), 0, source - 1)
    high = np.minimum(low + 1, source - 1)
    return low, high, coords - low


def resize_position_embedding(
    posemb, source_grid, target_grid, num_prefix_tokens=1, method="align_corners"
):
    """Resize a (1, prefix + gh * gw, D) position embedding to a new 2-D grid.

    The prefix (class token) positions are kept as they are; the grid part is
    reshaped to (gh, gw, D) and resized bilinearly, one axis after the other.

    Two conventions are offered because the references differ:
    "align_corners" (the default) is `scipy.ndimage.zoom(order=1)`, what the
    original google-research/vision_transformer code does when it loads a
    checkpoint at a new size; "half_pixel" is timm's
    `resample_abs_pos_embed(interpolation="bilinear", antialias=False)`
    (`F.interpolate(..., align_corners=False)`). When the grids are equal the
    embedding is returned unchanged.

    Args:
        posemb: array of shape (1, num_prefix_tokens + gh * gw, D) (or without
            the leading 1).
        source_grid: (gh, gw) of `posemb` (an int for a square grid), or None
            for a square grid inferred from the number of tokens.
        target_grid: (height, width) of the new grid (an int for a square one).
        num_prefix_tokens: leading tokens not on the grid (1 for a class
            token, 0 for "gap" models).
        method: "align_corners" or "half_pixel".

    Returns:
        A float32 numpy array of shape (1, num_prefix_tokens + h * w, D).

    Example:
    >>> import numpy as np
    >>> resize_position_embedding(np.zeros((1, 17, 8)), (4, 4), (6, 6)).shape
    (1, 37, 8)
    """
    posemb = np.asarray(posemb)
    if posemb.ndim == 2:
        posemb = posemb[None]
    if posemb.ndim != 3 or posemb.shape[0] != 1:
        raise ValueError(
            "`posemb` must have shape (1, tokens, dim). "
            f"Received: posemb.shape={tuple(posemb.shape)}"
        )
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}. Received: method={method!r}")
    target_grid = as_pair("target_grid", target_grid)
    if source_grid is not None:
        source_grid = as_pair("source_grid", source_grid)
    num_prefix_tokens = non_negative_int("num_prefix_tokens", num_prefix_tokens)
    if num_prefix_tokens >= posemb.shape[1]:
        raise ValueError(
            f"`num_prefix_tokens` must leave grid tokens in `posemb` ({posemb.shape[1]} tokens). "
            f"Received: num_prefix_tokens={num_prefix_tokens}"
        )
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[0, num_prefix_tokens:]
    num_grid = grid.shape[0]
    if source_grid is None:
        side = int(round(np.sqrt(num_grid)))
        if side * side != num_grid:
            raise ValueError(
                f"The position embedding has {num_grid} grid tokens, not a square number; "
                "pass the grid explicitly. Received: source_grid=None"
            )
        source_grid = (side, side)
    if source_grid[0] * source_grid[1] != num_grid:
        raise ValueError(
            f"`source_grid` must cover the {num_grid} grid tokens of `posemb`. "
            f"Received: source_grid={source_grid}"
        )
    if source_grid == target_grid:
        return posemb.astype("float32")
    dtype = posemb.dtype
    grid = grid.reshape(*source_grid, -1).astype("float64")
    for axis in (0, 1):
        low, high, fraction = _linear_weights(source_grid[axis], target_grid[axis], method)
        shape = [1, 1, 1]
        shape[axis] = -1
        fraction = fraction.reshape(shape)
        grid = np.take(grid, low, axis) * (1 - fraction) + np.take(grid, high, axis) * fraction
    grid = grid.reshape(1, target_grid[0] * target_grid[1], -1).astype(dtype)
    return np.concatenate([prefix, grid], axis=1).astype("float32")
