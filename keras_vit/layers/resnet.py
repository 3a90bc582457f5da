"""The ResNet-v2 stem of the hybrid models (R+ViT, R50+ViT-B/16).

The structure and the numerics follow the original vit_jax code
(models_resnet.py and the root block in models_vit.py): weight-standardised
convolutions without bias, GroupNorm with 32 groups and epsilon 1e-6, a 7x7
stride-2 root conv, a 3x3 stride-2 max-pool, then stages of bottleneck units.
All convolutions and the max-pool use SAME padding (TensorFlow, JAX and Flax
agree: for a total padding p the lower side gets p // 2, the upper the rest).
"""

import math
import numbers

import keras
from keras import ops

from keras_vit.layers._checks import as_pair, positive_int

STANDARDIZE_EPSILON = 1e-5
GROUP_NORM_GROUPS = 32
GROUP_NORM_EPSILON = 1e-6
ROOT_WIDTH = 64


def _group_norm(name, dtype, zero_scale=False):
    return GroupNorm(
        groups=GROUP_NORM_GROUPS,
        epsilon=GROUP_NORM_EPSILON,
        gamma_initializer="zeros" if zero_scale else "ones",
        dtype=dtype,
        name=name,
    )


def _kernel_mean(kernel):
    """Mean of a (h, w, in, out) kernel over (h, w, in), one axis at a time
    (more exact on TensorFlow than one reduction over the three axes)."""
    kernel = ops.mean(kernel, axis=2, keepdims=True)
    kernel = ops.mean(kernel, axis=1, keepdims=True)
    return ops.mean(kernel, axis=0, keepdims=True)


def _spatial_group_mean(x):
    """Mean of a (batch, height, width, groups, channels) tensor over all but
    the batch and group axes, one axis at a time. Short reductions keep float32
    exact to about 1e-7 relative; TensorFlow's single reduction over the three
    axes at once loses about 1e-5 on a 112 x 112 map."""
    x = ops.mean(x, axis=4, keepdims=True)
    x = ops.mean(x, axis=2, keepdims=True)
    return ops.mean(x, axis=1, keepdims=True)


def _same_size(size, stride):
    """Spatial size after a SAME-padded op with `stride` (None stays None)."""
    return None if size is None else math.ceil(size / stride)


def _check_image_input(layer, input_shape):
    if len(input_shape) != 4 or input_shape[-1] is None:
        raise ValueError(
            f"{layer.__class__.__name__} expects inputs of shape (batch, height, width, "
            f"channels) with known channels. Received: input_shape={tuple(input_shape)}"
        )


@keras.saving.register_keras_serializable(package="keras_vit")
class GroupNorm(keras.layers.Layer):
    """Group normalisation of NHWC feature maps, as `flax.linen.GroupNorm`.

    The channels are split into `groups`; each group of each sample is
    normalised by its mean and (population) variance over height, width and
    the group's channels, then scaled by `gamma` and shifted by `beta` per
    channel. The statistics are computed in float32, centred (two-pass), and
    reduced one axis at a time: this keeps the TensorFlow backend as exact as
    the original (about 1e-6 on R50 feature maps) where
    `keras.layers.GroupNormalization` differs by about 1e-5 on large maps.
    The weights are named `gamma` and `beta` like Keras' layer.

    Reference: Wu & He, "Group Normalization", ECCV 2018.

    Args:
        groups: number of groups; must divide the channels.
        epsilon: added to the variance.
        gamma_initializer: initializer of the scale ("ones"; "zeros" for the
            last norm of a residual branch).

    Call arguments:
        inputs: a (batch, height, width, channels) tensor.

    Returns:
        A tensor of the shape of `inputs`.

    Example:
    >>> import numpy as np
    >>> tuple(GroupNorm(groups=2)(np.arange(32, dtype="float32").reshape(1, 2, 2, 8)).shape)
    (1, 2, 2, 8)
    """

    def __init__(
        self,
        groups=GROUP_NORM_GROUPS,
        epsilon=GROUP_NORM_EPSILON,
        gamma_initializer="ones",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.groups = positive_int("groups", groups)
        if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or epsilon <= 0:
            raise ValueError(f"`epsilon` must be a positive number. Received: epsilon={epsilon!r}")
        self.epsilon = float(epsilon)
        self.gamma_initializer = keras.initializers.get(gamma_initializer)

    def build(self, input_shape):
        _check_image_input(self, input_shape)
        channels = input_shape[-1]
        if channels % self.groups:
            raise ValueError(
                f"GroupNorm needs channels divisible by groups={self.groups}. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        self.gamma = self.add_weight(
            name="gamma", shape=(channels,), initializer=self.gamma_initializer, autocast=False
        )
        self.beta = self.add_weight(
            name="beta", shape=(channels,), initializer="zeros", autocast=False
        )
        self.built = True

    def call(self, inputs):
        shape = ops.shape(inputs)
        channels = inputs.shape[-1]
        x = ops.cast(inputs, "float32")
        x = ops.reshape(x, (-1, shape[1], shape[2], self.groups, channels // self.groups))
        centred = x - _spatial_group_mean(x)
        variance = _spatial_group_mean(ops.square(centred))
        x = ops.reshape(centred * ops.rsqrt(variance + self.epsilon), shape)
        x = x * ops.cast(self.gamma, "float32") + ops.cast(self.beta, "float32")
        return ops.cast(x, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {
            **super().get_config(),
            "groups": self.groups,
            "epsilon": self.epsilon,
            "gamma_initializer": keras.initializers.serialize(self.gamma_initializer),
        }


@keras.saving.register_keras_serializable(package="keras_vit")
class StdConv(keras.layers.Layer):
    """A 2-D convolution with weight standardisation and no bias.

    In every call the stored kernel is standardised over its (height, width,
    in_channels) axes, separately for each output channel:
    `(kernel - mean) / (std + epsilon)` with the population standard
    deviation, exactly as `weight_standardize` of the original (note: epsilon
    is added to the standard deviation, not to the variance). The stored
    kernel stays unstandardised, so training updates it and checkpoints of
    the original load as they are. The standardisation runs in float32 under
    a mixed policy.

    Reference: Qiao et al., "Micro-Batch Training with Batch-Channel
    Normalization and Weight Standardization", 2019.

    Args:
        filters: number of output channels.
        kernel_size: int or (height, width) of the kernel.
        strides: int or (height, width) stride; padding is SAME.
        epsilon: added to the standard deviation of the kernel.

    Call arguments:
        inputs: a (batch, height, width, channels) tensor.

    Returns:
        A (batch, ceil(height / stride), ceil(width / stride), filters) tensor.

    Example:
    >>> import numpy as np
    >>> tuple(StdConv(8, 3, strides=2)(np.zeros((1, 9, 9, 4), "float32")).shape)
    (1, 5, 5, 8)
    """

    def __init__(self, filters, kernel_size, strides=1, epsilon=STANDARDIZE_EPSILON, **kwargs):
        super().__init__(**kwargs)
        self.filters = positive_int("filters", filters)
        self.kernel_size = as_pair("kernel_size", kernel_size)
        self.strides = as_pair("strides", strides)
        if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or epsilon <= 0:
            raise ValueError(f"`epsilon` must be a positive number. Received: epsilon={epsilon!r}")
        self.epsilon = float(epsilon)

    def build(self, input_shape):
        _check_image_input(self, input_shape)
        self.kernel = self.add_weight(
            name="kernel",
            shape=(*self.kernel_size, input_shape[-1], self.filters),
            initializer="lecun_normal",
            autocast=False,
        )
        self.built = True

    def standardized_kernel(self):
        """The kernel actually applied: standardised, in float32."""
        kernel = ops.cast(self.kernel, "float32")
        centred = kernel - _kernel_mean(kernel)
        return centred / (ops.sqrt(_kernel_mean(ops.square(centred))) + self.epsilon)

    def call(self, inputs):
        kernel = ops.cast(self.standardized_kernel(), self.compute_dtype)
        return ops.conv(inputs, kernel, strides=self.strides, padding="same")

    def compute_output_shape(self, input_shape):
        return (
            input_shape[0],
            _same_size(input_shape[1], self.strides[0]),
            _same_size(input_shape[2], self.strides[1]),
            self.filters,
        )

    def get_config(self):
        return {
            **super().get_config(),
            "filters": self.filters,
            "kernel_size": self.kernel_size,
            "strides": self.strides,
            "epsilon": self.epsilon,
        }


@keras.saving.register_keras_serializable(package="keras_vit")
class BottleneckUnit(keras.layers.Layer):
    """A bottleneck residual unit of the original hybrid ResNet.

    y = relu(gn1(conv1(x))) with a 1x1 conv to `filters`; y = relu(gn2(conv2(y)))
    with a 3x3 conv carrying the stride; y = gn3(conv3(y)) with a 1x1 conv to
    4 * `filters` and gn3's scale initialised to zero; the output is
    relu(shortcut + y). The shortcut is the input, or conv_proj (1x1 with the
    stride) + gn_proj when the channels or the stride change. The sublayers
    are named as in the original checkpoints: conv1..conv3, gn1..gn3,
    conv_proj, gn_proj.

    Args:
        filters: bottleneck width; the unit outputs 4 * filters channels.
            Must be a multiple of 32 (the GroupNorm groups).
        strides: 1 or 2, the stride of conv2 and of the projection.

    Call arguments:
        inputs: a (batch, height, width, channels) tensor.

    Returns:
        A (batch, ceil(height / strides), ceil(width / strides), 4 * filters)
        tensor.

    Example:
    >>> import numpy as np
    >>> tuple(BottleneckUnit(32, strides=2)(np.zeros((1, 8, 8, 64), "float32")).shape)
    (1, 4, 4, 128)
    """

    def __init__(self, filters, strides=1, **kwargs):
        super().__init__(**kwargs)
        self.filters = _group_norm_width("filters", filters)
        self.strides = positive_int("strides", strides)
        policy = self.dtype_policy
        self.conv1 = StdConv(self.filters, 1, dtype=policy, name="conv1")
        self.gn1 = _group_norm("gn1", policy)
        self.conv2 = StdConv(self.filters, 3, strides=self.strides, dtype=policy, name="conv2")
        self.gn2 = _group_norm("gn2", policy)
        self.conv3 = StdConv(4 * self.filters, 1, dtype=policy, name="conv3")
        self.gn3 = _group_norm("gn3", policy, zero_scale=True)
        self.conv_proj = None
        self.gn_proj = None

    def build(self, input_shape):
        _check_image_input(self, input_shape)
        if input_shape[-1] != 4 * self.filters or self.strides != 1:
            policy = self.dtype_policy
            self.conv_proj = StdConv(
                4 * self.filters, 1, strides=self.strides, dtype=policy, name="conv_proj"
            )
            self.gn_proj = _group_norm("gn_proj", policy)
            self.conv_proj.build(input_shape)
            self.gn_proj.build(self.conv_proj.compute_output_shape(input_shape))
        shape = input_shape
        for conv, norm in ((self.conv1, self.gn1), (self.conv2, self.gn2), (self.conv3, self.gn3)):
            conv.build(shape)
            shape = conv.compute_output_shape(shape)
            norm.build(shape)
        self.built = True

    def call(self, inputs):
        shortcut = inputs
        if self.conv_proj is not None:
            shortcut = self.gn_proj(self.conv_proj(inputs))
        y = ops.relu(self.gn1(self.conv1(inputs)))
        y = ops.relu(self.gn2(self.conv2(y)))
        y = self.gn3(self.conv3(y))
        return ops.relu(shortcut + y)

    def compute_output_shape(self, input_shape):
        return self.conv3.compute_output_shape(self.conv2.compute_output_shape(input_shape))

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "strides": self.strides}


@keras.saving.register_keras_serializable(package="keras_vit")
class ResNetStage(keras.layers.Layer):
    """A stage of bottleneck units: the first has the stride, the rest stride 1.

    The units are named unit1, unit2, ... as in the original checkpoints.

    Args:
        num_units: number of bottleneck units.
        filters: bottleneck width of every unit (outputs 4 * filters).
        strides: stride of the first unit.

    Call arguments:
        inputs: a (batch, height, width, channels) tensor.

    Returns:
        A (batch, ceil(height / strides), ceil(width / strides), 4 * filters)
        tensor.

    Example:
    >>> import numpy as np
    >>> tuple(ResNetStage(2, 32, strides=2)(np.zeros((1, 8, 8, 32), "float32")).shape)
    (1, 4, 4, 128)
    """

    def __init__(self, num_units, filters, strides=1, **kwargs):
        super().__init__(**kwargs)
        self.num_units = positive_int("num_units", num_units)
        self.filters = _group_norm_width("filters", filters)
        self.strides = positive_int("strides", strides)
        self.units = [
            BottleneckUnit(
                self.filters,
                strides=self.strides if index == 0 else 1,
                dtype=self.dtype_policy,
                name=f"unit{index + 1}",
            )
            for index in range(self.num_units)
        ]

    def build(self, input_shape):
        _check_image_input(self, input_shape)
        shape = input_shape
        for unit in self.units:
            unit.build(shape)
            shape = unit.compute_output_shape(shape)
        self.built = True

    def call(self, inputs):
        x = inputs
        for unit in self.units:
            x = unit(x)
        return x

    def compute_output_shape(self, input_shape):
        return self.units[0].compute_output_shape(input_shape)

    def get_config(self):
        return {
            **super().get_config(),
            "num_units": self.num_units,
            "filters": self.filters,
            "strides": self.strides,
        }


@keras.saving.register_keras_serializable(package="keras_vit")
class ResNetStem(keras.layers.Layer):
    """The ResNet-v2 feature extractor of the hybrid ViT models.

    The root: a 7x7 stride-2 StdConv to 64 * width channels (conv_root),
    GroupNorm (gn_root), ReLU and a 3x3 stride-2 max-pool. Then one stage
    per entry of `layers` (named block1, block2, ...): stage i has
    bottleneck width 64 * width * 2**i (4x that many output channels), the
    first stage stride 1 and the others stride 2. `layers=(3, 4, 9)` is the
    R50 of R50+ViT-B/16 (an image of 224 gives a 14x14x1024 map), `()` the
    root only of R+ViT-Ti/16 (56x56x64).

    Reference: Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR
    2021, section 3.1 (hybrid architecture); Kolesnikov et al., "Big
    Transfer (BiT)", 2020 (the ResNet-v2 with GroupNorm and weight
    standardisation).

    Args:
        layers: sequence of the number of bottleneck units per stage; may
            be empty.
        width: width multiplier; 64 * width must be a positive multiple of
            32 (the GroupNorm groups), e.g. 0.5, 1, 2.

    Call arguments:
        inputs: a (batch, height, width, channels) image tensor.

    Returns:
        The feature map, (batch, ceil(height / s), ceil(width / s),
        channels) with total stride s = 4 * 2**(len(layers) - 1) (4 without
        stages) and channels = 4 * 64 * width * 2**(len(layers) - 1) (64 *
        width without stages).

    Example:
    >>> import numpy as np
    >>> tuple(ResNetStem(layers=(1, 1), width=0.5)(np.zeros((1, 32, 32, 3), "float32")).shape)
    (1, 4, 4, 256)
    """

    def __init__(self, layers=(3, 4, 9), width=1, **kwargs):
        super().__init__(**kwargs)
        self.layers = check_resnet_layers("layers", layers)
        self.width = check_resnet_width("width", width)
        root_width = int(ROOT_WIDTH * self.width)
        policy = self.dtype_policy
        self.conv_root = StdConv(root_width, 7, strides=2, dtype=policy, name="conv_root")
        self.gn_root = _group_norm("gn_root", policy)
        self.stages = [
            ResNetStage(
                num_units,
                root_width * 2**index,
                strides=1 if index == 0 else 2,
                dtype=policy,
                name=f"block{index + 1}",
            )
            for index, num_units in enumerate(self.layers)
        ]

    def build(self, input_shape):
        _check_image_input(self, input_shape)
        self.conv_root.build(input_shape)
        shape = self.conv_root.compute_output_shape(input_shape)
        self.gn_root.build(shape)
        shape = (shape[0], _same_size(shape[1], 2), _same_size(shape[2], 2), shape[3])
        for stage in self.stages:
            stage.build(shape)
            shape = stage.compute_output_shape(shape)
        self.built = True

    def call(self, inputs):
        x = ops.relu(self.gn_root(self.conv_root(inputs)))
        x = ops.max_pool(x, pool_size=3, strides=2, padding="same")
        for stage in self.stages:
            x = stage(x)
        return x

    def compute_output_shape(self, input_shape):
        height, width = feature_map_size(input_shape[1:3], self.layers)
        root_width = int(ROOT_WIDTH * self.width)
        channels = 4 * root_width * 2 ** (len(self.layers) - 1) if self.layers else root_width
        return (input_shape[0], height, width, channels)

    def get_config(self):
        return {**super().get_config(), "layers": self.layers, "width": self.width}


def feature_map_size(image_size, layers):
    """(height, width) of the stem's feature map for images of `image_size`."""
    strides = [2, 2] + [2] * max(len(layers) - 1, 0)
    sizes = []
    for size in image_size:
        for stride in strides:
            size = _same_size(size, stride)
        sizes.append(size)
    return tuple(sizes)


def check_resnet_layers(name, value):
    """Return `value` as a tuple of positive ints, else raise a ValueError."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(
            f"`{name}` must be a sequence of positive integers (units per stage), "
            f"e.g. (3, 4, 9), or () for the root only. Received: {name}={value!r}"
        )
    for units in value:
        if isinstance(units, bool) or not isinstance(units, numbers.Integral) or units <= 0:
            raise ValueError(
                f"`{name}` must be a sequence of positive integers (units per stage), "
                f"e.g. (3, 4, 9), or () for the root only. Received: {name}={value!r}"
            )
    return tuple(int(units) for units in value)


def check_resnet_width(name, value):
    """Return the width multiplier if 64 * value is a positive multiple of 32."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or value <= 0
        or ROOT_WIDTH * value != int(ROOT_WIDTH * value)
        or int(ROOT_WIDTH * value) % GROUP_NORM_GROUPS
    ):
        raise ValueError(
            f"`{name}` must be a positive number such that {ROOT_WIDTH} * {name} is a "
            f"multiple of {GROUP_NORM_GROUPS} (the GroupNorm groups), e.g. 0.5, 1 or 2. "
            f"Received: {name}={value!r}"
        )
    return int(value) if float(value).is_integer() else float(value)


def _group_norm_width(name, value):
    value = positive_int(name, value)
    if value % GROUP_NORM_GROUPS:
        raise ValueError(
            f"`{name}` must be a multiple of {GROUP_NORM_GROUPS} (the GroupNorm groups). "
            f"Received: {name}={value}"
        )
    return value
