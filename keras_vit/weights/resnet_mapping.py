"""Key mapping of the hybrid's ResNet stem for the original checkpoints.

The released hybrid checkpoints of google-research/vision_transformer (e.g.
R50+ViT-B_16.npz) store the ResNet at the top level of the parameter tree,
next to `embedding/` and `Transformer/`, with '/'-joined keys:

    conv_root/kernel                        (7, 7, C, 64 * width)
    gn_root/{scale,bias}
    block{i}/unit{j}/conv{1,2,3}/kernel     (k, k, in, out)
    block{i}/unit{j}/gn{1,2,3}/{scale,bias}
    block{i}/unit{j}/conv_proj/kernel       only where the shortcut projects
    block{i}/unit{j}/gn_proj/{scale,bias}

GroupNorm parameters are (C,) in the linen checkpoints and (1, 1, 1, C) in
the older ones; both are accepted. Some files put everything under a prefix
(`opt/target/`, `params/`); it is found from the `conv_root/kernel` key.
The kernels need no transposition: StdConv keeps the (h, w, in, out) layout
and standardises the stored kernel in every call, as the original does.
"""

import re

import keras
import numpy as np

ROOT_KEY = "conv_root/kernel"
# The keys of the ResNet part of a checkpoint, after the prefix.
RESNET_KEY = re.compile(r"(conv_root|gn_root)/|block\d+/unit\d+/")


def find_prefix(params):
    """The prefix in front of the ResNet keys of `params`, or None if none."""
    if ROOT_KEY in params:
        return ""
    for key in params:
        if key.endswith("/" + ROOT_KEY):
            return key[: -len(ROOT_KEY)]
    return None


def map_resnet(layer, params, prefix=None):
    """Pair each weight of a ResNetStem with its checkpoint array.

    Nothing is assigned: the caller assigns once every part of the model has
    been checked, so a failed load leaves the model untouched.

    Args:
        layer: a built `keras_vit.layers.ResNetStem` (the model's "resnet").
        params: a mapping from '/'-joined keys to arrays (an opened .npz).
        prefix: the prefix of the ResNet keys, e.g. "opt/target/"; None finds
            it from the `conv_root/kernel` key.

    Returns:
        (pairs, used): `pairs` a list of (keras variable, numpy array, key)
        with arrays already in the variable's shape, `used` the set of
        checkpoint keys consumed.

    Raises:
        ValueError: when ResNet keys are missing (all of them are listed) or
            an array's shape does not fit (the key and both shapes named).
    """
    if prefix is None:
        prefix = find_prefix(params)
        if prefix is None:
            raise ValueError(
                "The model has a ResNet stem (resnet_layers is set) but the checkpoint has "
                f"no ResNet weights: no key '{ROOT_KEY}' (under any prefix). Build the "
                "model with resnet_layers=None for a plain ViT checkpoint."
            )
    pairs = []
    missing = []

    def add(variable, key, group_norm=False):
        full_key = prefix + key
        if full_key not in params:
            missing.append(full_key)
            return
        stored = np.asarray(params[full_key])
        array = stored
        expected = tuple(variable.shape)
        if group_norm and stored.ndim == 4 and stored.shape[:3] == (1, 1, 1):
            array = stored.reshape(stored.shape[3:])
        if tuple(array.shape) != expected:
            raise ValueError(
                f"Shape mismatch for checkpoint key '{full_key}' -> model weight "
                f"'{variable.path}': the checkpoint has {tuple(stored.shape)}, "
                f"the model expects {expected}. Check resnet_layers, resnet_width and "
                "num_channels against the checkpoint's architecture."
            )
        pairs.append((variable, array, full_key))

    for variable, key in _variables_and_keys(layer):
        add(variable, key, group_norm=key.endswith(("/scale", "/bias")))
    used = {key for _, _, key in pairs}
    if missing:
        unused = sorted(
            key
            for key in params
            if key not in used and RESNET_KEY.match(key[len(prefix) :]) and key.startswith(prefix)
        )
        raise ValueError(
            f"The checkpoint lacks {len(missing)} weight(s) of the model's ResNet stem "
            f"(resnet_layers={layer.layers}, resnet_width={layer.width}). Missing: "
            f"{', '.join(missing)}. Unused ResNet keys of the checkpoint: "
            f"{', '.join(unused) or 'none'}."
        )
    return pairs, used


def resnet_params(layer, prefix="", group_norm_shape="flat"):
    """The weights of a ResNetStem as a dict in the original checkpoint layout.

    The inverse of `map_resnet`, for writing original-layout files (tests,
    conversion back). `group_norm_shape="4d"` stores GroupNorm parameters
    as (1, 1, 1, C) like the older released files.
    """
    params = {}
    for variable, key in _variables_and_keys(layer):
        array = keras.ops.convert_to_numpy(variable)
        if group_norm_shape == "4d" and array.ndim == 1:
            array = array.reshape(1, 1, 1, -1)
        params[prefix + key] = array
    return params


def _variables_and_keys(layer):
    """(variable, key without prefix) for every weight of a ResNetStem."""
    yield layer.conv_root.kernel, ROOT_KEY
    yield layer.gn_root.gamma, "gn_root/scale"
    yield layer.gn_root.beta, "gn_root/bias"
    for stage_index, stage in enumerate(layer.stages):
        for unit_index, unit in enumerate(stage.units):
            base = f"block{stage_index + 1}/unit{unit_index + 1}/"
            for variable, key in _variables_and_keys_of_unit(unit):
                yield variable, base + key


def _variables_and_keys_of_unit(unit):
    """(variable, key inside the unit) for every weight of a BottleneckUnit."""
    for conv, norm in (
        (unit.conv1, unit.gn1),
        (unit.conv2, unit.gn2),
        (unit.conv3, unit.gn3),
        (unit.conv_proj, unit.gn_proj),
    ):
        if conv is None:
            continue
        yield conv.kernel, f"{conv.name}/kernel"
        yield norm.gamma, f"{norm.name}/scale"
        yield norm.beta, f"{norm.name}/bias"
