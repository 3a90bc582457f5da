"""What the sub-commands share: reading a trained model and its class names
with usage errors that name the file and the flag, and telling the flags that
were typed from those left at their defaults."""

import argparse
import os
import sys
import zipfile

from keras_vit.cli import UsageError


def seed_argument(text):
    """argparse type of --seed: an integer in [0, 2**32 - 1], as NumPy and Keras take
    (the bound of keras_vit.layers._checks.seed)."""
    from keras_vit.layers._checks import SEED_LIMIT

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [0, 2**32 - 1] ({SEED_LIMIT - 1}), got {text!r}"
        )
    return value


def explicit_flags(args):
    """The destinations (e.g. "epochs") of the options typed on the command line.

    `keras_vit.cli.main` keeps the command line as `args._argv`; it is parsed
    again with every default suppressed, so an option passed with its default
    value counts too. Without it (`run` called directly), the options whose
    values differ from their defaults.
    """
    run = getattr(args, "_run", None)
    argv, module = getattr(args, "_argv", None), sys.modules.get(getattr(run, "__module__", ""))
    names = [name for name in vars(args) if not name.startswith("_") and name != "command"]
    command = getattr(args, "command", None)
    if argv is not None and module is not None and command in argv:
        parser = argparse.ArgumentParser(add_help=False)
        module.add_arguments(parser)
        for action in parser._actions:  # unset unless typed (no set_defaults: it keeps a value)
            action.default = argparse.SUPPRESS
        try:
            typed, _ = parser.parse_known_args(argv[argv.index(command) + 1 :])
        except SystemExit:  # cannot happen after the same line parsed once
            typed = None
        if typed is not None:
            return {k for k, v in vars(typed).items() if v is not argparse.SUPPRESS}
    parser = getattr(args, "_parser", None)
    if parser is None:
        return set()
    return {name for name in names if getattr(args, name) != parser.get_default(name)}


def read_class_names(file, what):
    """The class names in a JSON file; `what` names it in errors (e.g. "--class-names")."""
    from keras_vit import export

    try:
        return export.read_class_names(file)
    except OSError as error:
        raise UsageError(f"{what} {file!r} cannot be read: {error.strerror or error}") from None
    except ValueError as error:  # not UTF-8, not JSON, not a list of names: names the file
        raise UsageError(f"{what}: {error}") from None


def find_trained(path, flag="--model"):
    """`keras_vit.export.find_trained`, its errors being usage errors that name `flag`."""
    from keras_vit import export

    try:
        return export.find_trained(path, argument=flag)
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(f"{flag}: {error}") from None


def load_keras_file(file, flag="--model", **kwargs):
    """keras.models.load_model(file, safe_mode=True), a file it cannot read being a usage error."""
    import keras

    import keras_vit  # noqa: F401  (registers the layers)

    if not zipfile.is_zipfile(file):
        raise UsageError(
            f"{flag} {file!r} is not a readable .keras file: not a zip archive (truncated, "
            "corrupt, or of another format)"
        )
    try:
        return keras.models.load_model(file, safe_mode=True, **kwargs)
    except Exception as error:  # noqa: BLE001 - whatever Keras says of the file's content
        first = (str(error).strip().splitlines() or [""])[0][:300]
        raise UsageError(
            f"{flag} {file!r} cannot be loaded as a Keras model: {type(error).__name__}: {first}"
        ) from None


def num_classes(model):
    """The classes a model predicts (its head's units), or None without a head."""
    from keras_vit import export

    if not export.has_head(model):
        return None
    return model.outputs[0].shape[-1]


def load_trained(path, class_names_file=None, flag="--model"):
    """(model, class names or None) as `keras_vit.export.load_trained` reads them.

    `class_names_file` (export --class-names) replaces the class-name file of
    the folder. A class-name file is read before the model, and must list one
    name per class of the model's head.
    """
    from keras_vit import export

    file, names_file = find_trained(path, flag)
    if class_names_file is not None:
        if not os.path.isfile(class_names_file):
            raise UsageError(f"--class-names: no such file. Received: {class_names_file!r}")
        source = f"--class-names {class_names_file!r}"
        names = read_class_names(class_names_file, "--class-names")
    elif names_file is not None:
        source = f"The class-name file {names_file!r} (beside {flag})"
        names = read_class_names(names_file, "the class-name file")
    else:
        source, names = None, None
    model = load_keras_file(file, flag)
    try:
        export.check_class_names(names, model, source)
    except ValueError as error:
        raise UsageError(f"{error} ({file!r})") from None
    return model, names


def check_data_spec(spec, flag="--data"):
    """A usage error unless `spec` is digits, tfds:NAME, an existing .npz file or folder."""
    from keras_vit import data as data_module

    if spec == data_module.DIGITS or (spec.startswith("tfds:") and len(spec) > len("tfds:")):
        return
    if spec.lower().endswith(".npz"):
        if not os.path.isfile(spec):
            raise UsageError(f"{flag}: no such .npz file. Received: {flag[2:]}={spec!r}")
        return
    if not os.path.isdir(spec):
        what = "a file" if os.path.exists(spec) else "no such folder"
        raise UsageError(
            f"{flag} must be 'digits', 'tfds:NAME', a folder with one sub-folder per class or a "
            f".npz file. Received: {flag[2:]}={spec!r} ({what})"
        )


def load_data(spec, image_size, seed=0, skip_corrupt=False, flag="--data"):
    """`keras_vit.data.load` at `image_size` = (height, width), with usage errors naming `flag`.

    `keras_vit.data.load` reads every source (folder, tfds, .npz) square at
    the larger side; a non-square size is then resized once more.
    """
    from keras_vit import cli
    from keras_vit import data as data_module

    check_data_spec(spec, flag)
    height, width = image_size
    try:
        data = data_module.load(
            spec, image_size=max(height, width), seed=seed, skip_corrupt=skip_corrupt
        )
    except ModuleNotFoundError as error:
        if not spec.startswith("tfds:"):
            raise
        if error.name in (None, "tensorflow_datasets"):
            hint = "the tensorflow_datasets package (pip install tensorflow-datasets)"
        else:  # TensorFlow Datasets is there, one of its own imports is not
            hint = (
                f"TensorFlow Datasets, which cannot import {error.name} "
                f"(pip install {error.name.split('.')[0]})"
            )
        raise UsageError(f"{flag} {spec!r} needs {hint}") from None
    except Exception as error:  # noqa: BLE001
        if cli.is_user_error(error):
            raise UsageError(f"{flag} {spec!r}: {error}") from None
        if not spec.startswith("tfds:"):
            raise
        # TensorFlow Datasets: an unknown name, a dataset not downloaded (offline), ...
        first = (str(error).strip().splitlines() or [""])[0][:300]
        raise UsageError(
            f"{flag} {spec!r}: TensorFlow Datasets cannot load it: {type(error).__name__}: {first}"
        ) from None
    found = tuple(data.train.element_spec[0].shape[:2])
    if found != (height, width):
        import tensorflow as tf

        def resize(image, label):
            image = tf.image.resize(image, (height, width), antialias=True)
            return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8), label

        data = data_module.Data(
            data.train.map(resize),
            data.validation.map(resize),
            data.class_names,
            data.train_size,
            data.validation_size,
        )
    return data


def validation_hint(spec, data):
    """Why `data` has no validation image, and what to do about it."""
    if spec.lower().endswith(".npz"):
        return "its x_test and y_test are empty; put validation images in them"
    if spec.startswith("tfds:"):
        return "its validation (or test) split is empty"
    return "add images to the folder (keras_vit.data.load keeps one or more for validation)"


# Images in and class scores out, for predict and explain -----------------------------


def read_image(path):
    """An image file as a (height, width, 3) uint8 array; usage errors name the file."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    if os.path.isdir(path):
        raise UsageError(f"IMAGE must be an image file, not a folder. Received: {path}")
    if not os.path.isfile(path):
        raise UsageError(f"no such image file: {path}")
    try:
        with Image.open(path) as image:
            if image.mode in ("I", "F") or image.mode.startswith("I;16"):
                return _from_wide_grayscale(path, image.mode, np.asarray(image))
            return np.asarray(image.convert("RGB"), dtype="uint8")
    except (UnidentifiedImageError, OSError) as error:
        raise UsageError(f"cannot read the image {path}: {error}") from None


def _from_wide_grayscale(path, mode, pixels):
    """A 16-bit grayscale image as (height, width, 3) uint8: its 0..65535 range mapped to
    0..255 (PIL's convert("RGB") clips them at 255 instead, a white image)."""
    import numpy as np

    if mode == "F" or pixels.min() < 0 or pixels.max() > 65535:
        raise UsageError(
            f"cannot read the image {path}: its pixels are of PIL mode {mode!r} "
            f"(values {pixels.min():g} .. {pixels.max():g}), not a range that can be told; "
            "save it with 8 or 16 bits per channel"
        )
    gray = np.round(pixels.astype("float64") / 257.0).astype("uint8")
    return np.repeat(gray[..., None], 3, axis=-1)


def resize(image, size):
    """Bilinear resize of a uint8 (height, width, 3) image to `size` = (h, w)."""
    import numpy as np
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize((size[1], size[0]), Image.BILINEAR))


def model_images(images, size, channels):
    """uint8 RGB images (read_image's; any iterable, each resized as it comes) as a
    uint8 batch of the model's size and channels.

    A grayscale model (1 channel) gets ITU-R 601 luma, as PIL's "L" mode.
    """
    import numpy as np

    batch = np.stack([resize(image, size) for image in images])
    if channels == 1:
        luma = batch.astype("float32") @ np.array([0.299, 0.587, 0.114], "float32")
        return luma.round().clip(0, 255).astype("uint8")[..., None]
    if channels != 3:
        raise UsageError(f"images are read as RGB; the model takes {channels} channels")
    return batch


def class_probabilities(model, images, batch_size=32):
    """Class scores of scaled `images`: softmax of the logits, or the model's own
    output when it is already activated (a head with an activation such as
    softmax or sigmoid, or a final Softmax or Activation layer), as the
    exported SavedModel's `probabilities`."""
    import numpy as np

    from keras_vit import export

    if not export.has_head(model):
        raise UsageError("the model has no classification head (num_classes=0)")
    outputs = np.asarray(model.predict(images, batch_size=batch_size, verbose=0), dtype="float64")
    if export.output_activation(model) is not None:
        return outputs
    outputs = np.exp(outputs - outputs.max(axis=-1, keepdims=True))
    return outputs / outputs.sum(axis=-1, keepdims=True)
