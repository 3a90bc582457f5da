"""tf.data input pipelines: the embedded digits, TFDS names, image folders, arrays.

Every source ends as a `Source`: images (uint8 arrays, or file paths for a
folder) and integer labels with class names. `train_dataset` and
`eval_dataset` turn a source into batched, prefetched `tf.data.Dataset`s of
(float32 images in [-1, 1], labels) -- the `keras_vit.preprocess_inputs`
scaling, x / 127.5 - 1.

Determinism: the training order is a function of (seed, epoch) alone (a NumPy
permutation per epoch) and the augmentation of an element a function of
(seed, its global position) alone (stateless random ops), so the batch at
global step k is the same in every process. That is what lets an interrupted
run resume mid-epoch and end with the weights of an uninterrupted one
(`start_step`). Sources read in a stream (TFDS) shuffle with a buffer instead.
"""

import dataclasses
import os

import numpy as np

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
DIGITS = "digits"
_SEED_MIX = 7919


def _tf():
    import tensorflow as tf

    return tf


@dataclasses.dataclass
class Source:
    """Images and labels of one split.

    `images` is a uint8 array (N, H, W, C) or, for a folder, an array of file
    paths; `labels` int32 (N,); `class_names` one string per class. A TFDS
    source instead holds `stream`, a `tf.data.Dataset` of (uint8 image, label),
    and its `size`.
    """

    images: object
    labels: object
    class_names: list
    stream: object = None
    size: int = None

    def __len__(self):
        return self.size if self.stream is not None else len(self.labels)

    @property
    def is_files(self):
        return self.stream is None and self.images.dtype.kind in "US"


# Sources ---------------------------------------------------------------------


def load_digits(image_size=32, validation_fraction=0.2):
    """scikit-learn's bundled handwritten digits, upscaled, as (train, validation).

    1,797 8x8 grey images of the digits 0-9 (shipped with scikit-learn, no
    download), resized bilinearly to `image_size`, copied to 3 channels and
    scaled to uint8 0..255. The split is fixed (a permutation with seed 0):
    1,438 training and 359 validation images for the default fraction.
    """
    from sklearn.datasets import load_digits as sklearn_digits

    image_size = _check_image_size(image_size)
    digits = sklearn_digits()
    pixels = (digits.images.astype("float32") * (255.0 / 16.0))[..., None]
    tf = _tf()
    with tf.device("/cpu:0"):
        resized = tf.image.resize(pixels, image_size, method="bilinear").numpy()
    images = np.repeat(np.clip(np.round(resized), 0, 255).astype("uint8"), 3, axis=-1)
    labels = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(labels))
    num_validation = int(round(len(labels) * validation_fraction))
    validation, train = order[:num_validation], order[num_validation:]
    names = [str(digit) for digit in range(10)]
    return (
        Source(images[train], labels[train], names),
        Source(images[validation], labels[validation], names),
    )


def load_arrays(path, validation_fraction=0.1):
    """A .npz file with `x_train`, `y_train` and optionally `x_val`/`y_val`, `class_names`.

    `x_*` are uint8 (N, H, W, C) (or (N, H, W): grey); without `x_val` the last
    `validation_fraction` of the (seed-0 permuted) training arrays is held out.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path!r}: no such .npz file")
    with np.load(path, allow_pickle=False) as arrays:
        for key in ("x_train", "y_train"):
            if key not in arrays:
                raise ValueError(
                    f"{path} must hold arrays x_train and y_train (and optionally x_val, y_val, "
                    f"class_names). Received keys: {sorted(arrays.keys())}"
                )
        x_train, y_train = _image_array(arrays["x_train"]), arrays["y_train"].astype("int32")
        if "x_val" in arrays:
            x_val, y_val = _image_array(arrays["x_val"]), arrays["y_val"].astype("int32")
        else:
            order = np.random.default_rng(0).permutation(len(y_train))
            count = max(1, int(round(len(y_train) * validation_fraction)))
            x_val, y_val = x_train[order[-count:]], y_train[order[-count:]]
            x_train, y_train = x_train[order[:-count]], y_train[order[:-count]]
        num_classes = int(max(y_train.max(), y_val.max())) + 1
        if "class_names" in arrays:
            names = [str(name) for name in arrays["class_names"]]
        else:
            names = [str(index) for index in range(num_classes)]
    if len(x_train) != len(y_train):
        raise ValueError(
            f"x_train and y_train differ in length. Received: {len(x_train)} and {len(y_train)}"
        )
    return Source(x_train, y_train, names), Source(x_val, y_val, names)


def _image_array(array):
    if array.ndim == 3:
        array = array[..., None]
    if array.ndim != 4:
        raise ValueError(f"Image arrays must be (N, H, W, C). Received shape {array.shape}")
    if array.dtype != np.uint8:
        array = np.clip(array, 0, 255).astype("uint8")
    return array


def load_folder(path, validation_fraction=0.1, skip_corrupt=False):
    """A folder with one sub-folder per class of JPEG/PNG files.

    `path/train` and `path/val` (or `validation`) are used as the splits when
    present; otherwise a fixed seed-0 `validation_fraction` of each class is
    held out. Every file is checked with Pillow first: an unreadable file
    raises a ValueError naming it, or with `skip_corrupt=True` is left out
    and counted (the count is printed).
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--data {path!r}: no such folder")
    splits = [os.path.join(path, name) for name in ("train", "val", "validation")]
    if os.path.isdir(splits[0]) and (os.path.isdir(splits[1]) or os.path.isdir(splits[2])):
        validation_dir = splits[1] if os.path.isdir(splits[1]) else splits[2]
        names = _class_folders(splits[0])
        train = _read_class_folders(splits[0], names, skip_corrupt)
        validation = _read_class_folders(validation_dir, names, skip_corrupt)
        return Source(*train, names), Source(*validation, names)
    names = _class_folders(path)
    files, labels = _read_class_folders(path, names, skip_corrupt)
    rng = np.random.default_rng(0)
    held_out = np.zeros(len(labels), bool)
    for label in range(len(names)):
        members = np.flatnonzero(labels == label)
        count = int(round(len(members) * validation_fraction))
        if len(members) > 1:
            count = max(1, count)
        held_out[rng.permutation(members)[:count]] = True
    return (
        Source(files[~held_out], labels[~held_out], names),
        Source(files[held_out], labels[held_out], names),
    )


def _class_folders(path):
    names = sorted(entry for entry in os.listdir(path) if os.path.isdir(os.path.join(path, entry)))
    if not names:
        raise ValueError(f"{path!r} has no class sub-folders (one folder of images per class)")
    return names


def _read_class_folders(path, names, skip_corrupt):
    from PIL import Image

    files, labels, skipped = [], [], []
    for label, name in enumerate(names):
        folder = os.path.join(path, name)
        for entry in sorted(os.listdir(folder)):
            file = os.path.join(folder, entry)
            if not entry.lower().endswith(IMAGE_EXTENSIONS):
                continue
            try:
                with Image.open(file) as image:
                    image.load()
            except Exception as error:  # Pillow raises many kinds for bad files.
                if not skip_corrupt:
                    raise ValueError(
                        f"Cannot read the image {file!r} ({type(error).__name__}: {error}); "
                        "fix or remove it, or skip unreadable files (--skip-corrupt)"
                    ) from None
                skipped.append(file)
                continue
            files.append(file)
            labels.append(label)
    if skipped:
        print(f"Skipped {len(skipped)} unreadable image(s) under {path}, e.g. {skipped[0]}")
    if not files:
        raise ValueError(f"No JPEG/PNG images under {path!r}")
    return np.array(files), np.array(labels, "int32")


def load_tfds(name, data_dir=None):
    """A TensorFlow Datasets name as (train, validation) streaming sources.

    Uses the "train" split and the first of "validation" / "test" present;
    needs the data prepared (downloaded) in `data_dir` or TFDS' default.
    """
    import tensorflow_datasets as tfds

    builder = tfds.builder(name, data_dir=data_dir)
    builder.download_and_prepare()
    splits = builder.info.splits
    validation_split = next((s for s in ("validation", "test") if s in splits), None)
    if "train" not in splits or validation_split is None:
        raise ValueError(
            f"tfds:{name} needs a 'train' and a 'validation' or 'test' split. "
            f"Received splits: {sorted(splits.keys())}"
        )
    label_feature = builder.info.features["label"]
    names = list(label_feature.names)
    sources = []
    for split in ("train", validation_split):
        stream = builder.as_dataset(split=split, as_supervised=True, shuffle_files=False)
        sources.append(Source(None, None, names, stream=stream, size=splits[split].num_examples))
    return tuple(sources)


def load_data(spec, image_size=32, skip_corrupt=False, data_dir=None):
    """`--data`: "digits", "tfds:NAME", a folder of class folders, or an .npz file."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"`data` must be digits, tfds:NAME, a folder or an .npz file. Received: {spec!r}"
        )
    if spec == DIGITS:
        return load_digits(image_size)
    if spec.startswith("tfds:"):
        return load_tfds(spec[len("tfds:") :], data_dir=data_dir)
    if spec.endswith(".npz"):
        return load_arrays(spec)
    if os.path.isdir(spec):
        return load_folder(spec, skip_corrupt=skip_corrupt)
    raise ValueError(
        f"`data` must be digits, tfds:NAME, a folder of class folders or an .npz file. "
        f"Received: {spec!r} (no such folder or file)"
    )


# Pipelines -------------------------------------------------------------------


def _check_image_size(image_size):
    if isinstance(image_size, int):
        image_size = (image_size, image_size)
    if (
        not isinstance(image_size, (tuple, list))
        or len(image_size) != 2
        or not all(isinstance(side, int) and side > 0 for side in image_size)
    ):
        raise ValueError(
            f"`image_size` must be a positive int or (height, width). Received: {image_size!r}"
        )
    return tuple(image_size)


def _check_batch_size(batch_size):
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"`batch_size` must be a positive integer. Received: {batch_size!r}")


def steps_per_epoch(source, batch_size):
    """Training steps per epoch (incomplete last batches are dropped)."""
    _check_batch_size(batch_size)
    steps = len(source) // batch_size
    if steps == 0:
        raise ValueError(f"`batch_size` ({batch_size}) exceeds the {len(source)} training images")
    return steps


def _decode(tf, item, channels):
    if item.dtype == tf.string:
        image = tf.io.decode_image(
            tf.io.read_file(item), channels=channels, expand_animations=False
        )
        return image
    return item


def _scale(tf, image):
    return tf.cast(image, tf.float32) / 127.5 - 1.0


def _resize(tf, image, image_size):
    return tf.image.resize(tf.cast(image, tf.float32), image_size, method="bilinear")


def _augment(tf, image, image_size, seed, crop_scale, flip):
    """Random resized crop (area fraction `crop_scale`, aspect 3/4..4/3) and a flip."""
    if crop_scale is not None:
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.shape(image),
            bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
            seed=seed,
            min_object_covered=0.0,
            aspect_ratio_range=(3 / 4, 4 / 3),
            area_range=crop_scale,
            max_attempts=10,
            use_image_if_no_bounding_boxes=True,
        )
        image = tf.slice(image, begin, size)
    image = _resize(tf, image, image_size)
    if flip:
        image = tf.image.stateless_random_flip_left_right(image, seed=seed + [1, 0])
    return image


def _mix(tf, images, labels, seed, num_classes, mixup_alpha, cutmix_alpha):
    """MixUp or CutMix of a batch with its reverse (soft labels), stateless."""
    labels = tf.one_hot(labels, num_classes)
    alpha = mixup_alpha or cutmix_alpha
    gamma = tf.random.stateless_gamma([2], seed=seed, alpha=alpha)
    weight = gamma[0] / (gamma[0] + gamma[1])
    other_images, other_labels = tf.reverse(images, [0]), tf.reverse(labels, [0])
    if mixup_alpha:
        images = weight * images + (1 - weight) * other_images
    else:
        shape = tf.shape(images)
        height, width = shape[1], shape[2]
        cut = tf.sqrt(1.0 - weight)
        cut_h = tf.cast(tf.cast(height, tf.float32) * cut, tf.int32)
        cut_w = tf.cast(tf.cast(width, tf.float32) * cut, tf.int32)
        centre = tf.random.stateless_uniform([2], seed=seed + [0, 1], maxval=1.0)
        cy = tf.cast(centre[0] * tf.cast(height, tf.float32), tf.int32)
        cx = tf.cast(centre[1] * tf.cast(width, tf.float32), tf.int32)
        y0, y1 = (
            tf.clip_by_value(cy - cut_h // 2, 0, height),
            tf.clip_by_value(cy + cut_h // 2, 0, height),
        )
        x0, x1 = (
            tf.clip_by_value(cx - cut_w // 2, 0, width),
            tf.clip_by_value(cx + cut_w // 2, 0, width),
        )
        rows = tf.logical_and(tf.range(height) >= y0, tf.range(height) < y1)
        cols = tf.logical_and(tf.range(width) >= x0, tf.range(width) < x1)
        box = tf.cast(tf.logical_and(rows[:, None], cols[None, :]), tf.float32)[None, :, :, None]
        images = images * (1 - box) + other_images * box
        weight = 1.0 - tf.cast((y1 - y0) * (x1 - x0), tf.float32) / tf.cast(
            height * width, tf.float32
        )
    labels = weight * labels + (1 - weight) * other_labels
    return images, labels


def train_dataset(
    source,
    batch_size,
    image_size=32,
    epochs=1,
    seed=0,
    start_step=0,
    end_step=None,
    crop_scale=(0.8, 1.0),
    flip=True,
    rand_augment=False,
    mixup_alpha=0.0,
    cutmix_alpha=0.0,
    channels=3,
    cache=True,
):
    """The training pipeline: shuffle, decode, augment, scale, batch, prefetch.

    Args:
        source: a `Source`.
        batch_size: the global batch size.
        image_size: int or (height, width) of the model's input.
        epochs: number of epochs the dataset covers.
        seed: the seed of the shuffling and augmentation.
        start_step, end_step: the global steps [start, end) to yield (default
            the whole of `epochs`); resuming starts at the step reached.
        crop_scale: (min, max) area fraction of the random resized crop, or
            None for a plain resize.
        flip: random horizontal flips.
        rand_augment: apply `keras.layers.RandAugment` (not stateless: its
            results are not reproducible across processes).
        mixup_alpha, cutmix_alpha: MixUp or CutMix with this Beta(alpha,
            alpha); labels become one-hot soft labels (at most one of the two).
        channels: channels of the decoded images.
        cache: cache decoded in-memory arrays.

    Returns:
        A `tf.data.Dataset` of (float32 images in [-1, 1], labels): int32
        labels, or float32 one-hot labels with MixUp/CutMix.
    """
    tf = _tf()
    image_size = _check_image_size(image_size)
    if mixup_alpha and cutmix_alpha:
        raise ValueError(
            "Use MixUp or CutMix, not both. "
            f"Received: mixup_alpha={mixup_alpha}, cutmix_alpha={cutmix_alpha}"
        )
    steps = steps_per_epoch(source, batch_size)
    end_step = steps * epochs if end_step is None else end_step
    num_classes = len(source.class_names)
    autotune = tf.data.AUTOTUNE

    if source.stream is not None:
        stream = source.stream.shuffle(10_000, seed=seed, reshuffle_each_iteration=True).repeat()
        dataset = stream.enumerate().map(lambda i, pair: (pair[0], pair[1], i))
        dataset = dataset.skip(start_step * batch_size)
    else:
        count = len(source)
        orders = [
            np.random.default_rng([seed, epoch]).permutation(count)[: steps * batch_size]
            for epoch in range(start_step // steps, (end_step + steps - 1) // steps)
        ]
        offset = (start_step // steps) * steps * batch_size
        indices = np.concatenate(orders)[(start_step % steps) * batch_size :]
        indices = indices[: (end_step - start_step) * batch_size]
        positions = np.arange(len(indices), dtype="int64") + start_step * batch_size
        del offset
        images = tf.constant(source.images)
        labels = tf.constant(source.labels)
        dataset = tf.data.Dataset.from_tensor_slices((indices, positions)).map(
            lambda i, position: (tf.gather(images, i), tf.gather(labels, i), position)
        )

    def element(image, label, position):
        element_seed = tf.stack([tf.cast(seed, tf.int64) * _SEED_MIX, position])
        element_seed = tf.cast(element_seed, tf.int32)
        image = _decode(tf, image, channels)
        image = _augment(tf, image, image_size, element_seed, crop_scale, flip)
        image.set_shape([*image_size, channels])
        return image, tf.cast(label, tf.int32)

    dataset = dataset.map(element, num_parallel_calls=autotune, deterministic=True)
    if rand_augment:
        import keras

        augmenter = keras.layers.RandAugment(value_range=(0, 255), seed=seed)
        dataset = dataset.map(lambda x, y: (augmenter(x), y), num_parallel_calls=autotune)
    dataset = dataset.batch(batch_size, drop_remainder=True)
    dataset = dataset.map(lambda x, y: (_scale(tf, x), y), num_parallel_calls=autotune)
    if mixup_alpha or cutmix_alpha:
        steps_ids = tf.data.Dataset.range(start_step, end_step)

        def mix(batch, step):
            step_seed = tf.cast(tf.stack([tf.cast(seed, tf.int64) + 1, step]), tf.int32)
            return _mix(tf, *batch, step_seed, num_classes, mixup_alpha, cutmix_alpha)

        dataset = tf.data.Dataset.zip((dataset, steps_ids)).map(mix, num_parallel_calls=autotune)
    if source.stream is not None:
        dataset = dataset.take(end_step - start_step)
    return dataset.prefetch(autotune)


def eval_dataset(source, batch_size, image_size=32, channels=3, cache=True, one_hot=False):
    """The evaluation pipeline: decode, resize, scale, batch (all images kept), prefetch."""
    tf = _tf()
    image_size = _check_image_size(image_size)
    _check_batch_size(batch_size)
    num_classes = len(source.class_names)
    if source.stream is not None:
        dataset = source.stream
    else:
        dataset = tf.data.Dataset.from_tensor_slices((source.images, source.labels))

    def element(image, label):
        image = _resize(tf, _decode(tf, image, channels), image_size)
        image.set_shape([*image_size, channels])
        label = tf.cast(label, tf.int32)
        if one_hot:
            label = tf.one_hot(label, num_classes)
        return _scale(tf, image), label

    dataset = dataset.map(element, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if cache and source.stream is None and not source.is_files:
        dataset = dataset.cache()
    return dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def load_image(path, image_size, channels=3):
    """One image file as a float32 (1, H, W, C) array in [-1, 1] (for predict)."""
    tf = _tf()
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
    except Exception as error:
        raise ValueError(
            f"Cannot read the image {path!r} ({type(error).__name__}: {error})"
        ) from None
    image = _decode(tf, tf.constant(path), channels)
    return _scale(tf, _resize(tf, image, _check_image_size(image_size)))[None].numpy()
