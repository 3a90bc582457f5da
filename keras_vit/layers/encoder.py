"""Patch embedding: linear projection, class token and position embedding."""

import keras
from keras import ops

from keras_vit.layers._checks import as_pair, positive_int
from keras_vit.layers.patches import check_image_shape


@keras.saving.register_keras_serializable(package="keras_vit")
class PatchEncoder(keras.layers.Layer):
    """Embeds images as a sequence of patch tokens.

    Each P x P patch is projected linearly to `hidden_dim`; a learnable class
    token is prepended (unless `class_token=False`, as for pooling "gap") and
    a learnable 1-D position embedding is added. The projection is stored as
    the (P_h, P_w, C, D) kernel of the equivalent P x P stride-P convolution,
    the layout of the released checkpoints, so conv weights load as they are.
    Weights of a flattened projection of shape (P_h * P_w * C, D) are the same
    numbers reshaped: `kernel.assign(flat.reshape(kernel.shape))`.

    Args:
        patch_size: int or (height, width) of a patch.
        hidden_dim: width D of the tokens.
        class_token: whether to prepend a learnable class token.

    Call arguments:
        images: a (batch, height, width, channels) tensor; the height and
            width must be multiples of the patch size.

    Returns:
        A (batch, num_tokens, hidden_dim) tensor, num_tokens = N (+ 1 with a
        class token), N = (height / P_h) * (width / P_w).

    Example:
    >>> import numpy as np
    >>> tuple(PatchEncoder(patch_size=8, hidden_dim=16)(np.zeros((2, 32, 32, 3), "float32")).shape)
    (2, 17, 16)
    """

    def __init__(self, patch_size, hidden_dim, class_token=True, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = as_pair("patch_size", patch_size)
        self.hidden_dim = positive_int("hidden_dim", hidden_dim)
        if not isinstance(class_token, bool):
            raise TypeError(f"`class_token` must be a bool. Received: class_token={class_token!r}")
        self.class_token = class_token

    @property
    def num_prefix_tokens(self):
        return 1 if self.class_token else 0

    def build(self, input_shape):
        check_image_shape(self.__class__.__name__, input_shape, self.patch_size)
        height, width, channels = input_shape[1], input_shape[2], input_shape[3]
        self.num_channels = channels
        self.grid_size = (height // self.patch_size[0], width // self.patch_size[1])
        num_tokens = self.grid_size[0] * self.grid_size[1] + self.num_prefix_tokens
        self.kernel = self.add_weight(
            name="kernel",
            shape=(*self.patch_size, channels, self.hidden_dim),
            initializer="lecun_normal",
        )
        self.bias = self.add_weight(name="bias", shape=(self.hidden_dim,), initializer="zeros")
        if self.class_token:
            self.cls_token = self.add_weight(
                name="class_token", shape=(1, 1, self.hidden_dim), initializer="zeros"
            )
        self.position_embedding = self.add_weight(
            name="position_embedding",
            shape=(1, num_tokens, self.hidden_dim),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
        )
        self.built = True

    def call(self, images):
        shape = images.shape
        check_image_shape(self.__class__.__name__, shape, self.patch_size, self.num_channels)
        if (shape[1] // self.patch_size[0], shape[2] // self.patch_size[1]) != self.grid_size:
            raise ValueError(
                f"{self.__class__.__name__} was built for a {self.grid_size} grid of patches "
                f"(images of {self.grid_size[0] * self.patch_size[0]}x"
                f"{self.grid_size[1] * self.patch_size[1]}). Received: images.shape={tuple(shape)}. "
                "Build a model at the new size and load the weights into it "
                "(keras_vit.load_weights resizes the position embedding)."
            )
        x = ops.conv(images, self.kernel, strides=self.patch_size, padding="valid")
        x = ops.reshape(x, (-1, self.grid_size[0] * self.grid_size[1], self.hidden_dim))
        x = x + self.bias
        if self.class_token:
            cls = ops.tile(ops.cast(self.cls_token, x.dtype), (ops.shape(x)[0], 1, 1))
            x = ops.concatenate([cls, x], axis=1)
        return x + ops.cast(self.position_embedding, x.dtype)

    def compute_output_shape(self, input_shape):
        grid = (input_shape[1] // self.patch_size[0]) * (input_shape[2] // self.patch_size[1])
        return (input_shape[0], grid + self.num_prefix_tokens, self.hidden_dim)

    def get_config(self):
        return {
            **super().get_config(),
            "patch_size": self.patch_size,
            "hidden_dim": self.hidden_dim,
            "class_token": self.class_token,
        }
