"""Cutting images into flattened, non-overlapping patches."""

import keras
from keras import ops

from keras_vit.layers._checks import as_pair, rank_of, shown_shape


def extract_patches(images, patch_size):
    """Cut (B, H, W, C) images into (B, N, P_h * P_w * C) patches.

    The patches are ordered row-major over the (H / P_h, W / P_w) grid and
    each patch is flattened row-major over (P_h, P_w, C), which is the order
    a P x P stride-P convolution kernel of shape (P_h, P_w, C, D) expects
    when reshaped to (P_h * P_w * C, D).
    """
    patch_h, patch_w = patch_size
    height, width, channels = images.shape[1], images.shape[2], images.shape[3]
    grid_h, grid_w = height // patch_h, width // patch_w
    x = ops.reshape(images, (-1, grid_h, patch_h, grid_w, patch_w, channels))
    x = ops.transpose(x, (0, 1, 3, 2, 4, 5))
    return ops.reshape(x, (-1, grid_h * grid_w, patch_h * patch_w * channels))


def check_image_rank(layer_name, shape):
    """Raise a ValueError unless `shape` is of rank 4, a batch of images."""
    rank = rank_of(shape)
    if rank != 4:
        hint = (
            " One image? Add a batch axis, e.g. images[None] or np.expand_dims(image, 0)."
            if rank == 3
            else ""
        )
        raise ValueError(
            f"{layer_name} expects a batch of images, of rank 4 (batch, height, width, "
            f"channels). Received: images.shape={shown_shape(shape)}{hint}"
        )


def check_image_shape(layer_name, shape, patch_size, channels=None, any_size=False):
    """Raise a ValueError unless `shape` is (batch, H, W, C) tiling by patches.

    With `any_size`, the height, width and channel count may be None (checked
    where known); else they must be known.
    """
    check_image_rank(layer_name, shape)
    height, width, num_channels = shape[1], shape[2], shape[3]
    if not any_size and None in (height, width, num_channels):
        raise ValueError(
            f"{layer_name} needs a static height, width and channel count. "
            f"Received: images.shape={tuple(shape)}"
        )
    if channels is not None and num_channels is not None and num_channels != channels:
        raise ValueError(
            f"{layer_name} expects images with {channels} channels. "
            f"Received: images.shape={tuple(shape)}"
        )
    for size, patch in zip((height, width), patch_size):
        if size is not None and (size < patch or size % patch):
            raise ValueError(
                f"{layer_name}: the image size must be a positive multiple of the patch size "
                f"(divisible by it). Received: image size=({height}, {width}), "
                f"patch_size={tuple(patch_size)}"
            )


@keras.saving.register_keras_serializable(package="keras_vit")
class Patches(keras.layers.Layer):
    """Cuts images into flattened, non-overlapping patches.

    An image of shape (H, W, C) becomes N = (H / P_h) * (W / P_w) patches,
    each flattened row-major over (P_h, P_w, C).

    Args:
        patch_size: int or (height, width) of a patch.

    Call arguments:
        images: a (batch, height, width, channels) tensor whose height and
            width are multiples of the patch size.

    Returns:
        A (batch, num_patches, patch_h * patch_w * channels) tensor.

    Example:
    >>> import numpy as np
    >>> tuple(Patches(4)(np.zeros((2, 8, 12, 3), "float32")).shape)
    (2, 6, 48)
    """

    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = as_pair("patch_size", patch_size)

    def build(self, input_shape):
        check_image_shape(self.__class__.__name__, input_shape, self.patch_size)
        self.built = True

    def call(self, images):
        check_image_shape(self.__class__.__name__, images.shape, self.patch_size)
        return extract_patches(images, self.patch_size)

    def compute_output_shape(self, input_shape):
        batch, height, width, channels = input_shape
        num_patches = (height // self.patch_size[0]) * (width // self.patch_size[1])
        return (batch, num_patches, self.patch_size[0] * self.patch_size[1] * channels)

    def get_config(self):
        return {**super().get_config(), "patch_size": self.patch_size}


@keras.saving.register_keras_serializable(package="keras_vit")
class PatchGrid(keras.layers.Layer):
    """Turns a token sequence into a grid of patch tokens.

    The first `num_prefix_tokens` tokens (the class token) are dropped and
    the rest laid out row-major on the (h, w) grid.

    Args:
        grid_size: (h, w) of the patch grid.
        num_prefix_tokens: tokens before the patches (1 with a class token).

    Call arguments:
        inputs: a (batch, num_prefix_tokens + h * w, D) tensor.

    Returns:
        A (batch, h, w, D) tensor.

    Example:
    >>> import numpy as np
    >>> tuple(PatchGrid((2, 3), 1)(np.zeros((4, 7, 8), "float32")).shape)
    (4, 2, 3, 8)
    """

    def __init__(self, grid_size, num_prefix_tokens=1, **kwargs):
        super().__init__(**kwargs)
        self.grid_size = as_pair("grid_size", grid_size)
        if (
            isinstance(num_prefix_tokens, bool)
            or not isinstance(num_prefix_tokens, int)
            or (num_prefix_tokens < 0)
        ):
            raise ValueError(
                "`num_prefix_tokens` must be a non-negative integer. "
                f"Received: num_prefix_tokens={num_prefix_tokens!r}"
            )
        self.num_prefix_tokens = num_prefix_tokens

    def call(self, inputs):
        expected = self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]
        if len(inputs.shape) != 3 or inputs.shape[1] != expected:
            raise ValueError(
                f"PatchGrid expects (batch, {expected}, D) tokens for a {self.grid_size} grid "
                f"with {self.num_prefix_tokens} prefix tokens. Received: shape={inputs.shape}"
            )
        patches = inputs[:, self.num_prefix_tokens :]
        return ops.reshape(patches, (-1, *self.grid_size, inputs.shape[-1]))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], *self.grid_size, input_shape[-1])

    def get_config(self):
        return {
            **super().get_config(),
            "grid_size": self.grid_size,
            "num_prefix_tokens": self.num_prefix_tokens,
        }
