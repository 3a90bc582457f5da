"""Checkpoint readers: a file -> a flat dict of numpy arrays, no pickle."""

import json
import os
import struct
import zipfile
import zlib

import numpy as np

from keras_vit.layers._checks import path_like

PICKLE_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".pkl")


def read_checkpoint(path):
    """Read an .npz or .safetensors checkpoint into {key: numpy array}.

    `.npz` files are read with `allow_pickle=False`; their keys are the
    '/'-joined parameter paths of the original code. A `params/` prefix
    (big_vision) is removed, and a scanned encoder (big_vision's
    `Transformer/encoderblock/...` with a leading depth axis) is split into
    `encoderblock_{i}`.

    Raises:
        FileNotFoundError: when `path` does not exist.
        ValueError: for a folder, a pickle-based or unknown format, or a
            truncated or corrupt file (the file is named).
    """
    path = path_like("path", path)
    if os.path.isdir(path):
        raise ValueError(
            f"`path` must be a checkpoint file (.npz or .safetensors), not a folder. "
            f"Received: path={path!r} (a folder)"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No such checkpoint file: {path}")
    lower = path.lower()
    if lower.endswith(PICKLE_SUFFIXES):
        raise ValueError(
            f"Cannot read {path}: PyTorch pickle files are not loaded (unpickling can run "
            "arbitrary code). Convert it to safetensors first, e.g. "
            "`safetensors.torch.save_file(torch.load(path, weights_only=True), "
            "'model.safetensors')`, and load the .safetensors file."
        )
    if lower.endswith(".npz"):
        params = _read_npz(path)
    elif lower.endswith(".safetensors"):
        params = _read_safetensors(path)
    else:
        raise ValueError(
            "Unknown checkpoint format: expected a .npz or .safetensors file. "
            f"Received: path={path!r}"
        )
    return normalize_keys(params)


def _read_npz(path):
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: np.asarray(npz[key]) for key in npz.files}
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as error:
        raise ValueError(
            f"Cannot read the checkpoint {path}: the file is truncated or corrupt "
            f"(not a valid .npz archive: {error})"
        ) from None


def _read_safetensors(path):
    from safetensors.numpy import load_file

    try:
        return dict(load_file(path))
    except Exception as error:  # safetensors raises its own SafetensorError
        raise ValueError(
            f"Cannot read the checkpoint {path}: the file is truncated or corrupt "
            f"(not a valid .safetensors file: {error})"
        ) from None


def normalize_keys(params):
    """Strip a common `params/` prefix and unstack a scanned encoder."""
    if params and all(key.startswith("params/") for key in params):
        params = {key[len("params/") :]: value for key, value in params.items()}
    scanned = "Transformer/encoderblock/"
    if any(key.startswith(scanned) for key in params):
        unstacked = {}
        for key, value in params.items():
            if key.startswith(scanned):
                rest = key[len(scanned) :]
                for index in range(value.shape[0]):
                    unstacked[f"Transformer/encoderblock_{index}/{rest}"] = value[index]
            else:
                unstacked[key] = value
        params = unstacked
    return params


def detect_format(params):
    """'original', 'timm' or 'hf' from the keys of a checkpoint."""
    keys = set(params)
    if "embedding/kernel" in keys or any(k.startswith("Transformer/") for k in keys):
        return "original"
    if "patch_embed.proj.weight" in keys:
        return "timm"
    if any(k.endswith("embeddings.patch_embeddings.projection.weight") for k in keys):
        return "hf"
    sample = ", ".join(sorted(keys)[:5])
    raise ValueError(
        "Unknown checkpoint layout: expected the original ViT keys (embedding/kernel, "
        "Transformer/...), timm keys (patch_embed.proj.weight, blocks.N...) or Hugging Face "
        f"keys (vit.embeddings...). Received keys such as: {sample}"
    )


def is_complete(path):
    """Whether a .npz / .safetensors file is whole, from its structure alone (cheap).

    A .npz (zip) file must end with its central directory, and a .safetensors
    file must be as long as its header says. A download cut short fails this,
    whether or not the server sent a Content-Length. Other suffixes: True.
    """
    lower = path.lower()
    try:
        if lower.endswith(".npz"):
            with zipfile.ZipFile(path) as archive:
                return bool(archive.namelist())
        if lower.endswith(".safetensors"):
            size = os.path.getsize(path)
            with open(path, "rb") as handle:
                (header_size,) = struct.unpack("<Q", handle.read(8))
                if header_size > size - 8:
                    return False
                header = json.loads(handle.read(header_size))
            ends = [
                entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"
            ]
            return size == 8 + header_size + max(ends, default=0)
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
        struct.error,
        zipfile.BadZipFile,
    ):
        return False
    return True
