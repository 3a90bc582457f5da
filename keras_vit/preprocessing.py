"""Scaling images to the range the models expect."""

from keras import ops


def preprocess_inputs(images):
    """Maps uint8 (or 0..255 float) images to float32 in [-1, 1].

    Args:
        images: an array or tensor of pixel values in [0, 255].

    Returns:
        A float32 tensor of the same shape, `images / 127.5 - 1`.

    Example:
    >>> import numpy as np
    >>> float(preprocess_inputs(np.array([0, 255], "uint8"))[1])
    1.0
    """
    return ops.cast(images, "float32") / 127.5 - 1.0
