"""The VisionTransformer builder, the variants table and the ViT_* constructors."""

import numbers
import os

import keras

from keras_vit.layers import LayerNorm, PatchEncoder, TokenPooling, TransformerBlock
from keras_vit.layers._checks import as_pair, boolean, one_of, positive_int
from keras_vit.layers._checks import rate as check_rate
from keras_vit.layers.pooling import POOLINGS
from keras_vit.layers.resnet import (
    ResNetStem,
    check_resnet_layers,
    check_resnet_width,
    feature_map_size,
)
from keras_vit.layers.transformer import LAYER_NORM_EPSILON

# name -> architecture, as in the paper (Table 1) and the original configs.
VARIANTS = {
    "ViT_Ti16": dict(patch_size=16, hidden_dim=192, mlp_dim=768, num_heads=3, num_layers=12),
    "ViT_S16": dict(patch_size=16, hidden_dim=384, mlp_dim=1536, num_heads=6, num_layers=12),
    "ViT_S32": dict(patch_size=32, hidden_dim=384, mlp_dim=1536, num_heads=6, num_layers=12),
    "ViT_B8": dict(patch_size=8, hidden_dim=768, mlp_dim=3072, num_heads=12, num_layers=12),
    "ViT_B16": dict(patch_size=16, hidden_dim=768, mlp_dim=3072, num_heads=12, num_layers=12),
    "ViT_B32": dict(patch_size=32, hidden_dim=768, mlp_dim=3072, num_heads=12, num_layers=12),
    "ViT_L16": dict(patch_size=16, hidden_dim=1024, mlp_dim=4096, num_heads=16, num_layers=24),
    "ViT_L32": dict(patch_size=32, hidden_dim=1024, mlp_dim=4096, num_heads=16, num_layers=24),
    "ViT_H14": dict(patch_size=14, hidden_dim=1280, mlp_dim=5120, num_heads=16, num_layers=32),
    # The hybrid: B/16's transformer on 1x1 patches of the R50 feature map (stride 16).
    "ViT_R50_B16": dict(
        patch_size=1,
        hidden_dim=768,
        mlp_dim=3072,
        num_heads=12,
        num_layers=12,
        resnet_layers=(3, 4, 9),
    ),
}


def _check_dtype(dtype):
    """Raise a ValueError unless `dtype` is None or a float dtype (policy) name."""
    if dtype is None:
        return
    expected = (
        "`dtype` must be None, a float dtype such as 'float32' or 'bfloat16', or a "
        "dtype policy such as 'mixed_bfloat16' or 'mixed_float16'."
    )
    try:
        policy = keras.dtype_policies.get(dtype)
    except (TypeError, ValueError):
        raise ValueError(f"{expected} Received: dtype={dtype!r}") from None
    if getattr(policy, "quantization_mode", None) is not None or not str(
        policy.compute_dtype
    ).startswith(("float", "bfloat")):
        raise ValueError(
            f"{expected} Received: dtype={dtype!r} (computing in {policy.compute_dtype}"
            + (
                f", quantized {policy.quantization_mode}: quantize a built float model "
                "with model.quantize() instead)"
                if getattr(policy, "quantization_mode", None) is not None
                else ")"
            )
        )


def _check_activation(classifier_activation):
    """Raise a ValueError unless Keras knows `classifier_activation` (None: logits)."""
    if classifier_activation is None:
        return
    try:
        keras.activations.get(classifier_activation)
    except (TypeError, ValueError):
        raise ValueError(
            "`classifier_activation` must be None (logits), the name of a Keras activation "
            "such as 'softmax' or 'sigmoid', or a callable. "
            f"Received: classifier_activation={classifier_activation!r}"
        ) from None


def _is_mixed(dtype):
    policy = keras.dtype_policies.get(dtype) if dtype is not None else keras.config.dtype_policy()
    return policy.compute_dtype != policy.variable_dtype


def _check_weights_argument(weights):
    """Return a local file for `weights`, or None; raise on anything else."""
    if weights is None:
        return None
    if not isinstance(weights, (str, os.PathLike)):
        raise TypeError(
            "`weights` must be None, a path to a checkpoint file or a preset name. "
            f"Received: weights={weights!r} of type {type(weights).__name__}"
        )
    if os.path.isfile(weights):
        return os.fspath(weights)
    from keras_vit import weights as weights_module

    return weights_module.resolve(weights)


def VisionTransformer(
    image_size=224,
    patch_size=16,
    num_layers=12,
    num_heads=12,
    hidden_dim=768,
    mlp_dim=3072,
    num_classes=1000,
    pooling="token",
    representation_size=None,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    drop_path_rate=0.0,
    classifier_activation=None,
    approximate_gelu=False,
    remat=False,
    num_channels=3,
    resnet_layers=None,
    resnet_width=1,
    dynamic_image_size=False,
    weights=None,
    dtype=None,
    name="vision_transformer",
):
    """Builds a Vision Transformer as a functional `keras.Model`.

    The model takes NHWC float images scaled to [-1, 1] (see
    `keras_vit.preprocess_inputs`) and returns logits (or
    `classifier_activation` of them), or the pooled features when
    `num_classes=0`.

    Reference: Dosovitskiy et al., "An Image is Worth 16x16 Words:
    Transformers for Image Recognition at Scale", ICLR 2021.

    Args:
        image_size: int or (height, width) of the input images.
        patch_size: int or (height, width) of a patch (on the ResNet feature
            map for a hybrid).
        num_layers: number of transformer blocks.
        num_heads: attention heads per block; must divide `hidden_dim`.
        hidden_dim: token width D.
        mlp_dim: width of the MLP's hidden layer.
        num_classes: size of the classification head; 0 for no head.
        pooling: "token" (class token) or "gap" (mean of all tokens after
            the final LayerNorm, no class token).
        representation_size: width of the optional pre-logits layer
            (Dense + tanh) of the ImageNet-21k checkpoints; None for none.
        dropout_rate: dropout after the embedding, the attention projection
            and in the MLPs.
        attention_dropout_rate: dropout on the attention weights.
        drop_path_rate: stochastic depth of the last block; block i gets
            drop_path_rate * i / (num_layers - 1).
        classifier_activation: activation of the head; None gives logits.
        approximate_gelu: tanh-approximate GELU as in the original Flax code
            (True) or exact erf GELU as in timm and Hugging Face (False).
        remat: gradient checkpointing of every transformer block: training
            keeps each block's input only and recomputes the rest in the
            backward pass (same numbers; at ViT-S/16 224 and ViT-B/16 batch 8
            the peak training memory drops from ~2.2 to ~1.95 and from ~3.4
            to ~2.9 GB, for ~15-20% less speed on a 2-core CPU;
            docs/performance.md).
        num_channels: channels of the input images.
        resnet_layers: None for a plain ViT; for a hybrid, the number of
            bottleneck units per ResNet-v2 stage, e.g. (3, 4, 9); () keeps
            only the root.
        resnet_width: width multiplier of the hybrid's ResNet (stage i has
            bottleneck width 64 * resnet_width * 2**i); 64 * resnet_width
            must be a multiple of 32, the GroupNorm groups.
        dynamic_image_size: False: the model takes images of `image_size`
            only. True: images of any size whose sides are multiples of the
            patch size (the model's input is (None, None, channels)); the
            position embedding, learned for `image_size`, is resized to each
            input's grid of patches, bicubic and antialiased, as timm's
            `dynamic_img_size=True` (at `image_size` the outputs are those of
            the fixed model). In TensorFlow's graph mode, one trace serves
            every size once Keras has relaxed the shapes; XLA compiles once
            per size.
        weights: None, a local checkpoint file (.npz, .safetensors) or a
            preset name.
        dtype: a dtype or dtype policy name such as "mixed_bfloat16". With a
            mixed policy the variables, the softmax, the LayerNorms and the
            logits stay float32.
        name: name of the model.

    Returns:
        A `keras.Model`.

    Example:
    >>> model = VisionTransformer(image_size=32, patch_size=8, num_layers=2,
    ...     num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10)
    >>> model.output_shape
    (None, 10)
    """
    image_size = as_pair("image_size", image_size)
    patch_size = as_pair("patch_size", patch_size)
    num_layers = positive_int("num_layers", num_layers)
    num_heads = positive_int("num_heads", num_heads)
    hidden_dim = positive_int("hidden_dim", hidden_dim)
    mlp_dim = positive_int("mlp_dim", mlp_dim)
    num_channels = positive_int("num_channels", num_channels)
    pooling = one_of("pooling", pooling, POOLINGS)
    dropout_rate = check_rate("dropout_rate", dropout_rate)
    attention_dropout_rate = check_rate("attention_dropout_rate", attention_dropout_rate)
    drop_path_rate = check_rate("drop_path_rate", drop_path_rate)
    if (
        isinstance(num_classes, bool)
        or not isinstance(num_classes, numbers.Integral)
        or num_classes < 0
    ):
        raise ValueError(
            "`num_classes` must be a non-negative integer (0 for no head). "
            f"Received: num_classes={num_classes!r}"
        )
    if representation_size is not None:
        representation_size = positive_int("representation_size", representation_size)
    if hidden_dim % num_heads:
        raise ValueError(
            "`hidden_dim` must be divisible by `num_heads`. "
            f"Received: hidden_dim={hidden_dim}, num_heads={num_heads}"
        )
    if resnet_layers is None and (image_size[0] % patch_size[0] or image_size[1] % patch_size[1]):
        raise ValueError(
            "`image_size` must be divisible by `patch_size`. "
            f"Received: image_size={image_size}, patch_size={patch_size}"
        )
    if resnet_layers is not None:
        resnet_layers = check_resnet_layers("resnet_layers", resnet_layers)
        resnet_width = check_resnet_width("resnet_width", resnet_width)
        feature_size = feature_map_size(image_size, resnet_layers)
        if feature_size[0] % patch_size[0] or feature_size[1] % patch_size[1]:
            raise ValueError(
                "For a hybrid, the ResNet feature map must be divisible by `patch_size`; "
                f"images of {image_size} give a {feature_size} map with "
                f"resnet_layers={resnet_layers}. "
                f"Received: image_size={image_size}, patch_size={patch_size}"
            )
    approximate_gelu = boolean("approximate_gelu", approximate_gelu)
    remat = boolean("remat", remat)
    dynamic_image_size = boolean("dynamic_image_size", dynamic_image_size)
    _check_activation(classifier_activation)
    _check_dtype(dtype)
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a non-empty string. Received: name={name!r}")
    weights_file = _check_weights_argument(weights)
    outer_dtype = "float32" if _is_mixed(dtype) else dtype

    # Layers and functional graph.
    input_size = (None, None) if dynamic_image_size else image_size
    images = keras.Input(shape=(*input_size, num_channels), name="images")
    x = images
    grid = None
    if dynamic_image_size:
        # The position embedding's grid: that of `image_size` (on the ResNet map for a hybrid).
        mapped = (
            image_size if resnet_layers is None else feature_map_size(image_size, resnet_layers)
        )
        grid = (mapped[0] // patch_size[0], mapped[1] // patch_size[1])
    if resnet_layers is not None:
        x = ResNetStem(layers=resnet_layers, width=resnet_width, dtype=dtype, name="resnet")(x)
    x = PatchEncoder(
        patch_size,
        hidden_dim,
        class_token=pooling == "token",
        grid_size=grid,
        dtype=dtype,
        name="patch_encoder",
    )(x)
    x = keras.layers.Dropout(dropout_rate, dtype=dtype, name="embedding_dropout")(x)
    for index in range(num_layers):
        x = TransformerBlock(
            num_heads,
            mlp_dim,
            dropout_rate=dropout_rate,
            attention_dropout_rate=attention_dropout_rate,
            drop_path_rate=drop_path_rate * index / max(num_layers - 1, 1),
            approximate_gelu=approximate_gelu,
            # Only the class token reaches the head: the last block computes it alone.
            first_token_only=pooling == "token" and index == num_layers - 1,
            remat=remat,
            dtype=dtype,
            name=f"transformer_block_{index}",
        )(x)
    x = LayerNorm(epsilon=LAYER_NORM_EPSILON, dtype=outer_dtype, name="encoder_norm")(x)
    x = TokenPooling(pooling, dtype=outer_dtype, name="pooling")(x)
    if representation_size is not None:
        x = keras.layers.Dense(
            representation_size, activation="tanh", dtype=outer_dtype, name="pre_logits"
        )(x)
    if num_classes:
        x = keras.layers.Dense(
            num_classes,
            activation=classifier_activation,
            kernel_initializer="zeros",
            dtype=outer_dtype,
            name="head",
        )(x)
    model = keras.Model(images, x, name=name)

    if weights_file is not None:
        from keras_vit.weights import load_weights

        load_weights(model, weights_file)
    return model


def model_image_size(model):
    """(height, width) of the images `model` was built for.

    Its input's size; for a keras_vit model built with
    `dynamic_image_size=True` (input height and width None), the size its
    position embedding was learned at, where it computes what the fixed
    model computes. ValueError for a model of unknown size that has no
    PatchEncoder to tell it.
    """
    if not isinstance(model, keras.Model) or len(model.inputs) != 1:
        raise ValueError(f"`model` must be a keras.Model with one input. Received: {model!r}")
    if not _takes_any_size(model):
        return tuple(model.inputs[0].shape)[1:3]
    found = _encoder_and_step(model)
    if found is None:
        raise ValueError(
            "`model` takes images of any size and has no single PatchEncoder to tell the size "
            f"it was built for. Received: input shape {tuple(model.inputs[0].shape)}"
        )
    encoder, step = found
    return tuple(cells * pixels for cells, pixels in zip(encoder.grid_size, step))


def _takes_any_size(model):
    """Whether `model`'s image input has an unknown height or width
    (a keras_vit model built with `dynamic_image_size=True`)."""
    return None in tuple(model.inputs[0].shape)[1:3]


def _encoder_and_step(model):
    """(`model`'s PatchEncoder, input pixels per patch: the patch size, times the
    ResNet stem's stride for a hybrid); None without one built PatchEncoder."""
    encoders = [layer for layer in model._flatten_layers() if isinstance(layer, PatchEncoder)]
    if len(encoders) != 1 or encoders[0].grid_size is None:
        return None
    stride = 1
    stems = [layer for layer in model._flatten_layers() if isinstance(layer, ResNetStem)]
    if stems:  # a hybrid: the encoder reads the ResNet's feature map
        probe = 1024  # a multiple of every stride the stem can have
        stride = probe // feature_map_size((probe, probe), stems[0].layers)[0]
    return encoders[0], tuple(patch * stride for patch in encoders[0].patch_size)


def _grid_stride(model):
    """Input pixels per step of `model`'s patch grid, (rows, columns): the patch
    size, times the ResNet stem's stride for a hybrid. Whole pixels except for
    a hybrid whose size is not a multiple of its stride."""
    found = _encoder_and_step(model)
    if found is None:
        raise ValueError(f"`model` must have one PatchEncoder. Received: model {model.name!r}")
    steps = [side / cells for side, cells in zip(model_image_size(model), found[0].grid_size)]
    return tuple(int(step) if step.is_integer() else step for step in steps)


def _variant(
    variant_name, image_size, num_classes, weights, pooling, representation_size, **kwargs
):
    return VisionTransformer(
        image_size=image_size,
        num_classes=num_classes,
        weights=weights,
        pooling=pooling,
        representation_size=representation_size,
        name=variant_name.lower(),
        **VARIANTS[variant_name],
        **kwargs,
    )


_CONSTRUCTOR_DOC = """Builds {name}: patch {patch_size}, width {hidden_dim}, MLP {mlp_dim}, \
{num_heads} heads, {num_layers} layers.

    Args:
        image_size: int or (height, width) of the input images.
        num_classes: size of the head; 0 for no head (features out).
        weights: None, a local checkpoint file (.npz, .safetensors) or a
            preset name.
        pooling: "token" or "gap".
        representation_size: width of the optional pre-logits layer.
        **kwargs: `dropout_rate`, `attention_dropout_rate`, `drop_path_rate`,
            `classifier_activation`, `approximate_gelu`, `dtype` and the other
            arguments of `keras_vit.VisionTransformer`.

    Returns:
        A `keras.Model`.
    """


def _make_constructor(variant_name):
    def constructor(
        image_size=224,
        num_classes=1000,
        weights=None,
        pooling="token",
        representation_size=None,
        **kwargs,
    ):
        return _variant(
            variant_name, image_size, num_classes, weights, pooling, representation_size, **kwargs
        )

    constructor.__name__ = constructor.__qualname__ = variant_name
    architecture = VARIANTS[variant_name]
    constructor.__doc__ = _CONSTRUCTOR_DOC.format(name=variant_name, **architecture)
    if architecture.get("resnet_layers") is not None:
        constructor.__doc__ = constructor.__doc__.replace(
            ": patch",
            f": a ResNet-v2 stem with stages {architecture['resnet_layers']} "
            "(total stride 16), then patch",
            1,
        )
    return constructor


ViT_Ti16 = _make_constructor("ViT_Ti16")
ViT_S16 = _make_constructor("ViT_S16")
ViT_S32 = _make_constructor("ViT_S32")
ViT_B8 = _make_constructor("ViT_B8")
ViT_B16 = _make_constructor("ViT_B16")
ViT_B32 = _make_constructor("ViT_B32")
ViT_L16 = _make_constructor("ViT_L16")
ViT_L32 = _make_constructor("ViT_L32")
ViT_H14 = _make_constructor("ViT_H14")
ViT_R50_B16 = _make_constructor("ViT_R50_B16")
