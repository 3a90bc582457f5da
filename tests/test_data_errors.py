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
