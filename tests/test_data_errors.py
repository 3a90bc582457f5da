"""Bad arguments to keras_vit.data and keras_vit.preprocess_inputs: a ValueError or TypeError
naming the argument, what was expected and what was received."""

import numpy as np
import pytest
from PIL import Image

from keras_vit import data

pytestmark = pytest.mark.tensorflow_only

RNG = np.random.default_rng(0)
X = RNG.integers(0, 256, size=(12, 8, 8, 3), dtype=np.uint8)
Y = np.arange(12) % 3


@pytest.fixture(scope="module")
def small():
    return data.from_arrays(X, Y, X[:4], Y[:4])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    for name in ("a", "b"):
        (root / name).mkdir()
        for i in range(3):
            Image.fromarray(X[i]).save(root / name / f"{i}.png")
    return str(root)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(y_train=Y - 1), "y_train.*non-negative.*-1"),
        (dict(y_train=Y + 0.5), "y_train.*integer class indices.*0.5"),
        (dict(y_train=np.array(["cat"] * 12)), "y_train.*integer class indices.*cat"),
        (dict(y_train=np.eye(3)[Y]), "y_train.*shape.*one-hot"),
        (dict(x_train=X[:0], y_train=Y[:0]), "x_train.*at least one image"),
        (dict(x_val=X[:4, ..., :1]), r"x_train.*x_val.*same image size.*\(8, 8, 1\)"),
        (dict(x_val=np.zeros((4, 16, 16, 3), "uint8")), r"same image size.*\(16, 16, 3\)"),
        (dict(x_train=X.transpose(0, 3, 1, 2)), "x_train.*channels-first"),
        (dict(x_train=X / 127.5 - 1), r"x_train.*already scaled to \[-1, 1\]"),
        (dict(x_train=X / 255.0), r"x_train.*\[0, 1\].*255"),
        (dict(x_train=X.astype("uint16") * 4), r"x_train.*\[0, 255\].*uint16"),
        (dict(x_train=X.astype("int16") - 10), r"x_train.*\[0, 255\].*-10"),
        (dict(x_train=np.full(X.shape, np.nan)), "x_train.*finite"),
        (dict(x_train=X.astype(object)), "x_train.*object"),
        (dict(class_names=["a"]), "class_names.*at least 3 names.*1 names"),
        (dict(class_names="abc"), "class_names.*list"),
        (dict(image_size=0), "image_size"),
        (dict(y_val=Y[:3]), "same length"),
    ],
)
def test_from_arrays_rejects(kwargs, match):
    args = dict(x_train=X, y_train=Y, x_val=X[:4], y_val=Y[:4]) | kwargs
    with pytest.raises(ValueError, match=match):
        data.from_arrays(**args)


def test_from_arrays_accepts_integral_float_labels_and_float_pixels():
    d = data.from_arrays(X.astype("float32"), Y.astype("float32"), X[:4], Y[:4, None])
    assert d.num_classes == 3 and d.train_size == 12
    d = data.from_arrays(X, Y, X[:4], Y[:4], class_names=["a", "b", "c", "d"])
    assert d.num_classes == 4  # more names than labels: a class without images


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(validation_fraction=1.5), r"validation_fraction.*\(0, 1\).*1.5"),
        (dict(validation_fraction=-0.5), "validation_fraction"),
        (dict(validation_fraction=0), "validation_fraction"),
        (dict(validation_fraction="0.2"), "validation_fraction"),
        (dict(image_size=0), "image_size.*positive.*0"),
        (dict(image_size="32"), "image_size.*positive.*'32'"),
        (dict(seed=-1), r"`seed` must be an integer in \[0, 2\*\*32 - 1\].*seed=-1"),
        (dict(seed=2**32), "`seed`.*seed=4294967296"),
        (dict(seed=1.5), "`seed`.*seed=1.5"),
        (dict(skip_corrupt="no"), "`skip_corrupt` must be True or False.*'no'"),  # was True
    ],
)
@pytest.mark.parametrize("source", ["digits", "folder"])
def test_load_checks_arguments_for_every_source(source, kwargs, match, folder):
    spec = folder if source == "folder" else source
    with pytest.raises(ValueError, match=match):
        data.load(spec, **kwargs)


def test_load_takes_paths_and_npz_files_named_in_capitals(folder, tmp_path):
    # A pathlib.Path was refused as not a string, and "X.NPZ" as not a .npz file.
    import pathlib

    assert data.load(pathlib.Path(folder), image_size=8).train_size == 5
    path = tmp_path / "SMALL.NPZ"
    with open(path, "wb") as file:
        np.savez(file, x_train=X, y_train=Y, x_test=X[:4], y_test=Y[:4])
    for spec in (str(path), path):
        loaded = data.load(spec, image_size=8)
        assert (loaded.train_size, loaded.validation_size) == (12, 4)
    with pytest.raises(ValueError, match="non-empty string or path"):
        data.load(3)


def test_folder_split_keeps_an_image_on_each_side(folder, tmp_path):
    d = data.load(folder, image_size=8, validation_fraction=0.01)
    assert (d.train_size, d.validation_size) == (5, 1)
    d = data.load(folder, image_size=8, validation_fraction=0.99)
    assert (d.train_size, d.validation_size) == (1, 5)
    (tmp_path / "a").mkdir()
    Image.fromarray(X[0]).save(tmp_path / "a" / "0.png")
    with pytest.raises(ValueError, match="at least 2 readable images"):
        data.load(str(tmp_path), image_size=8)


def test_npz_errors_name_the_file(tmp_path):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="garbage.npz.*np.savez.*not a zip file"):
        data.load(str(garbage))
    objects = tmp_path / "objects.npz"
    np.savez(objects, x_train=np.array([X[0], "a"], dtype=object), y_train=Y, x_test=X, y_test=Y)
    with pytest.raises(ValueError, match="x_train in .*objects.npz.*Python objects"):
        data.load(str(objects))
    labels = tmp_path / "labels.npz"
    np.savez(labels, x_train=X, y_train=Y - 1, x_test=X, y_test=Y)
    with pytest.raises(ValueError, match="labels.npz: `y_train`.*non-negative"):
        data.load(str(labels))
    names = tmp_path / "names.npz"
    np.savez(names, x_train=X, y_train=Y, x_test=X[:4], y_test=Y[:4], class_names=["a"])
    with pytest.raises(ValueError, match="names.npz: `class_names`"):
        data.load(str(names))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(crop_scale=2.0), r"crop_scale.*\(0, 1\].*2.0"),
        (dict(crop_scale=0), "crop_scale"),
        (dict(skip_steps=-1), "skip_steps.*non-negative.*-1"),
        (dict(skip_steps=1.5), "skip_steps"),
        (dict(batch_size=0), "batch_size=0"),
        (dict(seed="0"), "`seed`.*seed='0'"),
        (dict(seed=-1), "`seed`.*seed=-1"),
    ],
)
def test_train_pipeline_checks_arguments(small, kwargs, match):
    args = dict(batch_size=4) | kwargs
    with pytest.raises(ValueError, match=match):
        data.train_pipeline(small, **args)


def test_pipelines_check_data_split_and_batch_size(small):
    with pytest.raises(TypeError, match="data.*Data.*ndarray"):
        data.train_pipeline(X, 4)
    with pytest.raises(TypeError, match="data.*Data"):
        data.eval_pipeline(X, 4)
    with pytest.raises(ValueError, match="split.*'validation', 'train'.*'test'"):
        data.eval_pipeline(small, 4, split="test")
    with pytest.raises(ValueError, match="batch_size=0"):
        data.steps_per_epoch(small, 0)
    images, _ = next(iter(data.eval_pipeline(small, 12, split="train")))
    assert images.shape[0] == 12
    assert next(iter(data.train_pipeline(small, 4, crop_scale=1.0)))[0].shape == (4, 8, 8, 3)


# keras_vit.preprocess_inputs -------------------------------------------------


@pytest.mark.parametrize(
    "images, error, match",
    [
        (X / 255.0, ValueError, r"images.*\[0, 255\].*look scaled to \[0, 1\]"),
        (X / 127.5 - 1, ValueError, r"images.*already scaled to \[-1, 1\]"),
        (X.astype("uint16") * 2, ValueError, "images.*dtype uint16"),
        (X.astype("int8"), ValueError, "images.*dtype int8"),
        (X.astype("int32") - 5, ValueError, r"images.*int32 values in \[-5, "),
        (X.astype("int32") + 5, ValueError, r"images.*int32 values in \[5, 260\]"),
        (np.full((2, 2), np.nan), ValueError, "images.*finite"),
        (X > 100, ValueError, "images.*dtype bool"),
        ("cat.png", TypeError, "images.*cat.png.*load it first"),
        (None, TypeError, "images=None"),
        ([[0, 1], [2]], ValueError, "images.*ragged"),
        (np.array(["a"]), TypeError, "images.*dtype <U1"),
    ],
)
def test_preprocess_inputs_rejects(images, error, match):
    import keras_vit

    with pytest.raises(error, match=match):
        keras_vit.preprocess_inputs(images)


def test_preprocess_inputs_accepts_pixel_values_and_symbolic_tensors():
    import keras
    import tensorflow as tf

    import keras_vit

    scaled = X / 127.5 - 1
    for images in (X, X.astype("int64"), X.astype("float32"), tf.constant(X, tf.float32)):
        np.testing.assert_allclose(keras_vit.preprocess_inputs(images), scaled, atol=1e-6)
    assert keras_vit.preprocess_inputs(np.zeros((1, 2, 2, 3), "float32")).numpy().max() == -1
    with pytest.raises(ValueError, match="already scaled"):
        keras_vit.preprocess_inputs(keras_vit.preprocess_inputs(X))  # an eager tensor
    # Traced or symbolic: values unknown, only the dtype is checked.
    stream = tf.data.Dataset.from_tensor_slices(X.astype("float32")).batch(4)
    first = next(iter(stream.map(keras_vit.preprocess_inputs)))
    np.testing.assert_allclose(first, scaled[:4], atol=1e-6)
    with pytest.raises(ValueError, match="int8"):
        tf.data.Dataset.from_tensor_slices(X.astype("int8")).map(keras_vit.preprocess_inputs)
    traced = tf.function(keras_vit.preprocess_inputs)
    np.testing.assert_allclose(traced(tf.constant(X, tf.float32)), scaled, atol=1e-6)
    inputs = keras.Input((8, 8, 3), dtype="uint8")
    model = keras.Model(inputs, keras_vit.preprocess_inputs(inputs))
    np.testing.assert_allclose(model(X), scaled, atol=1e-6)
