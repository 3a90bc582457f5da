"""Pictures of what a ViT does: attention overlays, position-embedding
similarity, mean attention distance.

matplotlib is imported only when a plot is made. The figures are made
without pyplot (rendered by the Agg backend, whatever backend pyplot uses);
every function returns the matplotlib Figure, and saves it too when `path`
is given.
"""

import os

import numpy as np

from keras_vit.inspection import (
    SCALED_BOUND,
    mean_attention_distance,
    position_embedding_similarity,
)
from keras_vit.layers._checks import as_pair, real


def _matplotlib():
    """matplotlib, imported on first use (an optional dependency)."""
    try:
        import matplotlib
        import matplotlib.backend_bases
        import matplotlib.figure
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError("The keras_vit plots need matplotlib: pip install matplotlib") from error
    return matplotlib


def _figure(**kwargs):
    # A Figure outside pyplot: no global figure list to leak, no GUI backend needed
    # (it renders with Agg), and it still shows inline in notebooks.
    return _matplotlib().figure.Figure(**kwargs)


def _check_path(path):
    """(path, format) to save a figure at, checked before any work; (None, None) for None.

    A path without an extension is written as a PNG at that very path
    (matplotlib would append ".png" to it, or write "FOLDER.png" beside a folder).
    """
    if path is None:
        return None, None
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            "`path` must be a file path (str or os.PathLike) for the picture, or None. "
            f"Received: path={path!r} of type {type(path).__name__}"
        )
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(
            "`path` must be a file path for the picture, not a folder. "
            f"Received: path={path!r}, an existing folder"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"`path`: the folder to save the picture in does not exist. "
            f"Received: path={path!r} (no folder {folder!r})"
        )
    extension = os.path.splitext(path)[1][1:].lower()
    formats = _matplotlib().backend_bases.FigureCanvasBase.get_supported_filetypes()
    if extension and extension not in formats:
        raise ValueError(
            f"`path` must end in a picture format matplotlib writes ({', '.join(sorted(formats))}"
            f"), or in none for a PNG. Received: path={path!r}"
        )
    return path, extension or "png"


def _finish(figure, path_and_format):
    path, file_format = path_and_format
    if path is not None:
        figure.savefig(path, format=file_format, dpi=100, bbox_inches="tight")
    return figure


def _as_uint8_image(image):
    original = image
    try:
        image = np.asarray(image)
    except (TypeError, ValueError):  # ragged
        image = np.asarray(None)
    if image.dtype == bool or not np.issubdtype(image.dtype, np.number):
        raise TypeError(
            "`image` must be an array: one (height, width, 1 or 3) uint8 image or floats "
            f"scaled to [-1, 1]. Received: image of type {type(original).__name__}"
            + (f" and dtype {image.dtype}" if hasattr(original, "dtype") else "")
        )
    if image.ndim != 3 or image.shape[-1] not in (1, 3) or not image.size:
        raise ValueError(
            "`image` must be one (height, width, 1 or 3) image. "
            f"Received: image.shape={image.shape}"
        )
    expected = "`image` must be a uint8 image (0..255) or floats scaled to [-1, 1]"
    if image.dtype == np.uint8:
        pass
    elif np.issubdtype(image.dtype, np.floating):  # as the models take them
        low, high = float(np.min(image)), float(np.max(image))
        if not -SCALED_BOUND <= low <= high <= SCALED_BOUND:
            raise ValueError(
                f"{expected}; for pixels of 0..255 pass image.astype('uint8'). "
                f"Received: {image.dtype} values in [{low:g}, {high:g}]"
            )
        image = np.clip((image.astype("float32") + 1.0) * 127.5, 0, 255).astype("uint8")
    else:
        raise ValueError(
            f"{expected}; for pixels of 0..255 pass image.astype('uint8'). "
            f"Received: an image of dtype {image.dtype}"
        )
    return np.repeat(image, 3, axis=-1) if image.shape[-1] == 1 else image


def upsample_map(attention_map, size):
    """Bilinearly resize a (h, w) map to `size` = (height, width), scaled to [0, 1]."""
    from PIL import Image

    size = as_pair("size", size)
    original = attention_map
    expected = (
        "The attention map must be 2-D (h, w), an array of numbers such as one item of the "
        "(batch, h, w) result of keras_vit.attention_rollout"
    )
    try:
        attention_map = np.asarray(attention_map)
    except (TypeError, ValueError):  # ragged
        attention_map = np.asarray(None)
    if attention_map.dtype == bool or not np.issubdtype(attention_map.dtype, np.number):
        raise TypeError(f"{expected}. Received: an object of type {type(original).__name__}")
    attention_map = attention_map.astype("float32")
    if attention_map.ndim != 2 or not attention_map.size:
        raise ValueError(f"{expected}. Received: shape={attention_map.shape}")
    if not np.all(np.isfinite(attention_map)):
        raise ValueError(f"{expected}, with finite values. Received: NaN or infinite values")
    low, high = float(attention_map.min()), float(attention_map.max())
    scaled = (attention_map - low) / (high - low) if high > low else np.zeros_like(attention_map)
    resized = Image.fromarray(scaled).resize((size[1], size[0]), Image.BILINEAR)
    return np.clip(np.asarray(resized), 0.0, 1.0)


def attention_overlay(image, attention_map, alpha=0.5, colormap="inferno"):
    """The image blended with a colour-mapped attention map, as a uint8 array.

    The map is min-max scaled to [0, 1], resized bilinearly to the image's
    size, coloured with `colormap` and mixed in with weight `alpha`.
    """
    image = _as_uint8_image(image)
    alpha = real("alpha", alpha, low=0, high=1)
    heat = upsample_map(attention_map, image.shape[:2])
    colormaps = _matplotlib().colormaps
    if not isinstance(colormap, str) or colormap not in colormaps:
        raise ValueError(
            "`colormap` must be the name of a matplotlib colormap, e.g. 'inferno' or "
            f"'viridis'. Received: colormap={colormap!r}"
        )
    colours = (colormaps[colormap](heat)[..., :3] * 255).astype("float32")
    blended = (1 - alpha) * image.astype("float32") + alpha * colours
    return blended.clip(0, 255).astype("uint8")


def plot_attention(image, rollout, path=None, title=None, alpha=0.5):
    """The image beside its attention overlay (e.g. a rollout map).

    Args:
        image: (height, width, 3 or 1) uint8 image, or floats in [-1, 1];
            other dtypes and floats beyond +-1.5 (unscaled 0..255 pixels) are
            refused with a ValueError.
        rollout: a (h, w) map, e.g. one item of `attention_rollout`.
        path: where to save the PNG (another format by its extension, e.g.
            ".svg"; no extension: a PNG at that very path), or None. Its
            folder must exist.
        title: an optional title, e.g. the predicted class.
        alpha: weight of the heat map in the overlay, a number in [0, 1].

    Returns:
        The matplotlib Figure.
    """
    path = _check_path(path)
    image = _as_uint8_image(image)
    alpha = real("alpha", alpha, low=0, high=1)
    overlay = attention_overlay(image, rollout, alpha=alpha)
    figure = _figure(figsize=(6.4, 3.4))
    axes = figure.subplots(1, 2)
    axes[0].imshow(image)
    axes[0].set_title("image")
    axes[1].imshow(overlay)
    axes[1].set_title("attention rollout")
    for axis in axes:
        axis.axis("off")
    if title:
        figure.suptitle(title)
    return _finish(figure, path)


def plot_position_embedding_similarity(model, path=None):
    """Cosine similarity of each position embedding with all the others.

    One small tile per patch position, laid out as the patch grid, each
    showing that position's similarity with every position (the ViT paper,
    Figure 7 centre).

    Args:
        model: a ViT built by keras_vit.
        path: where to save the PNG (another format by its extension, e.g.
            ".svg"; no extension: a PNG at that very path), or None. Its
            folder must exist.

    Returns:
        The matplotlib Figure.
    """
    path = _check_path(path)
    similarity = position_embedding_similarity(model)
    grid_h, grid_w = similarity.shape[:2]
    gap = 1
    mosaic = np.full((grid_h * (grid_h + gap), grid_w * (grid_w + gap)), np.nan, "float32")
    for i in range(grid_h):
        for j in range(grid_w):
            top, left = i * (grid_h + gap), j * (grid_w + gap)
            mosaic[top : top + grid_h, left : left + grid_w] = similarity[i, j]
    figure = _figure(figsize=(6, 6 * grid_h / grid_w))
    axis = figure.subplots()
    shown = axis.imshow(mosaic, cmap="viridis", vmin=-1, vmax=1)
    axis.set_title("Position embedding similarity")
    axis.set_xlabel("input patch column")
    axis.set_ylabel("input patch row")
    axis.set_xticks([(j + 0.5) * (grid_w + gap) - 1 for j in range(grid_w)], range(1, grid_w + 1))
    axis.set_yticks([(i + 0.5) * (grid_h + gap) - 1 for i in range(grid_h)], range(1, grid_h + 1))
    figure.colorbar(shown, ax=axis, fraction=0.046, label="cosine similarity")
    return _finish(figure, path)


def plot_mean_attention_distance(model, images, path=None, maps=None):
    """Mean attention distance of each head against the depth (paper, Figure 7 right).

    One point per head and layer; see `keras_vit.mean_attention_distance`.
    The paper averages over 128 images; a few dozen give a stable picture.

    Args:
        model: a ViT built by keras_vit.
        images: (batch, height, width, channels) images in [-1, 1].
        path: where to save the PNG (another format by its extension, e.g.
            ".svg"; no extension: a PNG at that very path), or None. Its
            folder must exist.
        maps: the `attention_maps` of `model` for `images`, to reuse.

    Returns:
        The matplotlib Figure.
    """
    path = _check_path(path)
    distance = mean_attention_distance(model, images, maps=maps)
    num_layers, num_heads = distance.shape
    figure = _figure(figsize=(5, 4))
    axis = figure.subplots()
    for head in range(num_heads):
        axis.scatter(np.arange(1, num_layers + 1), distance[:, head], s=12, label=f"head {head}")
    axis.set_xlabel("network depth (layer)")
    axis.set_xticks(range(1, num_layers + 1))
    axis.set_ylabel("mean attention distance (pixels)")
    axis.set_ylim(0, None)
    if num_heads <= 16:
        axis.legend(fontsize=6, ncol=2)
    return _finish(figure, path)
