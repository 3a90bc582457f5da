"""Checkpoint loading: readers, key mapping, position-embedding resize, presets.

load_weights(model, path)           a local .npz / .safetensors file
resolve(name)                       a preset name -> a local (cached) file
resize_position_embedding(...)      the 2-D grid resize of a position embedding
infer_config(path)                  VisionTransformer arguments from a checkpoint
"""

import difflib
import hashlib
import logging
import os
import tempfile

from keras_vit import _leftovers
from keras_vit.weights.inference import infer_config
from keras_vit.weights.loader import load_weights
from keras_vit.weights.presets import PRESETS
from keras_vit.weights.readers import is_complete, read_checkpoint
from keras_vit.weights.resize import resize_position_embedding

logger = logging.getLogger("keras_vit.weights")

__all__ = [
    "PRESETS",
    "infer_config",
    "load_weights",
    "read_checkpoint",
    "resize_position_embedding",
    "resolve",
]


def resolve(weights, argument="weights"):
    """Return a local file for a preset name (downloading it once into the cache).

    `weights` is a checkpoint file (returned as is) or a preset name;
    `argument` is how errors name it (e.g. "SRC" on the command line).

    The file goes through `keras.utils.get_file` (with a progress bar) into
    `~/.keras/keras_vit/` (or `$KERAS_HOME/keras_vit/`; a temporary folder,
    with a warning, when that one cannot be written). It is downloaded under a
    temporary name, checked (against the preset's sha256 when one is
    recorded, and for a whole .npz / .safetensors structure in any case) and
    only then moved to its name in the cache, so a download that fails or is
    cut short leaves nothing that a later call would trust. A file already in
    the cache is checked the same way and not downloaded again.

    Raises:
        ValueError: for a name that is neither a file nor a preset (close
            matches are listed), or a download whose sha256 does not match.
        OSError: when the download fails (HTTP error, no connection, cut
            short); the preset and its URL are named.
    """
    if isinstance(weights, (str, os.PathLike)) and os.path.isfile(weights):
        return os.fspath(weights)
    if not isinstance(weights, str) or weights not in PRESETS:
        close = close_presets(weights)
        hint = f" Close matches: {', '.join(close)}." if close else ""
        what = (
            "a folder, not a checkpoint file"
            if isinstance(weights, (str, os.PathLike)) and os.path.isdir(weights)
            else "no such file, and no preset of that name"
        )
        shown = f"`{argument}`" if argument.isidentifier() and argument.islower() else argument
        raise ValueError(
            f"{shown} must be an existing checkpoint file (.npz or .safetensors) or a known "
            f"preset name (see keras_vit.weights.PRESETS).{hint} Received: "
            f"{argument}={weights!r} ({what})"
        )
    preset = PRESETS[weights]
    url = preset["url"]
    sha256 = preset.get("sha256")
    file_name = f"{weights}-{os.path.basename(url)}"
    base = os.path.expanduser(os.environ.get("KERAS_HOME") or os.path.join("~", ".keras"))
    fallback = os.path.join(tempfile.gettempdir(), ".keras")
    for folder in (base, fallback):
        path = os.path.join(folder, CACHE_SUBDIR, file_name)
        if os.path.isfile(path):
            if _verified(path, sha256):
                return path
            logger.warning("The cached %s is incomplete or corrupt; downloading it again.", path)
    return _download(weights, url, file_name, sha256, _writable(base, fallback))


CACHE_SUBDIR = "keras_vit"


def close_presets(name):
    """Up to five preset names close to `name` (for the message of a misspelt one)."""
    return difflib.get_close_matches(str(name), list(PRESETS), n=5, cutoff=0.5)


def _writable(base, fallback):
    """`base` if its keras_vit/ folder can be made and written, else `fallback`."""
    folder = os.path.join(base, CACHE_SUBDIR)
    try:
        os.makedirs(folder, exist_ok=True)
        if os.access(folder, os.W_OK | os.X_OK):
            return base
    except OSError:
        pass
    logger.warning(
        "The cache folder %s cannot be written; downloading into %s instead (set KERAS_HOME "
        "to a writable folder to keep the file).",
        folder,
        os.path.join(fallback, CACHE_SUBDIR),
    )
    os.makedirs(os.path.join(fallback, CACHE_SUBDIR), exist_ok=True)
    return fallback


def _verified(path, sha256):
    """Whether `path` is whole (see readers.is_complete) and matches `sha256` if given."""
    if not is_complete(path):
        return False
    if sha256 is None:
        return True
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest() == sha256.lower()


def _download(name, url, file_name, sha256, cache_dir):
    import keras

    # A name of this process only: a download cut short (or a concurrent one) never
    # sits under the name a later call trusts; one left by a killed process is removed.
    partial = f".part-{_leftovers.owner()}-{file_name}"  # the suffix is kept for is_complete
    _leftovers.remove_ended(os.path.join(cache_dir, CACHE_SUBDIR), ".part-")
    try:
        path = keras.utils.get_file(
            fname=partial,
            origin=url,
            cache_dir=cache_dir,
            cache_subdir=CACHE_SUBDIR,
            force_download=True,
        )
    except Exception as error:  # keras raises a bare Exception for HTTP and URL errors
        raise OSError(
            f"Could not download the preset {name!r} from {url}: {error}. Check the "
            "connection, or download the file yourself and give its path instead of the "
            "preset name."
        ) from error
    try:
        if not is_complete(path):
            raise OSError(
                f"The download of the preset {name!r} from {url} is incomplete (the "
                "connection closed before the end of the file); nothing was cached. Try again."
            )
        if not _verified(path, sha256):
            raise ValueError(
                f"The download of the preset {name!r} from {url} does not match its recorded "
                f"sha256 hash {sha256}; nothing was cached."
            )
        final = os.path.join(os.path.dirname(path), file_name)
        os.replace(path, final)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return final
