"""Key mapping: one function per checkpoint layout (original npz, timm, Hugging Face).

Each mapper takes a built keras_vit model and a flat {key: array} dict and
returns `(pairs, used)`: `pairs` a list of (keras variable, numpy array in
the variable's shape, checkpoint key), `used` the set of checkpoint keys it
consumed. Nothing is assigned here. Missing keys are collected (all of them
are reported together by the loader); a shape that does not fit raises at
once, naming the key and both shapes.

The model's class token, position embedding, pre-logits and head are handled
by the loader (resizing, resetting); the mappers only return them as
"special" entries so the loader can decide.
"""

import numpy as np


class Source:
    """A checkpoint being read: records used and missing keys."""

    def __init__(self, params):
        self.params = params
        self.used = set()
        self.missing = []

    def has(self, key):
        return key in self.params

    def take(self, key, shape=None):
        """The array at `key` (checked against `shape` if given), or None if absent."""
        if key not in self.params:
            self.missing.append(key)
            return None
        self.used.add(key)
        array = np.asarray(self.params[key])
        if shape is not None and tuple(array.shape) != tuple(shape):
            raise ValueError(
                f"Shape mismatch for checkpoint key '{key}': the checkpoint has "
                f"{tuple(array.shape)}, the model expects {tuple(shape)}. Build the model "
                "with the checkpoint's architecture (hidden_dim, num_heads, mlp_dim, "
                "patch_size, num_channels)."
            )
        return array


def _is_numeric(dtype):
    """Real numbers: numpy's floats and integers, and ml_dtypes' bfloat16 / float8."""
    return dtype.kind in "fiu" or dtype.name.startswith(("bfloat16", "float8", "float6", "float4"))


def checked_pair(variable, array, key):
    """(variable, array cast to the variable's dtype, key), checked before anything is assigned.

    A ValueError names the key when the shapes differ (both shapes), when the
    array does not hold real numbers (strings, booleans, complex numbers), or
    when it holds NaN or infinite values: all of these would otherwise fail or
    load silently wrong weights during the assignment.
    """
    array = np.asarray(array)
    if tuple(array.shape) != tuple(variable.shape):
        raise ValueError(
            f"Shape mismatch for checkpoint key '{key}' -> model weight '{variable.path}': "
            f"the checkpoint has {tuple(array.shape)}, the model expects "
            f"{tuple(variable.shape)}."
        )
    if not _is_numeric(array.dtype):
        raise ValueError(
            f"Checkpoint key '{key}' -> model weight '{variable.path}' must hold real numbers "
            f"(a float or integer array). Received: an array of dtype {array.dtype}"
        )
    array = array.astype(variable.dtype, copy=False)
    finite = np.isfinite(array)
    if not finite.all():
        raise ValueError(
            f"Checkpoint key '{key}' -> model weight '{variable.path}' holds "
            f"{array.size - int(np.count_nonzero(finite))} NaN or infinite value(s) (as "
            f"{variable.dtype}); the checkpoint is corrupt or was saved from a diverged run."
        )
    return (variable, array, key)


def _put(pairs, variable, array, key):
    if array is not None:
        pairs.append(checked_pair(variable, array, key))


def _blocks(model):
    blocks = []
    while True:
        name = f"transformer_block_{len(blocks)}"
        if name not in {layer.name for layer in model.layers}:
            return blocks
        blocks.append(model.get_layer(name))


def _block_dims(block):
    attention = block.attention
    return attention.hidden_dim, attention.num_heads, attention.head_dim, block.mlp.mlp_dim


def _cat(*arrays):
    if any(a is None for a in arrays):
        return None
    return np.concatenate(arrays, axis=-1)


def _count_blocks(params, pattern):
    count = 0
    while any(key.startswith(pattern.format(count)) for key in params):
        count += 1
    return count


def _check_depth(model, source, pattern):
    depth = len(_blocks(model))
    found = _count_blocks(source.params, pattern)
    if found != depth:
        raise ValueError(
            f"The checkpoint has {found} transformer blocks, the model {depth}. "
            f"Build the model with num_layers={found}."
        )


# Each mapper fills `special` with the raw arrays the loader post-processes:
# "class_token" (1, 1, D), "position_embedding" (1, T, D), "pre_logits" and
# "head" as (kernel (in, out), bias, key) tuples.


def map_original(model, params):
    """The original google-research/vision_transformer (and big_vision) npz layout."""
    source = Source(params)
    pairs = []
    special = {}
    encoder = model.get_layer("patch_encoder")
    _put(
        pairs,
        encoder.kernel,
        source.take("embedding/kernel", encoder.kernel.shape),
        "embedding/kernel",
    )
    _put(pairs, encoder.bias, source.take("embedding/bias", encoder.bias.shape), "embedding/bias")
    if source.has("cls"):
        special["class_token"] = (source.take("cls"), "cls")
    for key in ("Transformer/posembed_input/pos_embedding", "pos_embedding"):
        if source.has(key):
            special["position_embedding"] = (source.take(key), key)
            break
    else:
        source.missing.append("Transformer/posembed_input/pos_embedding")
    _check_depth(model, source, "Transformer/encoderblock_{}/")
    for index, block in enumerate(_blocks(model)):
        base = f"Transformer/encoderblock_{index}/"
        dim, heads, head_dim, mlp_dim = _block_dims(block)
        if source.has(base + "MlpBlock_3/Dense_0/kernel"):  # pre-linen names
            norm1, attn, norm2, mlp = (
                "LayerNorm_0",
                "MultiHeadDotProductAttention_1",
                "LayerNorm_2",
                "MlpBlock_3",
            )
        else:  # linen names
            norm1, attn, norm2, mlp = (
                "LayerNorm_0",
                "MultiHeadDotProductAttention_0",
                "LayerNorm_1",
                "MlpBlock_0",
            )
        for layer, name in ((block.norm1, norm1), (block.norm2, norm2)):
            _put(
                pairs,
                layer.gamma,
                source.take(f"{base}{name}/scale", (dim,)),
                f"{base}{name}/scale",
            )
            _put(pairs, layer.beta, source.take(f"{base}{name}/bias", (dim,)), f"{base}{name}/bias")
        a = f"{base}{attn}/"
        kernels = [
            source.take(f"{a}{p}/kernel", (dim, heads, head_dim)) for p in ("query", "key", "value")
        ]
        biases = [source.take(f"{a}{p}/bias", (heads, head_dim)) for p in ("query", "key", "value")]
        qkv = block.attention.qkv
        if all(k is not None for k in kernels):
            _put(
                pairs,
                qkv.kernel,
                _cat(*[k.reshape(dim, dim) for k in kernels]),
                f"{a}{{query,key,value}}/kernel",
            )
        if all(b is not None for b in biases):
            _put(
                pairs,
                qkv.bias,
                _cat(*[b.reshape(dim) for b in biases]),
                f"{a}{{query,key,value}}/bias",
            )
        proj = block.attention.proj
        out = source.take(f"{a}out/kernel", (heads, head_dim, dim))
        _put(pairs, proj.kernel, None if out is None else out.reshape(dim, dim), f"{a}out/kernel")
        _put(pairs, proj.bias, source.take(f"{a}out/bias", (dim,)), f"{a}out/bias")
        for dense, name, shape in (
            (block.mlp.fc1, "Dense_0", (dim, mlp_dim)),
            (block.mlp.fc2, "Dense_1", (mlp_dim, dim)),
        ):
            key = f"{base}{mlp}/{name}/"
            _put(pairs, dense.kernel, source.take(key + "kernel", shape), key + "kernel")
            _put(pairs, dense.bias, source.take(key + "bias", shape[1:]), key + "bias")
    norm = model.get_layer("encoder_norm")
    _put(
        pairs,
        norm.gamma,
        source.take("Transformer/encoder_norm/scale", norm.gamma.shape),
        "Transformer/encoder_norm/scale",
    )
    _put(
        pairs,
        norm.beta,
        source.take("Transformer/encoder_norm/bias", norm.beta.shape),
        "Transformer/encoder_norm/bias",
    )
    for name in ("pre_logits", "head"):
        if source.has(f"{name}/kernel"):
            special[name] = (
                source.take(f"{name}/kernel"),
                source.take(f"{name}/bias"),
                f"{name}/kernel",
            )
    if "resnet" in {layer.name for layer in model.layers}:
        try:
            from keras_vit.weights import resnet_mapping
        except ImportError as error:
            raise ValueError(
                "hybrid checkpoints need keras_vit.weights.resnet_mapping, which could not be "
                f"imported: {error}"
            ) from None
        resnet_pairs, resnet_used = resnet_mapping.map_resnet(model.get_layer("resnet"), params)
        pairs.extend(checked_pair(variable, array, key) for variable, array, key in resnet_pairs)
        source.used |= set(resnet_used)
    return pairs, source, special


def _torch_linear(source, prefix, in_dim, out_dim):
    """(kernel (in, out), bias) of a torch Linear stored as weight (out, in)."""
    weight = source.take(prefix + "weight", (out_dim, in_dim))
    bias = source.take(prefix + "bias", (out_dim,))
    return (None if weight is None else weight.T), bias


def _put_linear(pairs, dense, source, prefix, in_dim, out_dim):
    kernel, bias = _torch_linear(source, prefix, in_dim, out_dim)
    _put(pairs, dense.kernel, kernel, prefix + "weight")
    _put(pairs, dense.bias, bias, prefix + "bias")


def _put_norm(pairs, norm, source, prefix, dim):
    _put(pairs, norm.gamma, source.take(prefix + "weight", (dim,)), prefix + "weight")
    _put(pairs, norm.beta, source.take(prefix + "bias", (dim,)), prefix + "bias")


def _put_patch_conv(pairs, encoder, source, key):
    ph, pw, channels, dim = encoder.kernel.shape
    weight = source.take(key + "weight", (dim, channels, ph, pw))
    _put(
        pairs,
        encoder.kernel,
        None if weight is None else weight.transpose(2, 3, 1, 0),
        key + "weight",
    )
    _put(pairs, encoder.bias, source.take(key + "bias", (dim,)), key + "bias")


def _linear_special(source, prefix):
    weight = source.take(prefix + "weight")
    return (weight.T, source.take(prefix + "bias"), prefix + "weight")


def map_timm(model, params):
    """A timm `VisionTransformer` state dict (saved as safetensors)."""
    source = Source(params)
    pairs = []
    special = {}
    _no_hybrid(model, "timm")
    encoder = model.get_layer("patch_encoder")
    _put_patch_conv(pairs, encoder, source, "patch_embed.proj.")
    if source.has("cls_token"):
        special["class_token"] = (source.take("cls_token"), "cls_token")
    if source.has("pos_embed"):
        special["position_embedding"] = (source.take("pos_embed"), "pos_embed")
    else:
        source.missing.append("pos_embed")
    _check_depth(model, source, "blocks.{}.")
    for index, block in enumerate(_blocks(model)):
        base = f"blocks.{index}."
        dim, _, _, mlp_dim = _block_dims(block)
        _put_norm(pairs, block.norm1, source, base + "norm1.", dim)
        _put_linear(pairs, block.attention.qkv, source, base + "attn.qkv.", dim, 3 * dim)
        _put_linear(pairs, block.attention.proj, source, base + "attn.proj.", dim, dim)
        _put_norm(pairs, block.norm2, source, base + "norm2.", dim)
        _put_linear(pairs, block.mlp.fc1, source, base + "mlp.fc1.", dim, mlp_dim)
        _put_linear(pairs, block.mlp.fc2, source, base + "mlp.fc2.", mlp_dim, dim)
    if source.has("fc_norm.weight") and not source.has("norm.weight"):
        raise ValueError(
            "This timm checkpoint applies its final LayerNorm after pooling (fc_norm); "
            "keras_vit follows the original ViT and normalises before pooling, so it cannot "
            "be loaded exactly. Use a checkpoint saved with fc_norm=False."
        )
    norm = model.get_layer("encoder_norm")
    _put_norm(pairs, norm, source, "norm.", norm.gamma.shape[0])
    for name, prefix in (("pre_logits", "pre_logits.fc."), ("head", "head.")):
        if source.has(prefix + "weight"):
            special[name] = _linear_special(source, prefix)
    return pairs, source, special


def map_hf(model, params):
    """A Hugging Face transformers ViT (`ViTForImageClassification` or `ViTModel`)."""
    root = "vit." if any(k.startswith("vit.") for k in params) else ""
    source = Source(params)
    pairs = []
    special = {}
    _no_hybrid(model, "Hugging Face")
    encoder = model.get_layer("patch_encoder")
    emb = root + "embeddings."
    _put_patch_conv(pairs, encoder, source, emb + "patch_embeddings.projection.")
    if source.has(emb + "cls_token"):
        special["class_token"] = (source.take(emb + "cls_token"), emb + "cls_token")
    if source.has(emb + "position_embeddings"):
        special["position_embedding"] = (
            source.take(emb + "position_embeddings"),
            emb + "position_embeddings",
        )
    else:
        source.missing.append(emb + "position_embeddings")
    _check_depth(model, source, root + "encoder.layer.{}.")
    for index, block in enumerate(_blocks(model)):
        base = f"{root}encoder.layer.{index}."
        dim, _, _, mlp_dim = _block_dims(block)
        _put_norm(pairs, block.norm1, source, base + "layernorm_before.", dim)
        kernels, biases = [], []
        for part in ("query", "key", "value"):
            kernel, bias = _torch_linear(source, f"{base}attention.attention.{part}.", dim, dim)
            kernels.append(kernel)
            biases.append(bias)
        qkv = block.attention.qkv
        _put(pairs, qkv.kernel, _cat(*kernels), base + "attention.attention.{query,key,value}")
        _put(pairs, qkv.bias, _cat(*biases), base + "attention.attention.{query,key,value}")
        _put_linear(pairs, block.attention.proj, source, base + "attention.output.dense.", dim, dim)
        _put_norm(pairs, block.norm2, source, base + "layernorm_after.", dim)
        _put_linear(pairs, block.mlp.fc1, source, base + "intermediate.dense.", dim, mlp_dim)
        _put_linear(pairs, block.mlp.fc2, source, base + "output.dense.", mlp_dim, dim)
    norm = model.get_layer("encoder_norm")
    _put_norm(pairs, norm, source, root + "layernorm.", norm.gamma.shape[0])
    for name, prefix in (("pre_logits", root + "pooler.dense."), ("head", "classifier.")):
        if source.has(prefix + "weight"):
            special[name] = _linear_special(source, prefix)
    return pairs, source, special


def _no_hybrid(model, layout):
    if "resnet" in {layer.name for layer in model.layers}:
        raise ValueError(
            f"The model is a hybrid (it has a ResNet stem) but this is a {layout} checkpoint "
            "of a plain ViT; only original-layout .npz hybrid checkpoints are supported."
        )


MAPPERS = {"original": map_original, "timm": map_timm, "hf": map_hf}
