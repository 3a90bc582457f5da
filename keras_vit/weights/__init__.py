"""Checkpoint loading: readers, key mapping, position-embedding resize, presets.

load_weights(model, path)           a local .npz / .safetensors file
resolve(name)                       a preset name -> a local (cached) file
resize_position_embedding(...)      the 2-D grid resize of a position embedding
infer_config(path)                  VisionTransformer arguments from a checkpoint
"""

import difflib
import os

from keras_vit.weights.inference import infer_config
from keras_vit.weights.loader import load_weights
from keras_vit.weights.presets import PRESETS
from keras_vit.weights.readers import read_checkpoint
from keras_vit.weights.resize import resize_position_embedding

__all__ = [
    "PRESETS",
    "infer_config",
    "load_weights",
    "read_checkpoint",
    "resize_position_embedding",
    "resolve",
]


def resolve(weights):
    """Return a local file for a preset name (downloading it once into the cache).

    The file goes through `keras.utils.get_file` into
    `~/.keras/keras_vit/` (or `$KERAS_HOME/keras_vit/`), with a progress bar,
    and is verified against the preset's sha256 when one is recorded. A file
    already in the cache is not downloaded again.

    Raises:
        ValueError: for a name that is neither a file nor a preset (close
            matches are listed).
    """
    if isinstance(weights, (str, os.PathLike)) and os.path.isfile(weights):
        return os.fspath(weights)
    if not isinstance(weights, str) or weights not in PRESETS:
        close = difflib.get_close_matches(str(weights), list(PRESETS), n=5, cutoff=0.5)
        hint = f" Close matches: {', '.join(close)}." if close else ""
        raise ValueError(
            "`weights` must be None, an existing checkpoint file or a known preset name "
            f"(see keras_vit.weights.PRESETS).{hint} Received: weights={weights!r} "
            "(no such file, and no preset of that name)"
        )
    import keras

    preset = PRESETS[weights]
    url = preset["url"]
    file_name = f"{weights}-{os.path.basename(url)}"
    return keras.utils.get_file(
        fname=file_name,
        origin=url,
        cache_dir=os.environ.get("KERAS_HOME"),  # None: ~/.keras
        cache_subdir="keras_vit",
        file_hash=preset.get("sha256"),
        hash_algorithm="sha256",
    )
