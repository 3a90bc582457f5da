"""SavedModel and TFLite export, and reloading a trained model.

`export_saved_model` writes a SavedModel for TF Serving and
`tf.saved_model.load`. Its signatures:

- `serving_default`: `images`, uint8 [batch, height, width, channels] of any
  height and width. The images are resized (bilinear, antialiased) to the
  model's resolution and scaled to [-1, 1] inside the graph.
- `serving_float`: `images`, float32 [batch, model height, model width,
  channels], already scaled to [-1, 1] (what the Keras model takes).

Both return a dict of float32 (and int32 / string) tensors: `logits`,
`probabilities`, `top_k_indices`, `top_k_probabilities` and, when class names
are given, `top_k_class_names`. A model without a head (`num_classes=0`)
returns `features` only.

What `logits` means: a head without an activation (the default,
`classifier_activation=None`) gives logits and `probabilities` is their
softmax. A head with an activation (e.g. "softmax" or "sigmoid") gives its
pre-activation as `logits` (recomputed from the head's kernel and bias) and the
model's own output as `probabilities`; so does a model ending in a Softmax
or Activation layer (that layer's input is `logits`). A functional model
called as the last layer of another one is looked into for its head.

Needs TensorFlow (imported when a function here is called), whatever the
Keras backend the package was imported with.
"""

import collections
import json
import numbers
import os
import posixpath
import tempfile
import uuid

import keras
import numpy as np

from keras_vit import _leftovers
from keras_vit.layers._checks import boolean, path_like
from keras_vit.layers.attention import batched_core_only

QUANTIZATIONS = (None, "dynamic", "float16")
CLASS_NAME_FILES = ("classes.json", "class_names.json")
# What a SavedModel directory holds: what `overwrite=True` replaces in one.
SAVED_MODEL_ENTRIES = (
    "saved_model.pb",
    "saved_model.pbtxt",
    "fingerprint.pb",
    "keras_metadata.pb",
    "variables",
    "assets",
    "assets.extra",
)
MODEL_FILE = "model.keras"
# keras_vit layers whose output is features: a model ending in one has no head.
FEATURE_LAYERS = ("pooling", "pre_logits", "encoder_norm")


def _tf():
    import tensorflow as tf

    return tf


# Checks --------------------------------------------------------------------


def _check_backend():
    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            "Export needs the TensorFlow backend of Keras (set KERAS_BACKEND=tensorflow "
            f"before importing keras). Received: backend {keras.backend.backend()!r}"
        )


def _check_model(model):
    _check_backend()
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a keras.Model. Received: model of type {type(model).__name__}"
        )
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):  # a subclassed model, or a Sequential not built
        inputs = outputs = None
    if inputs is None or outputs is None:
        raise ValueError(
            "`model` must be a functional keras.Model (keras.Model(inputs, outputs), a keras_vit "
            "model, or a Sequential that starts with keras.Input) so that its input is known; "
            "a subclassed or not yet built model has none. "
            f"Received: model {model.name!r} of type {type(model).__name__}"
        )
    if len(model.inputs) != 1:
        raise ValueError(
            "`model` must have one input (NHWC images). "
            f"Received: a model with {len(model.inputs)} inputs"
        )
    shape = tuple(model.inputs[0].shape)
    if len(shape) != 4 or shape[3] is None:
        raise ValueError(
            "`model` must take images (batch, height, width, channels) with a known "
            f"channel count. Received: a model with input shape {shape}"
        )
    if len(model.outputs) != 1 or len(model.outputs[0].shape) != 2:
        raise ValueError(
            "`model` must have one output of shape (batch, classes or features). "
            f"Received: outputs of shapes {[tuple(o.shape) for o in model.outputs]}"
        )
    from keras_vit.models import _takes_any_size, model_image_size

    if _takes_any_size(model):
        # A keras_vit model built with dynamic_image_size=True: its own size.
        try:
            return (*model_image_size(model), shape[3])
        except ValueError:
            raise ValueError(
                "`model` must take images of a fixed size (batch, height, width, channels), "
                "or be a keras_vit model built with dynamic_image_size=True. "
                f"Received: a model with input shape {shape}"
            ) from None
    return shape[1:]


def _any_size(model):
    """None for a model of a fixed size; for one that takes any size, the
    (rows, columns) its images' sides must be multiples of."""
    from keras_vit.models import _grid_stride, _takes_any_size

    return _grid_stride(model) if _takes_any_size(model) else None


def _last_call(model):
    """(layer, its input tensor in `model`'s graph) of the call giving `model`'s output."""
    history = getattr(model.outputs[0], "_keras_history", None)
    layer = getattr(history, "operation", None)
    if layer is None:
        return None, None
    node = layer._inbound_nodes[history.node_index]
    inputs = node.input_tensors
    return layer, inputs[0] if len(inputs) == 1 else None


def _nested(layer):
    """Whether `layer` is a functional model (one input, one output) used as a layer."""
    if not isinstance(layer, keras.Model):
        return False
    try:
        return len(layer.inputs) == 1 and len(layer.outputs) == 1
    except (AttributeError, ValueError):  # a subclassed model
        return False


def _output_layer(model):
    """The layer computing `model`'s output, inside the functional models it calls
    as layers (a keras_vit model behind layers that preprocess its input)."""
    layer = _last_call(model)[0]
    while _nested(layer):
        layer = _last_call(layer)[0]
    return layer


def _with_last_input(model):
    """`model` giving [the input of `_output_layer(model)`, its output]: one pass."""
    layer, inputs = _last_call(model)
    if _nested(layer):
        features, outputs = _with_last_input(layer)(inputs)
        return keras.Model(model.inputs[0], [features, outputs])
    return keras.Model(model.inputs[0], [inputs, model.outputs[0]])


def has_head(model):
    """Whether the output is class scores rather than features (num_classes=0)."""
    layer = _output_layer(model)
    return getattr(layer, "name", None) not in FEATURE_LAYERS


def _check_class_names(class_names, num_outputs, has_head):
    if class_names is None:
        return None
    # A list, a tuple or a 1-D array: an ordered sequence (a set or a dict has no
    # order to map class indices to, a generator would be used up by the checks).
    is_array = isinstance(class_names, np.ndarray) and class_names.ndim == 1
    if not (is_array or isinstance(class_names, (list, tuple))) or not all(
        isinstance(name, str) for name in class_names
    ):
        raise TypeError(
            "`class_names` must be a list of strings, one per class in index order. "
            f"Received: class_names={class_names!r} of type {type(class_names).__name__}"
        )
    class_names = [str(name) for name in class_names]
    if not has_head:
        raise ValueError(
            "`class_names` needs a model with a classification head; this model has "
            f"num_classes=0 (features out). Received: {len(class_names)} class names"
        )
    if len(class_names) != num_outputs:
        raise ValueError(
            f"`class_names` must have one name per class ({num_outputs}). "
            f"Received: {len(class_names)} class names"
        )
    repeated = _repeated(class_names)
    if repeated:
        raise ValueError(
            "`class_names` must name each class once (top_k_class_names would not tell them "
            f"apart). Received: class_names with {repeated!r} more than once"
        )
    return class_names


def _repeated(names):
    """The names that `names` holds more than once, sorted (one pass: 21k ImageNet names)."""
    return sorted(name for name, count in collections.Counter(names).items() if count > 1)


def _check_top_k(top_k):
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
        raise ValueError(f"`top_k` must be a positive integer. Received: top_k={top_k!r}")
    return int(top_k)


def _check_path(path, argument="path"):
    return path_like(argument, path)


def _is_remote(path):
    """Whether `path` is a URL that only TensorFlow's file system reaches (gs://...)."""
    return "://" in path


def check_target(path, overwrite, directory, argument="path"):
    """Raise unless the SavedModel `directory` or the file at `path` may be written.

    A new path and an empty directory (or an empty file) may; an existing
    non-empty one only with `overwrite=True`. A file where a directory is to
    be written, or the reverse, never; nor a path under a file. `argument`
    names `path` in the messages (e.g. "--output" on the command line).
    """
    path = _check_path(path, argument)
    overwrite = boolean("overwrite", overwrite)
    if not directory and path.endswith(("/", os.sep)):
        raise ValueError(
            f"`{argument}` must be the .tflite file to write; {path!r} ends in a path separator "
            f"(a folder). Received: {argument}={path!r}"
        )
    files = _files(path)
    exists = files.exists(path)
    isdir = exists and files.isdir(path)
    empty = exists and (not files.listdir(path) if isdir else files.size(path) == 0)
    if not exists:
        files.check_parent(path, argument)
        return
    if directory and not isdir:
        raise ValueError(
            f"`{argument}` must be a directory to write the SavedModel in (new or empty); "
            f"{path!r} is a file. Received: {argument}={path!r}"
        )
    if not directory and isdir:
        raise ValueError(
            f"`{argument}` must be the .tflite file to write; {path!r} is a directory. "
            f"Received: {argument}={path!r}"
        )
    if not empty and not overwrite:
        what = "a directory that is not empty" if isdir else "a file"
        replaced = "the SavedModel in it (its other files stay)" if isdir else "it"
        raise FileExistsError(
            f"`{argument}` {path!r} already exists: {what}. Pass overwrite=True to replace "
            f"{replaced}, or choose another path. Received: {argument}={path!r}, overwrite=False"
        )


def _tag(kind):
    """`kind` (partial, previous) with this process, its host and a random part."""
    return f"{kind}-{_leftovers.owner()}-{uuid.uuid4().hex[:12]}"


class _LocalFiles:
    """The few file operations an export makes, on the local file system."""

    renames_folders_whole = True  # a folder's rename is one step

    @staticmethod
    def check_parent(path, argument):
        """Raise unless the nearest existing folder above the new `path` is a folder."""
        above = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(above):
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            raise ValueError(
                f"`{argument}` {path!r} cannot be written: {above!r} is a file, not a folder. "
                f"Received: {argument}={path!r}"
            )

    @staticmethod
    def join(path, name):
        return os.path.join(path, name)

    @staticmethod
    def split(path):
        return os.path.split(os.path.normpath(os.path.abspath(path)))

    @staticmethod
    def makedirs(path):
        os.makedirs(path, exist_ok=True)

    @staticmethod
    def mkdir(path):
        os.mkdir(path)  # the default permissions, unlike tempfile.mkdtemp's 0700

    @staticmethod
    def rename(source, target):
        os.rename(source, target)

    @staticmethod
    def lexists(path):
        return os.path.lexists(path)

    @staticmethod
    def exists(path):
        return os.path.exists(path)

    @staticmethod
    def size(path):
        return os.path.getsize(path)

    @staticmethod
    def isdir(path):
        return os.path.isdir(path)

    @staticmethod
    def listdir(path):
        return os.listdir(path)

    @staticmethod
    def remove(path):
        _leftovers.remove(path)

    @staticmethod
    def write_new(path, data):
        with open(path, "xb") as file:
            file.write(data)

    @staticmethod
    def replace(source, target):
        os.replace(source, target)


class _RemoteFiles:
    """The same operations through TensorFlow's file system (gs://, s3://, hdfs://...).

    There a folder's rename may be a copy of each file and a delete (Cloud
    Storage has no folders), so it is not one step: the SavedModel is moved in
    entry by entry, saved_model.pb last, as into an existing local folder.
    A folder is moved file by file here too, which is what Cloud Storage
    does anyway.
    """

    renames_folders_whole = False

    @staticmethod
    def check_parent(path, argument):
        """Nothing to check before writing: a path under a file fails when its folder is made."""
        del path, argument

    @staticmethod
    def join(path, name):
        return posixpath.join(path, name)

    @staticmethod
    def split(path):
        return posixpath.split(path.rstrip("/"))

    @staticmethod
    def makedirs(path):
        _tf().io.gfile.makedirs(path)

    @staticmethod
    def mkdir(path):
        _tf().io.gfile.mkdir(path)

    @staticmethod
    def rename(source, target):
        """Moves a file, or a folder file by file (not every file system moves a
        folder's contents with it: TensorFlow's in-memory ram:// does not)."""
        gfile = _tf().io.gfile
        if not gfile.isdir(source):
            gfile.rename(source, target, overwrite=False)
            return
        gfile.makedirs(target)
        for name in _RemoteFiles.listdir(source):
            _RemoteFiles.rename(posixpath.join(source, name), posixpath.join(target, name))
        gfile.rmtree(source)

    @staticmethod
    def lexists(path):
        return _tf().io.gfile.exists(path)

    exists = lexists  # no symbolic links here

    @staticmethod
    def size(path):
        return _tf().io.gfile.stat(path).length

    @staticmethod
    def isdir(path):
        return _tf().io.gfile.isdir(path)

    @staticmethod
    def listdir(path):
        # Cloud Storage lists a folder's subfolders with a trailing "/".
        return [name.rstrip("/") for name in _tf().io.gfile.listdir(path)]

    @staticmethod
    def remove(path):
        gfile = _tf().io.gfile
        if gfile.isdir(path):
            gfile.rmtree(path)
        elif gfile.exists(path):
            gfile.remove(path)

    @staticmethod
    def write_new(path, data):
        with _tf().io.gfile.GFile(path, "wb") as file:
            file.write(data)

    @staticmethod
    def replace(source, target):
        _tf().io.gfile.rename(source, target, overwrite=True)


def _files(path):
    return _RemoteFiles if _is_remote(path) else _LocalFiles


def _discard(files, path):
    """Removes `path` (a staging folder or file) if it is there; errors are ignored."""
    try:
        files.remove(path)
    except Exception:  # noqa: BLE001 (already gone, or the file system refused: left over)
        pass


def _sibling(path):
    """A new hidden name beside `path`, on the same file system (for an atomic rename)."""
    files = _files(path)
    parent, name = files.split(path)
    files.makedirs(parent)
    return files.join(parent, f".{name}.{_tag('partial')}")


def _hidden_inside(path, kind):
    """A new hidden name inside the directory `path`."""
    return _files(path).join(path, f".{_tag(kind)}")


def _remove_left_over(path):
    """After an export to `path` succeeded: removes the hidden entries that exports
    to `path` killed half-way left beside it and inside it (see keras_vit._leftovers)."""
    files = _files(path)
    parent, name = files.split(path)
    found = {"listdir": files.listdir, "delete": files.remove, "join": files.join}
    _leftovers.remove_ended(parent, f".{name}.partial-", **found)
    if files.isdir(path):
        _leftovers.remove_ended(path, ".partial-", **found)
        _leftovers.remove_ended(path, ".previous-", **found)


def _proto_last(names):
    """`names` with saved_model.pb (what makes a folder look like a SavedModel) last."""
    return sorted(names, key=lambda name: (name.startswith("saved_model.pb"), name))


def _write_saved_model(archive, path):
    """Writes the SavedModel aside, then moves it in: a failed export leaves
    `path` as it was, and a killed one never leaves a saved_model.pb beside
    another export's variables."""
    files = _files(path)
    exists = files.lexists(path)
    # Inside an existing directory, on its file system (it may be a mount point).
    staging = _hidden_inside(path, "partial") if exists else _sibling(path)
    files.mkdir(staging)
    try:
        archive.write_out(staging, verbose=False)
        if files.renames_folders_whole and not exists:
            files.rename(staging, path)  # one step: the SavedModel is there whole, or not at all
        else:
            if not exists:
                files.mkdir(path)
            _move_in(staging, path)
    finally:
        _discard(files, staging)
    _remove_left_over(path)


def _move_in(staging, path):
    """Replaces the SavedModel entries of the directory `path` by those of `staging`.

    The old entries are moved aside first (saved_model.pb first) and the new
    ones in after (saved_model.pb last), so that `path` holds a saved_model.pb
    only beside the variables of its own export. Other files stay. An error
    puts the old entries back.
    """
    files = _files(path)
    written = _proto_last(files.listdir(staging))
    old = [
        name
        for name in reversed(_proto_last(set(SAVED_MODEL_ENTRIES) | set(written)))
        if files.lexists(files.join(path, name))
    ]
    backup = _hidden_inside(path, "previous")
    files.mkdir(backup)
    moved_out, moved_in = [], []
    try:
        for name in old:
            files.rename(files.join(path, name), files.join(backup, name))
            moved_out.append(name)
        for name in written:
            files.rename(files.join(staging, name), files.join(path, name))
            moved_in.append(name)
    except BaseException:
        for name in reversed(moved_in):
            files.remove(files.join(path, name))
        for name in reversed(moved_out):
            files.rename(files.join(backup, name), files.join(path, name))
        if not files.listdir(backup):  # kept, with old entries, if one could not go back
            files.remove(backup)
        raise
    _discard(files, backup)


def _write_file(path, data):
    """Writes `data` to a new file beside `path`, then renames it to `path`."""
    files = _files(path)
    partial = _sibling(path)
    try:
        files.write_new(partial, data)
        files.replace(partial, path)
    except BaseException:
        _discard(files, partial)
        raise
    _remove_left_over(path)


# The serving computation ----------------------------------------------------


def _activated(activation):
    """Whether a layer's `activation` changes its input (not None, not linear)."""
    return activation is not None and activation is not keras.activations.linear


def output_activation(model):
    """How the class scores of `model` are activated, if they are.

    None: the output is logits (or features, without a head), and their
    softmax is the probabilities. "dense": the head is a Dense layer with an
    activation (e.g. `classifier_activation="softmax"` or "sigmoid"). "layer":
    the model ends in a Softmax or Activation layer. A functional model called
    as the last layer of another one is looked into.
    """
    if not has_head(model):
        return None
    layer = _output_layer(model)
    if isinstance(layer, keras.layers.Dense):
        return "dense" if _activated(getattr(layer, "activation", None)) else None
    if isinstance(layer, keras.layers.Softmax):
        return "layer"
    if isinstance(layer, keras.layers.Activation) and _activated(layer.activation):
        return "layer"
    return None


class _Outputs:
    """Turns a batch of model inputs into the dict the signatures return."""

    def __init__(self, model, top_k, class_names=None):
        self.model = model
        self.has_head = has_head(model)
        self.num_outputs = int(model.outputs[0].shape[-1])
        self.top_k = min(top_k, self.num_outputs)
        self.class_names = _check_class_names(class_names, self.num_outputs, self.has_head)
        # How the logits are had when the output is already activated: "dense",
        # a head Dense with an activation (recomputed from its input, kernel and
        # bias); "layer", a final Softmax or Activation layer (its input).
        self.activated = output_activation(model)
        self.head = _output_layer(model) if self.activated == "dense" else None
        if self.activated is not None:
            # One pass giving both the last layer's input and the model's output.
            self.model = _with_last_input(model)

    def __call__(self, images):
        tf = _tf()
        if self.activated is None:
            outputs = tf.cast(self.model(images, training=False), tf.float32)
            if not self.has_head:
                return {"features": outputs}
            logits = outputs
            probabilities = tf.nn.softmax(logits, axis=-1)
        else:
            features, outputs = self.model(images, training=False)
            probabilities = tf.cast(outputs, tf.float32)
            logits = tf.cast(features, tf.float32)
            if self.activated == "dense":
                # The head's pre-activation, in float32.
                logits = tf.matmul(logits, tf.cast(self.head.kernel, tf.float32))
                if self.head.bias is not None:
                    logits = logits + tf.cast(self.head.bias, tf.float32)
        top_k_probabilities, top_k_indices = tf.math.top_k(probabilities, k=self.top_k)
        result = {
            "logits": logits,
            "probabilities": probabilities,
            "top_k_indices": top_k_indices,
            "top_k_probabilities": top_k_probabilities,
        }
        if self.class_names is not None:
            names = tf.constant(self.class_names, dtype=tf.string)
            result["top_k_class_names"] = tf.gather(names, top_k_indices)
        return result


def resize_and_scale(images, image_size):
    """The uint8 signature's preprocessing, as a TensorFlow function.

    Resizes with `tf.image.resize(..., method="bilinear", antialias=True)` to
    `image_size` and maps [0, 255] to [-1, 1] as `x / 127.5 - 1`.

    Args:
        images: a uint8 (or 0..255 float) tensor [batch, height, width, channels].
        image_size: the model's (height, width).

    Returns:
        A float32 tensor [batch, image_size[0], image_size[1], channels].
    """
    tf = _tf()
    images = tf.cast(images, tf.float32)
    images = tf.image.resize(images, image_size, method="bilinear", antialias=True)
    return images / 127.5 - 1.0


def _checked(images, height, width, channels, multiple_of=None):
    """`images` behind run-time checks of its shape, with readable messages.

    The signatures' TensorSpecs reject a wrong dtype or channel count when
    the loaded function is called from Python, but a call through
    `loaded.signatures[...]` (or TF Serving) checks the dtype only.
    `multiple_of`: (rows, columns) the height and width must be multiples of.
    """
    tf = _tf()
    # The rank first: a signature called through `loaded.signatures[...]` or TF
    # Serving gets tensors of any rank (an assertion on the rank would be
    # folded away: the graph takes the rank of its input spec as known).
    images = tf.ensure_shape(images, [None, None, None, None], name="images_must_be_of_rank_4")
    shape = tf.shape(images)
    checks = [
        tf.debugging.assert_equal(
            shape[3],
            channels,
            message=f"`images` must have {channels} channels (the last axis)",
        ),
        tf.debugging.assert_positive(
            shape[1] * shape[2], message="`images` must have a non-zero height and width"
        ),
    ]
    if multiple_of is not None:
        checks.append(
            tf.debugging.assert_equal(
                shape[1:3] % tf.constant(multiple_of),
                tf.zeros([2], tf.int32),
                message=f"`images` height and width must be multiples of {tuple(multiple_of)}",
            )
        )
    if height is not None:
        checks.append(
            tf.debugging.assert_equal(
                shape[1:3],
                tf.constant([height, width]),
                message=f"`images` must be {height}x{width} (the model's size) for this signature",
            )
        )
    with tf.control_dependencies(checks):
        return tf.identity(images)


def _layers(model):
    """The layers of `model`, and those of the models it calls as layers."""
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _layers(layer)


def _float32_copy(model):
    """`model` rebuilt with float32 layers (same weights), or `model` itself.

    TFLite has no bfloat16 kernels, so a mixed-precision model is converted
    through a float32 copy.
    """
    if all(layer.dtype_policy.compute_dtype == "float32" for layer in _layers(model)):
        return model

    def to_float32(config):
        if isinstance(config, dict):
            if config.get("class_name") in ("DTypePolicy", "FloatDTypePolicy"):
                return "float32"
            return {key: to_float32(value) for key, value in config.items()}
        if isinstance(config, list):
            return [to_float32(value) for value in config]
        return config

    import keras_vit  # noqa: F401  (registers the layers)

    config = keras.saving.serialize_keras_object(model)
    copy = keras.saving.deserialize_keras_object(to_float32(config), safe_mode=True)
    copy.set_weights(model.get_weights())
    return copy


def _archive(model, endpoints):
    archive = keras.export.ExportArchive()
    archive.track(model)
    for name, (function, spec) in endpoints.items():
        archive.add_endpoint(name, function, input_signature=[spec])
    return archive


def _saved_model_archive(model, preprocessing, class_names, top_k):
    tf = _tf()
    height, width, channels = _check_model(model)
    outputs = _Outputs(model, top_k, class_names)
    # A dynamic_image_size model: float images of any size it takes.
    stride = _any_size(model)
    size = (height, width) if stride is None else (None, None)
    float_spec = tf.TensorSpec([None, *size, channels], tf.float32, name="images")

    def serve_float(images):
        return outputs(_checked(images, *size, channels, multiple_of=stride))

    uint8_spec = tf.TensorSpec([None, None, None, channels], tf.uint8, name="images")

    def serve_uint8(images):
        images = _checked(images, None, None, channels)
        return outputs(resize_and_scale(images, (height, width)))

    endpoints = {
        "serving_default": (serve_uint8, uint8_spec)
        if preprocessing
        else (serve_float, float_spec),
        "serving_float": (serve_float, float_spec),
    }
    return _archive(model, endpoints)


def export_saved_model(model, path, preprocessing=True, class_names=None, top_k=5, overwrite=False):
    """Writes `model` as a SavedModel for TF Serving and `tf.saved_model.load`.

    The SavedModel needs TensorFlow alone to run (not keras_vit, not Keras).
    Signatures (see the module docstring for the outputs):

    - `serving_default`: uint8 images [batch, any height, any width,
      channels], resized and scaled inside (`preprocessing=True`); with
      `preprocessing=False` it is the float signature.
    - `serving_float`: float32 images at the model's size, scaled to [-1, 1].
      For a keras_vit model built with `dynamic_image_size=True`: any height
      and width that are multiples of its patch size (the uint8 signature
      resizes to the size it was built for).

    Outputs are float32 whatever the model's dtype policy (mixed precision
    included). A model built under a `tf.distribute` strategy exports as is.

    Args:
        model: a `keras.Model` taking NHWC images of a fixed size (or a
            keras_vit `dynamic_image_size` model), with one (batch, classes)
            output (or (batch, features) for num_classes=0).
        path: the SavedModel directory to write.
        preprocessing: whether `serving_default` takes uint8 images of any
            size (True) or float images ready for the model (False).
        class_names: optional list (or tuple, or 1-D array) of strings, one
            per class in index order, each once; adds `top_k_class_names` to
            the outputs.
        top_k: how many of the best classes to return (at most the number of
            classes).
        overwrite: whether to replace the SavedModel of an existing directory
            that is not empty (its saved_model.pb, variables/, assets/ and
            fingerprint.pb; other files in it stay). False (the default)
            raises a FileExistsError for such a directory; a new path or an
            empty directory is written either way. The SavedModel is written
            aside first and moved in when complete (saved_model.pb last), so
            a failed export leaves `path` as it was.

    Returns:
        `path`.

    Raises:
        FileExistsError: when `path` is a directory that is not empty and
            `overwrite` is False.
        ValueError: when `path` is a file or lies under one, or `model`,
            `class_names` or `top_k` is not as described above.

    Example:
    >>> import os, tempfile
    >>> import keras_vit
    >>> model = keras_vit.VisionTransformer(image_size=32, patch_size=8,
    ...     num_layers=1, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=3)
    >>> path = export_saved_model(model, os.path.join(tempfile.mkdtemp(), "vit"),
    ...     class_names=["cat", "dog", "fish"], top_k=2)
    """
    path = _check_path(path)
    preprocessing = boolean("preprocessing", preprocessing)
    top_k = _check_top_k(top_k)
    check_target(path, overwrite, directory=True)
    archive = _saved_model_archive(model, preprocessing, class_names, top_k)
    _write_saved_model(archive, path)
    return path


def export_tflite(model, path, quantization=None, overwrite=False):
    """Writes `model` as a TFLite flat buffer.

    The TFLite model takes float32 images [batch, height, width, channels] at
    the model's size (for a `dynamic_image_size` model, the size it was built
    for), scaled to [-1, 1] (`keras_vit.preprocess_inputs`), and
    its `serving_default` signature returns `logits` and `probabilities` (as
    in `export_saved_model`; `features` for a model without a head). The
    batch dimension is dynamic (use `interpreter.resize_tensor_input`).

    Args:
        model: a `keras.Model` as for `export_saved_model`.
        path: the `.tflite` file to write.
        quantization: None (float32), "dynamic" (int8 weights, dynamic-range
            quantization; about 4x smaller) or "float16" (float16 weights;
            about 2x smaller).
        overwrite: whether to replace an existing file that is not empty.
            False (the default) raises a FileExistsError for one. The file is
            written beside `path` first and renamed to it when complete.

    Returns:
        `path`.

    Raises:
        FileExistsError: when `path` is a file that is not empty and
            `overwrite` is False.
    """
    tf = _tf()
    path = _check_path(path)
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"`quantization` must be one of {QUANTIZATIONS}. Received: quantization={quantization!r}"
        )
    check_target(path, overwrite, directory=False)
    height, width, channels = _check_model(model)
    model = _float32_copy(model)
    outputs = _Outputs(model, top_k=1)
    spec = tf.TensorSpec([None, height, width, channels], tf.float32, name="images")
    keys = ("features", "logits", "probabilities")

    def serve(images):
        result = outputs(images)
        return {key: result[key] for key in keys if key in result}

    # The batched attention core: TFLite has no use for the per-head loop
    # that TensorFlow's graph mode on CPUs takes at long sequences.
    with batched_core_only(), tempfile.TemporaryDirectory() as directory:
        archive = _archive(model, {"serving_default": (serve, spec)})
        archive.write_out(directory, verbose=False)
        converter = tf.lite.TFLiteConverter.from_saved_model(directory)
        if quantization is not None:
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
        if quantization == "float16":
            converter.target_spec.supported_types = [tf.float16]
        flat_buffer = converter.convert()
    _write_file(path, flat_buffer)
    return path


# Reloading a trained model ---------------------------------------------------


def read_class_names(file):
    """Reads class names from a JSON file: a list of strings, or an object holding one
    under "class_names" (or "classes").

    Raises:
        ValueError: naming the file, when it is not UTF-8 text, not JSON, or
            does not hold a list of strings.
        OSError: when it cannot be read.
    """
    file = _check_path(file, "file")
    try:
        with open(file, encoding="utf-8") as handle:
            data = json.load(handle)
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{file!r} is not UTF-8 text ({error.reason} at byte {error.start}); it must hold a "
            "JSON list of class names"
        ) from None
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{file!r} is not valid JSON ({error}); it must hold a JSON list of class names"
        ) from None
    if isinstance(data, dict):
        for key in ("class_names", "classes"):
            if key in data:
                data = data[key]
                break
    if not isinstance(data, list) or not all(isinstance(name, str) for name in data):
        raise ValueError(
            f"{file!r} must hold a JSON list of class names (strings), or an object with a "
            f'"class_names" or "classes" list. Received: {str(data)[:100]}'
        )
    return data


def find_trained(path, argument="path"):
    """Where a trained model and its class names are, without reading them.

    Args:
        path: a `.keras` file, or a training output directory holding
            `model.keras`.
        argument: how errors name `path` (e.g. "--model" on the command line).

    Returns:
        (model_file, class_names_file): the `.keras` file, and the first of
        `CLASS_NAME_FILES` in its directory, or None when there is none.

    Raises:
        FileNotFoundError: `path` does not exist, or is a directory without
            `model.keras`.
        ValueError: `path` is a file that is not a `.keras` file.
    """
    path = _check_path(path, argument)
    if os.path.isdir(path):
        directory, model_file = path, os.path.join(path, MODEL_FILE)
        if not os.path.isfile(model_file):
            best = os.path.join(path, "best.keras")
            hint = (
                f" It holds best.keras, the best model of a run that has not ended (or was "
                f"interrupted): pass {best!r} to use it."
                if os.path.isfile(best)
                else ""
            )
            raise FileNotFoundError(
                f"No {MODEL_FILE} in the folder {path!r}: pass a .keras file or a training "
                f"output folder holding {MODEL_FILE}.{hint} Received: {argument}={path!r}"
            )
    elif os.path.isfile(path):
        if not path.endswith(".keras"):
            raise ValueError(
                f"A .keras file or a training output folder holding {MODEL_FILE} is needed. "
                f"Received: {argument}={path!r}"
            )
        directory, model_file = os.path.dirname(os.path.abspath(path)), path
    else:
        raise FileNotFoundError(f"No such file or folder. Received: {argument}={path!r}")
    for name in CLASS_NAME_FILES:
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate):
            return model_file, candidate
    return model_file, None


def check_class_names(class_names, model, source):
    """Raise ValueError unless `class_names` has one name per class of `model`'s head.

    `source` names where the names came from in the message. A model without
    a head (`num_classes=0`) takes any list. Names must not repeat: a repeated
    name would label two classes alike.
    """
    if class_names is None or not has_head(model):
        return
    classes = model.outputs[0].shape[-1]
    if classes is not None and len(class_names) != classes:
        raise ValueError(
            f"{source} lists {len(class_names)} class names but the model has {classes} "
            "classes; it must list one name per class, in index order"
        )
    repeated = _repeated(class_names)
    if repeated:
        raise ValueError(
            f"{source} lists {repeated!r} more than once; it must name each class once, "
            "in index order"
        )


def load_trained(path):
    """Loads a trained model and its class names.

    Args:
        path: a `.keras` file, or a training output directory holding
            `model.keras` and optionally `classes.json` (or
            `class_names.json`): a JSON list of class names in index order
            (or an object with a "class_names" list). Beside a `.keras` file,
            the same class-name files in its directory are used.

    Returns:
        (model, class_names): the `keras.Model` and a list of strings, or
        None when no class-name file is found or the model has no head
        (`num_classes=0`: no classes for the names to label).

    Raises:
        FileNotFoundError, ValueError: see `find_trained` and
            `read_class_names`; also a ValueError when the class-name file
            does not list one name per class of the model.
    """
    model_file, names_file = find_trained(path)
    class_names = None if names_file is None else read_class_names(names_file)
    import keras_vit  # noqa: F401  (registers the layers)

    model = keras.models.load_model(model_file, safe_mode=True)
    if not has_head(model):
        return model, None
    check_class_names(class_names, model, f"The class-name file {names_file!r}")
    return model, class_names
