"""Scaling images to the range the models expect."""

import sys

import numpy as np
from keras import KerasTensor, backend, ops

# Integer dtypes whose values cannot be (or are not) 8-bit pixel values:
# int8 cannot hold 128..255, wider unsigned ones are 16/32-bit image formats.
_REJECTED_DTYPES = {
    "bool": "a boolean mask, not pixel values",
    "int8": "int8 cannot hold 128..255 (view uint8 data as uint8)",
    "uint16": "a 16-bit image format (0..65535): convert to 8 bits, e.g. x // 257",
    "uint32": "a 32-bit image format: convert to 8-bit pixel values",
    "uint64": "a 64-bit image format: convert to 8-bit pixel values",
}
_EXPECTED = "uint8 pixel values (or integers or floats in [0, 255])"


def pixel_range_error(name, dtype, low, high):
    """The error message for pixel values in [low, high] of `dtype` that are not in
    [0, 255] as this package scales them, or None when they are."""
    is_float = "float" in str(dtype)
    if is_float and not (np.isfinite(low) and np.isfinite(high)):
        return f"`{name}` must be finite {_EXPECTED}. Received: NaN or infinity ({dtype})"
    if is_float and -1.01 <= low < 0 and high <= 1.01:
        return (
            f"`{name}` must be {_EXPECTED}; they are scaled to [-1, 1] here. Received: "
            f"{dtype} values in [{low:.3g}, {high:.3g}], which look already scaled to "
            "[-1, 1] (scaled twice?): pass the unscaled images"
        )
    if is_float and low >= 0 and 0 < high <= 1:
        return (
            f"`{name}` must be {_EXPECTED}. Received: {dtype} values in "
            f"[{low:.3g}, {high:.3g}], which look scaled to [0, 1]: multiply them by 255"
        )
    if low < 0 or high > 255:
        return f"`{name}` must be {_EXPECTED}. Received: {dtype} values in [{low:.6g}, {high:.6g}]"
    return None


def _is_symbolic(images):
    """True for a tensor whose values are unknown now (traced or symbolic)."""
    if isinstance(images, KerasTensor):
        return True
    tf = sys.modules.get("tensorflow")
    if tf is not None and tf.is_tensor(images):
        # Ragged and sparse tensors: not read (only the dtype is checked).
        composite = isinstance(images, (tf.RaggedTensor, tf.SparseTensor))
        return composite or tf.is_symbolic_tensor(images)
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(images, jax.core.Tracer)


def _is_tensor(images):
    if isinstance(images, KerasTensor) or ops.is_tensor(images):
        return True
    tf = sys.modules.get("tensorflow")
    return tf is not None and tf.is_tensor(images)


def _as_array(images):
    """`images` as a NumPy array or a tensor, with its standardized dtype name."""
    if images is None or isinstance(images, (str, bytes)):
        hint = " (to read an image file, load it first, e.g. np.asarray(PIL.Image.open(path)))"
        raise TypeError(
            "`images` must be an array or tensor of pixel values. Received: "
            f"images={images!r}" + (hint if isinstance(images, str) else "")
        )
    if not _is_tensor(images):
        try:
            images = np.asarray(images)
        except ValueError as error:  # a ragged nested list
            raise ValueError(
                "`images` must be an array of pixel values of one shape (not ragged). "
                f"Received: {error}"
            ) from None
        if images.dtype.kind not in "biuf":
            raise TypeError(
                f"`images` must be an array or tensor of {_EXPECTED}. Received: an array of "
                f"dtype {images.dtype}"
            )
    try:
        dtype = backend.standardize_dtype(images.dtype)
    except ValueError:
        dtype = str(images.dtype)
    if not any(kind in dtype for kind in ("int", "float", "bool")):
        raise TypeError(f"`images` must be {_EXPECTED}. Received: a tensor of dtype {dtype}")
    return images, dtype


def _value_range(images, dtype):
    """(min, max) of concrete `images` as Python floats, or None when they are empty."""
    if isinstance(images, np.ndarray):
        if images.size == 0:
            return None
        return float(images.min()), float(images.max())
    if 0 in tuple(images.shape):
        return None
    low, high = (float(ops.convert_to_numpy(f(images))) for f in (ops.min, ops.max))
    if "float" in dtype and not bool(ops.convert_to_numpy(ops.all(ops.isfinite(images)))):
        low = float("nan")
    return low, high


def preprocess_inputs(images):
    """Maps uint8 (or 0..255 float) images to float32 in [-1, 1].

    Args:
        images: an array or tensor of pixel values in [0, 255]: uint8, or
            integers (int16/32/64) or floats in that range. Rejected: bool, int8,
            uint16/32/64 and non-numeric dtypes (everywhere), and, when the values
            are known (NumPy arrays, eager tensors), values outside [0, 255] and
            floats that look already scaled to [-1, 1] or [0, 1]. Inside
            `tf.data` pipelines, traced functions and symbolic model inputs only
            the dtype is checked.

    Returns:
        A float32 tensor of the same shape, `images / 127.5 - 1`.

    Raises:
        TypeError: `images` is not an array or tensor of numbers.
        ValueError: its dtype or its values are not 0..255 pixel values.

    Example:
    >>> import numpy as np
    >>> float(preprocess_inputs(np.array([0, 255], "uint8"))[1])
    1.0
    """
    images, dtype = _as_array(images)
    if dtype in _REJECTED_DTYPES:
        raise ValueError(
            f"`images` must be {_EXPECTED}. Received: dtype {dtype}, {_REJECTED_DTYPES[dtype]}"
        )
    if dtype != "uint8" and not _is_symbolic(images):
        value_range = _value_range(images, dtype)
        if value_range is not None:
            message = pixel_range_error("images", dtype, *value_range)
            if message:
                raise ValueError(message)
    return ops.cast(images, "float32") / 127.5 - 1.0
