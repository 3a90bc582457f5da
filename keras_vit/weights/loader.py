"""`load_weights`: read, map, check everything, then assign."""

import logging

import keras
import numpy as np

from keras_vit.layers._checks import as_pair
from keras_vit.weights.mapping import MAPPERS, checked_pair
from keras_vit.weights.readers import detect_format, read_checkpoint
from keras_vit.weights.resize import METHODS, resize_position_embedding

logger = logging.getLogger("keras_vit.weights")

# The position-embedding resize each layout's reference implementation uses.
RESIZE_METHODS = {"original": "align_corners", "timm": "half_pixel", "hf": "half_pixel"}


def _layer(model, name):
    return model.get_layer(name) if name in {layer.name for layer in model.layers} else None


def _check_model(model):
    """Raise unless `model` is a keras_vit ViT (a Model with its `patch_encoder` layer)."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model built by keras_vit.VisionTransformer or a ViT_* "
            f"constructor. Received: model={model!r} of type {type(model).__name__}"
        )
    from keras_vit.layers import PatchEncoder

    names = [layer.name for layer in model.layers]
    if not isinstance(_layer(model, "patch_encoder"), PatchEncoder):
        raise ValueError(
            "`model` must be a ViT built by keras_vit.VisionTransformer or a ViT_* constructor "
            f"(it has no PatchEncoder layer named 'patch_encoder'). Received: model "
            f"{model.name!r} with layers {names[:8]}"
        )


def _source_grid(num_grid, target_grid, hint, key, no_class_token):
    if num_grid < 1:
        raise ValueError(
            f"The checkpoint's position embedding '{key}' has no grid tokens (at most a "
            "class-token position); the checkpoint is corrupt and cannot be loaded."
        )
    if hint is not None:
        return tuple(hint)
    if num_grid == target_grid[0] * target_grid[1]:
        return tuple(target_grid)
    side = int(round(np.sqrt(num_grid)))
    if side * side != num_grid:
        # A class-token position without a class token looks like a non-square grid.
        why = (
            " (the checkpoint has no class token: if the first position is a class token's, "
            "the class token is missing from the checkpoint)"
            if no_class_token and _is_square_or(num_grid - 1, target_grid)
            else ""
        )
        raise ValueError(
            f"The checkpoint's position embedding '{key}' has {num_grid} grid tokens, which "
            f"is not a square grid and not the model's {tuple(target_grid)}{why}; pass its "
            "grid as `source_grid=(height, width)`."
        )
    return (side, side)


def _is_square_or(num_grid, target_grid):
    side = int(round(np.sqrt(max(num_grid, 0))))
    return num_grid > 0 and (side * side == num_grid or num_grid == target_grid[0] * target_grid[1])


def _linear_pairs(pairs, layer, kernel, bias, key):
    """Pair a Dense layer with a checkpoint (kernel, bias); an absent array (None) is
    already listed as missing by the mapper, and its weight is reported unfilled."""
    if kernel is not None:
        pairs.append(checked_pair(layer.kernel, kernel, key))
    if bias is not None:
        pairs.append(checked_pair(layer.bias, bias, _bias_key(key)))


def _bias_key(key):
    return key.replace("kernel", "bias").replace("weight", "bias")


def load_weights(model, path, source_grid=None, resize_method=None):
    """Load a checkpoint file into a keras_vit model, strictly and all at once.

    Reads the original google-research/vision_transformer `.npz` files (also
    linen names and big_vision's `params/` layout), timm `VisionTransformer`
    and Hugging Face ViT `.safetensors` files. The layout is found from the
    keys. At another resolution the position embedding is resized (see
    `resize_position_embedding`: the original's `scipy.ndimage.zoom(order=1)`
    convention for .npz files, timm's half-pixel bilinear for safetensors,
    unless `resize_method` says otherwise).

    When the checkpoint's head does not fit the model (another
    `num_classes`, or the pre-logits layer dropped), the model's head keeps
    its initial zeros, and this is logged as a warning; a checkpoint's
    pre-logits layer is kept only when the model has `representation_size`.
    Every other checkpoint tensor must find a weight and every other weight
    must be filled, else a ValueError lists the unused and missing keys.
    Nothing is assigned unless everything fits.

    Args:
        model: a model built by `keras_vit.VisionTransformer` or a `ViT_*`.
        path: a .npz or .safetensors file.
        source_grid: (height, width) of the checkpoint's patch grid, needed
            only for a non-square checkpoint loaded at another size.
        resize_method: None (the layout's own), "align_corners" or "half_pixel".

    Returns:
        A dict report: "format", "resized" (None or (source, target) grids),
        "head" ("loaded", "reset" or "absent"), "pre_logits" ("loaded",
        "dropped" or "absent").
    """
    _check_model(model)
    if source_grid is not None:
        source_grid = as_pair("source_grid", source_grid)
    if resize_method is not None and resize_method not in METHODS:
        raise ValueError(
            f"`resize_method` must be None (the layout's own) or one of {METHODS}. "
            f"Received: resize_method={resize_method!r}"
        )
    params = read_checkpoint(path)
    layout = detect_format(params)
    pairs, source, special = MAPPERS[layout](model, params)
    report = {"format": layout, "resized": None, "head": "absent", "pre_logits": "absent"}
    missing = list(source.missing)
    unused_extra = []

    encoder = model.get_layer("patch_encoder")
    # Class token.
    if encoder.class_token:
        if "class_token" in special:
            array, key = special["class_token"]
            pairs.append(checked_pair(encoder.cls_token, array, key))
        else:
            missing.append(f"class token (model weight {encoder.cls_token.path})")
    elif "class_token" in special:
        unused_extra.append(
            special["class_token"][1] + " (the model has pooling='gap', no class token)"
        )
    # Position embedding, resized to the model's grid.
    if "position_embedding" in special:
        array, key = special["position_embedding"]
        target = encoder.position_embedding.shape
        if array.ndim != 3 or array.shape[0] != 1 or array.shape[2] != target[2]:
            raise ValueError(
                f"Shape mismatch for checkpoint key '{key}': the checkpoint has "
                f"{tuple(array.shape)}, the model expects (1, tokens, {target[2]})."
            )
        ckpt_prefix = 1 if "class_token" in special else 0
        grid = _source_grid(
            array.shape[1] - ckpt_prefix,
            encoder.grid_size,
            source_grid,
            key,
            no_class_token=encoder.class_token and not ckpt_prefix,
        )
        method = resize_method or RESIZE_METHODS[layout]
        resized = resize_position_embedding(array, grid, encoder.grid_size, ckpt_prefix, method)
        if grid != tuple(encoder.grid_size):
            report["resized"] = (grid, tuple(encoder.grid_size))
            logger.warning(
                "Resized the position embedding from a %s grid to %s (%s).",
                grid,
                tuple(encoder.grid_size),
                method,
            )
        # A class-token position the model has no use for: the class token itself
        # is reported as unused below.
        if ckpt_prefix > encoder.num_prefix_tokens:
            resized = resized[:, ckpt_prefix - encoder.num_prefix_tokens :]
        pairs.append(checked_pair(encoder.position_embedding, resized, key))
    # Pre-logits and head.
    pre_logits, head = _layer(model, "pre_logits"), _layer(model, "head")
    head_ok = True
    if pre_logits is not None:
        if "pre_logits" not in special:
            missing.append(f"pre_logits (model weight {pre_logits.kernel.path})")
        else:
            _linear_pairs(pairs, pre_logits, *special["pre_logits"])
            report["pre_logits"] = "loaded"
    elif "pre_logits" in special:
        report["pre_logits"] = "dropped"
        head_ok = False
        logger.warning(
            "Dropped the checkpoint's pre-logits layer (the model has no representation_size)."
        )
    if head is not None:
        kernel = special["head"][0] if "head" in special else None
        if head_ok and kernel is not None and kernel.shape[:1] != tuple(head.kernel.shape[:1]):
            # Another number of classes resets the head; another input width is a
            # checkpoint of another architecture (or a corrupt one), never a reset.
            checked_pair(head.kernel, kernel, special["head"][2])
        if (
            "head" in special
            and head_ok
            and (kernel is None or tuple(kernel.shape) == tuple(head.kernel.shape))
        ):
            _linear_pairs(pairs, head, *special["head"])
            report["head"] = "loaded"
        else:
            report["head"] = "reset"
            found = tuple(kernel.shape) if kernel is not None else "no head"
            logger.warning(
                "The head was not loaded (checkpoint head %s, model head %s%s); it keeps its "
                "initial zeros, to be fine-tuned.",
                found,
                tuple(head.kernel.shape),
                "" if head_ok else ", pre-logits dropped",
            )
    elif "head" in special:
        logger.warning("Dropped the checkpoint's head (the model has num_classes=0).")

    # Strictness: every special key was consumed by the mapper already; what the
    # mapper did not take is unused.
    unused = sorted(set(params) - source.used) + unused_extra
    filled = {id(variable) for variable, _, _ in pairs}
    skipped = set()
    if head is not None and report["head"] == "reset":
        skipped = {id(head.kernel), id(head.bias)}
    unfilled = [v.path for v in model.weights if id(v) not in filled and id(v) not in skipped]
    if missing or unused or unfilled:
        raise ValueError(
            f"The checkpoint {path} ({layout} layout) does not fit the model "
            f"'{model.name}'. Missing checkpoint keys: {', '.join(missing) or 'none'}. "
            f"Unused checkpoint keys: {', '.join(unused) or 'none'}. "
            f"Model weights left unfilled: {', '.join(unfilled) or 'none'}. "
            "Nothing was loaded."
        )
    # Every array is already checked and cast (checked_pair): the assignment cannot fail
    # half-way.
    for variable, array, _ in pairs:
        variable.assign(array)
    return report
