"""Patch embedding: linear projection, class token and position embedding."""

import keras
import numpy as np
from keras import ops

from keras_vit.layers._checks import as_pair, boolean, positive_int
from keras_vit.layers.patches import check_image_rank, check_image_shape


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

    With `grid_size` set, the layer takes images of any size (the input's
    height and width may be None): the position embedding is learned on a
    `grid_size` grid of patches and, for images of another grid, resized to
    theirs on the fly, bicubic and antialiased (the class token's position is
    kept), as timm's `dynamic_img_size=True` does.

    Args:
        patch_size: int or (height, width) of a patch.
        hidden_dim: width D of the tokens.
        class_token: whether to prepend a learnable class token.
        grid_size: None (the default): the grid of the images the layer is
            built for, the only size it then takes. Or (rows, columns) of the
            position embedding, for images of any size.

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

    def __init__(self, patch_size, hidden_dim, class_token=True, grid_size=None, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = as_pair("patch_size", patch_size)
        self.hidden_dim = positive_int("hidden_dim", hidden_dim)
        self.class_token = boolean("class_token", class_token)
        # Any image size when set: the position embedding's grid, resized per input.
        self.dynamic = grid_size is not None
        self.grid_size = as_pair("grid_size", grid_size) if self.dynamic else None

    @property
    def num_prefix_tokens(self):
        return 1 if self.class_token else 0

    def build(self, input_shape):
        check_image_shape(
            self.__class__.__name__, input_shape, self.patch_size, any_size=self.dynamic
        )
        if input_shape[3] is None:
            raise ValueError(
                f"{self.__class__.__name__} needs a static channel count to be built. "
                f"Received: images.shape={tuple(input_shape)}"
            )
        if not self.dynamic:
            height, width = input_shape[1], input_shape[2]
            self.grid_size = (height // self.patch_size[0], width // self.patch_size[1])
        self.num_channels = input_shape[3]
        num_tokens = self.grid_size[0] * self.grid_size[1] + self.num_prefix_tokens
        self.kernel = self.add_weight(
            name="kernel",
            shape=(*self.patch_size, self.num_channels, self.hidden_dim),
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
        images = self._checked(images)
        x = ops.conv(images, self.kernel, strides=self.patch_size, padding="valid")
        grid = _grid_of(x) if self.dynamic else self.grid_size
        x = ops.reshape(x, (-1, grid[0] * grid[1], self.hidden_dim))
        x = x + self.bias
        if self.class_token:
            cls = ops.tile(ops.cast(self.cls_token, x.dtype), (ops.shape(x)[0], 1, 1))
            x = ops.concatenate([cls, x], axis=1)
        return x + ops.cast(self.position_embedding_for(grid), x.dtype)

    def _expected(self):
        """What the layer takes, in words, for the error messages."""
        if self.dynamic:
            return (
                f"images of shape (batch, height, width, {self.num_channels}) whose height "
                f"and width are positive multiples of the patch size {self.patch_size}"
            )
        height, width = (cells * step for cells, step in zip(self.grid_size, self.patch_size))
        return (
            f"images of shape (batch, {height}, {width}, {self.num_channels}), the size it "
            f"was built for (a {self.grid_size} grid of {self.patch_size} patches; a model "
            "built with dynamic_image_size=True takes other sizes)"
        )

    def _checked(self, images):
        """`images`, checked against what the layer takes.

        Sizes known when the call is traced are checked then: a ValueError
        naming what the layer expects and what it received. A TensorFlow
        function traced for images of unknown sizes (Keras traces
        `predict`, `fit` and `evaluate` anew for any size once it has seen
        two) checks the unknown ones when it runs, at no cost to a trace of
        known sizes.
        """
        shape = images.shape
        name = self.__class__.__name__
        check_image_rank(name, shape)
        size = None
        if not self.dynamic:
            size = tuple(cells * step for cells, step in zip(self.grid_size, self.patch_size))
            if any(n is not None and n != m for n, m in zip(shape[1:3], size)):
                raise ValueError(
                    f"{name} takes {self._expected()}. Received: images.shape={tuple(shape)}. "
                    "Build a model at the new size and load the weights into it "
                    "(keras_vit.load_weights resizes the position embedding), or build it "
                    "with dynamic_image_size=True."
                )
        check_image_shape(name, shape, self.patch_size, self.num_channels, any_size=True)
        if None not in tuple(shape)[1:]:
            return images
        if keras.backend.backend() == "tensorflow":
            return _checked_when_run(
                images,
                size,
                self.num_channels,
                self.patch_size,
                f"{name} takes {self._expected()}.",
            )
        if self.dynamic and shape[3] is not None:
            return images
        raise ValueError(
            f"{name} takes {self._expected()}, known when the call is traced. "
            f"Received: images.shape={tuple(shape)}"
        )

    def position_embedding_for(self, grid):
        """The (1, tokens, D) position embedding for a grid of (rows, columns) patches.

        The learned one for the layer's own grid; for another grid (a dynamic
        layer), its grid part resized bicubically with antialiasing, in float32,
        as timm's `resample_abs_pos_embed` (it matches timm to ~1e-6). The
        resize is two small matrix products, so it also runs inside XLA, where
        TensorFlow's own antialiased resize does not.
        """
        if all(isinstance(n, int) for n in grid) and tuple(grid) == tuple(self.grid_size):
            return self.position_embedding
        prefix = self.num_prefix_tokens
        embedding = ops.cast(self.position_embedding, "float32")
        patches = ops.reshape(embedding[:, prefix:], (*self.grid_size, self.hidden_dim))
        rows = resize_weights(self.grid_size[0], grid[0])
        columns = resize_weights(self.grid_size[1], grid[1])
        patches = ops.einsum("ih,jw,hwd->ijd", rows, columns, patches)
        patches = ops.reshape(patches, (1, -1, self.hidden_dim))
        return ops.concatenate([embedding[:, :prefix], patches], axis=1)

    def compute_output_shape(self, input_shape):
        if input_shape[1] is None or input_shape[2] is None:
            return (input_shape[0], None, self.hidden_dim)
        grid = (input_shape[1] // self.patch_size[0]) * (input_shape[2] // self.patch_size[1])
        return (input_shape[0], grid + self.num_prefix_tokens, self.hidden_dim)

    def get_config(self):
        return {
            **super().get_config(),
            "patch_size": self.patch_size,
            "hidden_dim": self.hidden_dim,
            "class_token": self.class_token,
            "grid_size": self.grid_size if self.dynamic else None,
        }


def _grid_of(patches):
    """(rows, columns) of a convolved patch map: Python ints where the shape is known."""
    rows, columns = patches.shape[1], patches.shape[2]
    if rows is not None and columns is not None:
        return (rows, columns)
    shape = ops.shape(patches)
    return (shape[1], shape[2])


def _checked_when_run(images, size, channels, patch_size, message):
    """`images` behind run-time checks of the sizes its traced shape leaves unknown.

    TensorFlow only. `size`: the (height, width) the images must have, or None
    for any positive multiples of `patch_size`. An assertion names the
    received shape. XLA drops assertions, so the shape is also checked where
    XLA compiles it (it knows the sizes then): `tf.ensure_shape` for the
    exact sizes (its message names the received and expected shapes; where
    TensorFlow knows the batch size when it runs the function, it is the one
    that fails first) and a reshape to whole patches, which fails for images
    that do not tile instead of the convolution silently dropping their
    leftover rows and columns.
    """
    import tensorflow as tf

    shape = tf.shape(images)
    if size is not None:
        fits = tf.reduce_all(tf.equal(shape[1:], [size[0], size[1], channels]))
    else:
        patch = tf.constant(patch_size, shape[1:3].dtype)
        sides = shape[1:3]
        fits = (
            tf.equal(shape[3], channels)
            & tf.reduce_all(sides >= patch)
            & tf.reduce_all(tf.equal(sides % patch, 0))
        )
    check = tf.debugging.Assert(fits, [message + " Received: images.shape =", shape], summarize=4)
    with tf.control_dependencies([check]):
        if size is not None:
            return tf.ensure_shape(
                images,
                [None, size[0], size[1], channels],
                name="images_must_have_the_size_the_model_was_built_for",
            )
        images = tf.ensure_shape(images, [None, None, None, channels])
        whole = tf.concat([shape[:1], shape[1:3] // patch * patch, [channels]], axis=0)
        return tf.reshape(images, whole, name="image_sides_must_be_multiples_of_the_patch_size")


def resize_weights(source, target):
    """The (target, source) matrix of a 1-D antialiased bicubic resize.

    The weights of PyTorch's `F.interpolate(mode="bicubic", antialias=True)`
    (Pillow's filter): output i samples the source at its centre
    (i + 0.5) * source / target with the cubic kernel of a = -0.5, stretched
    by the scale when shrinking, over the source positions only, and each
    row is normalised to sum to 1. `target` may be a scalar tensor (a
    TensorFlow graph traced for any size); the matrix is then built in the
    graph, else in float64 NumPy.
    """
    if isinstance(target, int):
        xp, dtype, scale = np, "float64", source / target
    else:
        xp, dtype = ops, "float32"
        scale = ops.cast(source, "float32") / ops.cast(target, "float32")
    stretch = xp.maximum(scale, 1.0)
    centres = (xp.arange(target, dtype=dtype) + 0.5) * scale
    x = xp.abs((xp.arange(source, dtype=dtype)[None, :] + 0.5 - centres[:, None]) / stretch)
    a = -0.5
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    weights = xp.where(x < 1, near, xp.where(x < 2, far, xp.zeros_like(x)))
    weights = weights / xp.sum(weights, axis=1, keepdims=True)
    return weights.astype("float32") if xp is np else weights
