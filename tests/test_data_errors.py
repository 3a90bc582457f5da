"""Bad arguments to keras_vit.data: a ValueError (or TypeError) naming the argument."""

import numpy as np
import pytest

from keras_vit import data

pytestmark = pytest.mark.tensorflow_only

RNG = np.random.default_rng(0)
X = RNG.integers(0, 256, size=(12, 8, 8, 3), dtype=np.uint8)
Y = np.arange(12) % 3


@pytest.fixture(scope="module")
def small():
    return data.from_arrays(X, Y, X[:4], Y[:4])


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
        (dict(crop_scale=2.0), r"crop_scale.*\(0, 1\].*2.0"),
        (dict(crop_scale=0), "crop_scale"),
        (dict(skip_steps=-1), "skip_steps.*non-negative.*-1"),
        (dict(skip_steps=1.5), "skip_steps"),
        (dict(batch_size=0), "batch_size=0"),
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
