"""Input pipelines: batched, prefetched `tf.data.Dataset`s of (image, label).

Images come out float32 NHWC scaled to [-1, 1] (x / 127.5 - 1, as
`keras_vit.preprocess_inputs`), labels one-hot float32 (so that MixUp/CutMix
and label smoothing work on them).

Sources (`load(spec, ...)`):
- "digits": scikit-learn's bundled handwritten digits (1797 8x8 images, offline),
  upscaled to `image_size` and repeated to 3 channels; fixed stratified 80/20 split.
- "tfds:NAME": a TensorFlow Datasets dataset (its "train" split and its
  "validation" or "test" split).
- a folder with one sub-folder per class of JPEG/PNG/BMP/GIF/WebP files (hidden
  files and folders left out), read as RGB and resized to `image_size`; `validation_fraction` of them (at least one) are
  held out.
- a .npz file holding x_train, y_train, x_test, y_test (and optionally
  class_names): images as `from_arrays` takes them, resized to `image_size`
  when their size differs.

The training stream is infinite (shuffle, repeat, augment, batch), so a run
resumed after `skip` steps sees exactly the batches that an uninterrupted run
would have seen: the augmentation seeds are drawn by position in the stream.
"""

import numbers
import os
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from keras_vit.layers._checks import boolean, one_of, positive_int
from keras_vit.layers._checks import seed as check_seed
from keras_vit.preprocessing import pixel_range_error

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
DIGITS = "digits"
SPLITS = ("validation", "train")
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _fraction(name, value, high_inclusive=False):
    """Return `value` if it is a number in (0, 1) (or (0, 1]), else raise a ValueError."""
    interval = "(0, 1]" if high_inclusive else "(0, 1)"
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (0 < value < 1 or (high_inclusive and value == 1))
    ):
        raise ValueError(f"`{name}` must be a number in {interval}. Received: {name}={value!r}")
    return float(value)


def _check_data(data):
    if not isinstance(data, Data):
        raise TypeError(
            "`data` must be a keras_vit.data.Data (from load() or from_arrays()). "
            f"Received: data of type {type(data).__name__}"
        )
    return data


def _tf():
    import tensorflow as tf

    return tf


class Data:
    """What `load` returns: the pipelines' sources and their description."""

    def __init__(self, train, validation, class_names, train_size, validation_size):
        self.train = train  # unbatched (uint8 image, int label) dataset
        self.validation = validation
        self.class_names = list(class_names)
        self.train_size = int(train_size)
        self.validation_size = int(validation_size)

    @property
    def num_classes(self):
        return len(self.class_names)


# Sources ---------------------------------------------------------------------


def digits_arrays(image_size=32, seed=0, validation_fraction=0.2):
    """The digits dataset as uint8 arrays (N, image_size, image_size, 3), stratified split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    image_size = positive_int("image_size", image_size)
    validation_fraction = _fraction("validation_fraction", validation_fraction)
    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).clip(0, 255).astype("uint8")[..., None]
    x_train, x_val, y_train, y_val = train_test_split(
        images,
        digits.target,
        test_size=validation_fraction,
        random_state=seed,
        stratify=digits.target,
    )
    tf = _tf()

    def resize(x):
        x = tf.image.resize(tf.constant(x, tf.float32), (image_size, image_size), "bilinear")
        x = tf.repeat(x, 3, axis=-1)
        return np.asarray(tf.clip_by_value(tf.round(x), 0, 255), dtype="uint8")

    return resize(x_train), y_train.astype("int32"), resize(x_val), y_val.astype("int32")


def _images(name, x):
    """`x` as NHWC images of pixel values in [0, 255], checked."""
    try:
        x = np.asarray(x)
    except ValueError as error:  # a ragged nested list
        raise ValueError(
            f"`{name}` must be an array of images (N, height, width[, channels]). Received: {error}"
        ) from None
    if x.ndim not in (3, 4):
        raise ValueError(
            f"`{name}` must be images (N, height, width[, channels]). Received: shape {x.shape}"
        )
    if x.ndim == 3:
        x = x[..., None]
    if x.shape[1] in (1, 3) and x.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"`{name}` must be channels-last images (N, height, width, channels); shape "
            f"{x.shape} looks channels-first (N, channels, height, width): transpose it "
            "with x.transpose(0, 2, 3, 1)"
        )
    if len(x) == 0:
        raise ValueError(f"`{name}` must hold at least one image. Received: shape {x.shape}")
    if x.dtype.kind not in "uif":
        raise ValueError(
            f"`{name}` must be uint8 (or [0, 255] integer or float) pixel values. "
            f"Received: dtype {x.dtype}"
        )
    message = pixel_range_error(name, x.dtype, float(x.min()), float(x.max()))
    if message:
        raise ValueError(message)
    return x


def _labels(name, y):
    """`y` as int32 class indices of shape (N,), checked."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y.reshape(-1)
    if y.ndim != 1:
        hint = ": one-hot labels? pass y.argmax(-1)" if y.ndim == 2 else ""
        raise ValueError(
            f"`{name}` must be class indices of shape (N,) or (N, 1). "
            f"Received: shape {y.shape}{hint}"
        )
    if y.dtype.kind not in "buif":
        raise ValueError(
            f"`{name}` must be integer class indices 0, 1, ... (map class names to indices "
            f"and pass class_names). Received: dtype {y.dtype}"
            + (f", e.g. {str(y[0])!r}" if len(y) else "")
        )
    if y.dtype.kind == "f" and not np.all(np.isfinite(y) & (y == np.round(y))):
        bad = y[~(np.isfinite(y) & (y == np.round(y)))][0]
        raise ValueError(
            f"`{name}` must be integer class indices. Received: float labels such as {float(bad)}"
        )
    if len(y) and y.min() < 0:
        raise ValueError(
            f"`{name}` must be class indices 0, 1, ... (non-negative). Received: "
            f"a label {int(y.min())}"
        )
    return y.astype("int32")


def from_arrays(x_train, y_train, x_val, y_val, class_names=None, image_size=None):
    """A `Data` from numpy arrays: uint8 (or [0, 255] float) images NHWC, int labels.

    Args:
        x_train, x_val: images (N, height, width[, channels]) of pixel values in
            [0, 255]: uint8, or integers or floats in that range (not already
            scaled to [-1, 1] or [0, 1]). Both must have the same height, width
            and channels.
        y_train, y_val: class indices 0, 1, ... of shape (N,) or (N, 1), integers
            (or floats holding whole numbers).
        class_names: one name per class; at least max(label) + 1 of them.
            Default: "0", "1", ... up to the largest label.
        image_size: when given and the images have another size, they are resized
            to (image_size, image_size) as `load` resizes folder images.
    """
    names = ("x_train", "y_train", "x_val", "y_val")
    return _from_arrays(x_train, y_train, x_val, y_val, class_names, image_size, names)


def _from_arrays(x_train, y_train, x_val, y_val, class_names, image_size, names):
    """`from_arrays`, naming the four arrays `names` in its errors."""
    tf = _tf()
    x_train, x_val = _images(names[0], x_train), _images(names[2], x_val)
    y_train, y_val = _labels(names[1], y_train), _labels(names[3], y_val)
    if x_train.shape[1:] != x_val.shape[1:]:
        raise ValueError(
            f"`{names[0]}` and `{names[2]}` must have the same image size and channels. "
            f"Received: {x_train.shape[1:]} and {x_val.shape[1:]} (height, width, channels)"
        )
    if len(x_train) != len(y_train) or len(x_val) != len(y_val):
        raise ValueError(
            "Images and labels must have the same length. Received: "
            f"{len(x_train)} / {len(y_train)} ({names[0]} / {names[1]}), "
            f"{len(x_val)} / {len(y_val)} ({names[2]} / {names[3]})"
        )
    num_classes = int(max(y_train.max(), y_val.max())) + 1
    if class_names is None:
        class_names = [str(i) for i in range(num_classes)]
    elif isinstance(class_names, (str, bytes)) or not hasattr(class_names, "__len__"):
        raise ValueError(
            f"`class_names` must be a list of names. Received: class_names={class_names!r}"
        )
    elif len(class_names) < num_classes:
        raise ValueError(
            f"`class_names` must name every class: the labels go up to {num_classes - 1}, "
            f"so at least {num_classes} names. Received: {len(class_names)} names "
            f"{list(class_names)[:10]!r}"
        )
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    val = tf.data.Dataset.from_tensor_slices((x_val, y_val))
    if image_size is not None:
        size = positive_int("image_size", image_size)
        if x_train.shape[1:3] != (size, size):
            train, val = (
                d.map(
                    lambda x, y: (_resize(x, size), y),
                    num_parallel_calls=tf.data.AUTOTUNE,
                    deterministic=True,
                )
                for d in (train, val)
            )
    return Data(train, val, class_names, len(x_train), len(x_val))


def _resize(image, size):
    """An image resized to (size, size) with antialiasing, as uint8."""
    tf = _tf()
    image = tf.image.resize(image, (size, size), antialias=True)
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


def _read_npz(path):
    """The arrays of a .npz file (x_train, y_train, x_test, y_test[, class_names])."""
    import zlib

    expected = "a .npz archive of x_train, y_train, x_test and y_test (written by np.savez)"
    if not zipfile.is_zipfile(path):
        raise ValueError(f"Cannot read {path}: it must be {expected}. Received: not a zip file")
    try:
        archive = np.load(path)
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as error:
        raise ValueError(f"Cannot read {path}: it must be {expected}. Received: {error}") from None
    arrays = {}
    with archive:
        missing = [k for k in NPZ_KEYS if k not in archive.files]
        if missing:
            raise ValueError(
                f"{path} must hold x_train, y_train, x_test and y_test. Missing: {missing} "
                f"(it holds {archive.files})"
            )
        for key in NPZ_KEYS + ("class_names",):
            if key not in archive.files:
                continue
            try:
                arrays[key] = archive[key]
            except ValueError as error:
                if "allow_pickle" not in str(error):
                    raise ValueError(f"Cannot read {key} in {path}: {error}") from None
                raise ValueError(
                    f"{key} in {path} holds Python objects (dtype object); it must be a "
                    "numeric array (class_names: strings). Pickled data is not loaded."
                ) from None
            except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as error:
                raise ValueError(f"Cannot read {key} in {path}: {error}") from None
    return arrays


def _from_npz(path, image_size):
    arrays = _read_npz(path)
    class_names = arrays.get("class_names")
    if class_names is not None:
        class_names = [str(c) for c in np.asarray(class_names).reshape(-1)]
    try:
        return _from_arrays(*(arrays[k] for k in NPZ_KEYS), class_names, image_size, NPZ_KEYS)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def _hidden(name):
    """Hidden entries (".DS_Store", "._photo.jpg" of macOS, ".ipynb_checkpoints") are no data."""
    return name.startswith(".")


def _decode_error(path):
    """Why TensorFlow's decoder (the one the pipeline runs) cannot read `path`, or None."""
    tf = _tf()
    try:
        tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)
    except (tf.errors.OpError, ValueError) as error:
        message = getattr(error, "message", None) or str(error)
        if message.startswith("{{"):  # "{{function_node ...}} the reason [Op:...]"
            message = message.split("}}", 1)[-1]
        return message.split(" [Op:")[0].strip() or type(error).__name__
    return None


def list_image_folder(directory, skip_corrupt=False):
    """Files and labels of a folder of class sub-folders, every image checked.

    Each class is a sub-folder (its images may sit in nested folders); files
    ending in IMAGE_EXTENSIONS (any case) are images, and hidden files and
    folders (names starting with ".") are left out, and other files are left out
    with a printed note that counts them. Every image is decoded
    with the decoder the pipeline uses: a file it cannot read raises
    ValueError naming it, or with `skip_corrupt=True` is left out and
    counted. A class sub-folder without any image raises ValueError.

    Returns:
        (paths, labels, class_names, skipped): skipped is the list of left-out files.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"No such folder. Received: data={directory!r}")
    class_names = sorted(
        d
        for d in os.listdir(directory)
        if os.path.isdir(os.path.join(directory, d)) and not _hidden(d)
    )
    if not class_names:
        raise ValueError(
            f"The folder {directory!r} must hold one sub-folder of images per class. "
            "Received: no sub-folders"
        )
    listed = []  # (label, path), class by class
    others = []  # files that are not hidden and not images by their extension
    for label, name in enumerate(class_names):
        candidates = []
        for root, folders, files in os.walk(os.path.join(directory, name)):
            folders[:] = [folder for folder in folders if not _hidden(folder)]
            for file in files:
                if _hidden(file):
                    continue
                if file.lower().endswith(IMAGE_EXTENSIONS):
                    candidates.append((root, file))
                else:
                    others.append(os.path.join(root, file))
        # By folder, then by name: the order (and so the split) of earlier versions.
        listed += [(label, os.path.join(root, file)) for root, file in sorted(candidates)]
    if others:  # a .tif, say, which TensorFlow's decoder cannot read: said, not silent
        kinds = sorted({os.path.splitext(path)[1].lower() or "(none)" for path in others})
        print(
            f"Note: {len(others)} file(s) in the class folders of {directory} are left out: "
            f"images are the files ending in {', '.join(IMAGE_EXTENSIONS)} (any case); "
            f"left out: {', '.join(kinds[:10])}, such as {others[0]}"
        )
    # Decoding releases the GIL: the images are checked on every core, in threads.
    with ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        errors = list(pool.map(_decode_error, [path for _, path in listed]))
    paths, labels, skipped = [], [], []
    for (label, path), error in zip(listed, errors):
        if error is None:
            paths.append(path)
            labels.append(label)
        elif skip_corrupt:
            skipped.append(path)
        else:
            raise ValueError(
                f"Cannot read the image {path}: {error}. Remove it or pass "
                "skip_corrupt=True (--skip-corrupt) to leave such files out."
            )
    present = set(labels)
    empty = [name for label, name in enumerate(class_names) if label not in present]
    if not paths:
        raise ValueError(f"No readable images in {directory!r} (extensions {IMAGE_EXTENSIONS})")
    if empty:
        raise ValueError(
            f"Every class sub-folder of {directory!r} must hold images (files ending in "
            f"{', '.join(IMAGE_EXTENSIONS)}, in any case). Received: "
            f"{len(empty)} class(es) without a readable one: {empty[:10]!r}"
            + (f" ({len(skipped)} unreadable file(s) skipped)" if skipped else "")
            + ". Remove those sub-folders or put images in them"
        )
    return paths, np.asarray(labels, "int32"), class_names, skipped


def _from_folder(directory, image_size, seed, validation_fraction, skip_corrupt):
    tf = _tf()
    paths, labels, class_names, skipped = list_image_folder(directory, skip_corrupt)
    if skipped:
        print(f"Skipped {len(skipped)} unreadable image(s) in {directory}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(paths))
    paths, labels = np.asarray(paths)[order], labels[order]
    if len(paths) < 2:
        raise ValueError(
            f"The folder {directory!r} must hold at least 2 readable images (one to train "
            f"on, one to validate). Received: {len(paths)}"
        )
    # At least one image on each side, whatever the fraction rounds to.
    n_val = min(max(int(round(len(paths) * validation_fraction)), 1), len(paths) - 1)

    def read(path, label):
        data = tf.io.read_file(path)
        image = tf.io.decode_image(data, channels=3, expand_animations=False)
        return _resize(image, image_size), label

    def dataset(p, y):
        return tf.data.Dataset.from_tensor_slices((p, y)).map(
            read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
        )

    return Data(
        dataset(paths[n_val:], labels[n_val:]),
        dataset(paths[:n_val], labels[:n_val]),
        class_names,
        len(paths) - n_val,
        n_val,
    )


def _from_tfds(name, image_size, data_dir=None):
    import tensorflow_datasets as tfds

    tf = _tf()
    read = dict(data_dir=data_dir, shuffle_files=False, as_supervised=True)
    train, info = tfds.load(name, split="train", with_info=True, **read)
    val = None
    for split in ("validation", "test"):
        try:
            val = tfds.load(name, split=split, **read)
            break
        except (ValueError, KeyError):
            continue
    if val is None:
        raise ValueError(
            f"tfds:{name} must have a 'train' split and a 'validation' or 'test' split."
        )
    class_names = list(info.features["label"].names)

    def resize(image, label):
        if image.shape[-1] == 1:
            image = tf.image.grayscale_to_rgb(image)
        return _resize(image, image_size), tf.cast(label, tf.int32)

    def size(dataset):
        count = int(dataset.cardinality())
        return count if count >= 0 else int(dataset.reduce(0, lambda n, _: n + 1))

    train, val = train.map(resize), val.map(resize)
    return Data(train, val, class_names, size(train), size(val))


def load(spec=DIGITS, image_size=32, seed=0, validation_fraction=0.2, skip_corrupt=False):
    """Reads a data source (see the module docstring) as a `Data`.

    Args:
        spec: "digits", "tfds:NAME", a folder of class sub-folders or a .npz file.
        image_size: a positive int: every source's images come out
            (image_size, image_size); .npz images of another size are resized.
        seed: seed of the digits and folder splits.
        validation_fraction: a number in (0, 1), the share of the digits or of a
            folder's images held out for validation (a folder keeps at least one
            image on each side); .npz files and tfds datasets bring their own split.
        skip_corrupt: leave out, rather than reject, a folder's unreadable images.
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"`data` must be a non-empty string or path. Received: data={spec!r}")
    image_size = positive_int("image_size", image_size)
    seed = check_seed("seed", seed)
    skip_corrupt = boolean("skip_corrupt", skip_corrupt)
    validation_fraction = _fraction("validation_fraction", validation_fraction)
    if spec == DIGITS:
        x_train, y_train, x_val, y_val = digits_arrays(image_size, seed, validation_fraction)
        return from_arrays(x_train, y_train, x_val, y_val, [str(i) for i in range(10)])
    if spec.startswith("tfds:"):
        return _from_tfds(spec[len("tfds:") :], image_size)
    if spec.lower().endswith(".npz"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"No such .npz file. Received: data={spec!r}")
        return _from_npz(spec, image_size)
    if os.path.isdir(spec):
        return _from_folder(spec, image_size, seed, validation_fraction, skip_corrupt)
    raise ValueError(
        "`data` must be 'digits', 'tfds:NAME', a folder of class sub-folders or a .npz file. "
        f"Received: data={spec!r}"
    )


# Pipelines -------------------------------------------------------------------


def scale(images):
    """uint8-range images to [-1, 1]: x / 127.5 - 1."""
    tf = _tf()
    return tf.cast(images, tf.float32) / 127.5 - 1.0


def random_resized_crop(image, seed, scale_range=(0.6, 1.0), ratio_range=(3 / 4, 4 / 3)):
    """A stateless random crop of `scale_range` of the area, resized back to the image's size."""
    tf = _tf()
    shape = tf.shape(image)
    height, width = shape[0], shape[1]
    seeds = tf.random.experimental.stateless_split(seed, 4)
    area = tf.cast(height * width, tf.float32)
    target = area * tf.random.stateless_uniform([], seeds[0], *scale_range)
    log_ratio = tf.random.stateless_uniform(
        [], seeds[1], np.log(ratio_range[0]), np.log(ratio_range[1])
    )
    ratio = tf.exp(log_ratio)
    crop_w = tf.clip_by_value(tf.cast(tf.round(tf.sqrt(target * ratio)), tf.int32), 1, width)
    crop_h = tf.clip_by_value(tf.cast(tf.round(tf.sqrt(target / ratio)), tf.int32), 1, height)
    top = tf.random.stateless_uniform([], seeds[2], 0, height - crop_h + 1, tf.int32)
    left = tf.random.stateless_uniform([], seeds[3], 0, width - crop_w + 1, tf.int32)
    crop = image[top : top + crop_h, left : left + crop_w]
    return tf.image.resize(crop, (height, width), "bilinear")


def _augmenter(flip, crop_scale, num_classes):
    tf = _tf()

    def augment(element, seed):
        image, label = element
        seeds = tf.random.experimental.stateless_split(seed, 2)
        image = tf.cast(image, tf.float32)
        if crop_scale is not None:
            image = random_resized_crop(image, seeds[0], (crop_scale, 1.0))
        if flip:
            image = tf.image.stateless_random_flip_left_right(image, seeds[1])
        return image, tf.one_hot(label, num_classes)

    return augment


def train_pipeline(
    data,
    batch_size,
    seed=0,
    skip_steps=0,
    flip=True,
    crop_scale=0.6,
    rand_augment=False,
    mixup=False,
    cutmix=False,
    cache=True,
    deterministic=True,
):
    """The infinite training stream: batches of (scaled image, one-hot label).

    Args:
        data: a `Data` (from `load`).
        batch_size: the global batch size.
        seed: seed of the shuffle and of the augmentation.
        skip_steps: batches to leave out at the start (resuming a run).
        flip: random horizontal flips.
        crop_scale: smallest area fraction of the random resized crop, in (0, 1];
            None for no crop.
        rand_augment: apply `keras.layers.RandAugment` (per batch).
        mixup, cutmix: apply `keras.layers.MixUp` / `keras.layers.CutMix` (per batch).
        cache: cache the decoded images in memory.
        deterministic: the same batches, in the same order, on every run.
    """
    tf = _tf()
    _check_data(data)
    _check_batch_size(batch_size)
    seed = check_seed("seed", seed)
    if crop_scale is not None:
        crop_scale = _fraction("crop_scale", crop_scale, high_inclusive=True)
    if (
        isinstance(skip_steps, bool)
        or not isinstance(skip_steps, numbers.Integral)
        or skip_steps < 0
    ):
        raise ValueError(
            f"`skip_steps` must be a non-negative integer. Received: skip_steps={skip_steps!r}"
        )
    skip_steps = int(skip_steps)
    source = data.train.cache() if cache else data.train
    stream = source.shuffle(
        min(data.train_size, 50_000), seed=seed, reshuffle_each_iteration=True
    ).repeat()
    seeds = tf.data.Dataset.random(seed=seed).batch(2).map(lambda s: tf.cast(s, tf.int32))
    stream = tf.data.Dataset.zip((stream, seeds)).map(
        _augmenter(flip, crop_scale, data.num_classes),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    stream = stream.batch(batch_size, drop_remainder=True)
    batch_layers = _batch_augmenters(rand_augment, mixup, cutmix, seed)
    if batch_layers:

        def apply(images, labels):
            for layer in batch_layers:
                images, labels = layer(images, labels)
            return images, labels

        stream = stream.map(apply)
    stream = stream.map(lambda x, y: (x / 127.5 - 1.0, y))
    if skip_steps:
        stream = stream.skip(skip_steps)
    options = tf.data.Options()
    options.deterministic = deterministic
    return stream.with_options(options).prefetch(tf.data.AUTOTUNE)


def _batch_augmenters(rand_augment, mixup, cutmix, seed):
    import keras

    result = []
    if rand_augment:
        layer = keras.layers.RandAugment(value_range=(0, 255), seed=seed)
        result.append(lambda x, y, layer=layer: (layer(x, training=True), y))
    for enabled, cls in ((mixup, "MixUp"), (cutmix, "CutMix")):
        if enabled:
            layer = getattr(keras.layers, cls)(seed=seed)

            def mix(x, y, layer=layer):
                out = layer({"images": x, "labels": y}, training=True)
                return out["images"], out["labels"]

            result.append(mix)
    return result


def eval_pipeline(data, batch_size, cache=True, split="validation"):
    """Batches of (scaled image, one-hot label) of one split, in order.

    `split` is "validation" (default) or "train".
    """
    tf = _tf()
    _check_data(data)
    _check_batch_size(batch_size)
    one_of("split", split, SPLITS)
    source = data.validation if split == "validation" else data.train
    if cache:
        source = source.cache()
    num_classes = data.num_classes
    return (
        source.batch(batch_size)
        .map(lambda x, y: (scale(x), tf.one_hot(y, num_classes)))
        .prefetch(tf.data.AUTOTUNE)
    )


def steps_per_epoch(data, batch_size):
    """Batches in one pass over the training set (at least 1)."""
    _check_data(data)
    _check_batch_size(batch_size)
    return max(1, data.train_size // batch_size)


def _check_batch_size(batch_size):
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, (int, np.integer))
        or batch_size < 1
    ):
        raise ValueError(
            f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}"
        )
