"""Input pipelines: digits, arrays, folders of images (incl. a corrupt file), tfds."""

import numpy as np
import pytest
from PIL import Image

from keras_vit import data

pytestmark = pytest.mark.tensorflow_only


def _arrays(n=40, size=16, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)
    y = np.arange(n) % classes
    return x, y


def test_digits_split_is_stratified_and_fixed():
    x_train, y_train, x_val, y_val = data.digits_arrays(image_size=16)
    assert x_train.shape == (1437, 16, 16, 3) and x_val.shape == (360, 16, 16, 3)
    assert x_train.dtype == np.uint8
    counts = np.bincount(y_val, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37
    again = data.digits_arrays(image_size=16)
    np.testing.assert_array_equal(again[3], y_val)


def test_eval_pipeline_scales_to_unit_range():
    x, y = _arrays()
    d = data.from_arrays(x, y, x, y)
    images, labels = next(iter(data.eval_pipeline(d, batch_size=8)))
    np.testing.assert_allclose(images.numpy(), x[:8] / 127.5 - 1.0, atol=1e-6)
    np.testing.assert_array_equal(labels.numpy().argmax(-1), y[:8])
    assert labels.shape == (8, 4)


def test_train_stream_is_deterministic_and_skips():
    x, y = _arrays()
    d = data.from_arrays(x, y, x, y)
    first = [b[0].numpy() for b in data.train_pipeline(d, 8, seed=3).take(7)]
    again = [b[0].numpy() for b in data.train_pipeline(d, 8, seed=3).take(7)]
    skipped = [b[0].numpy() for b in data.train_pipeline(d, 8, seed=3, skip_steps=4).take(3)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(first[4:], skipped):
        np.testing.assert_array_equal(a, b)
    assert first[0].min() >= -1.0 and first[0].max() <= 1.0
    assert not np.array_equal(first[0], first[5])  # the next epoch is reshuffled


@pytest.mark.parametrize("option", ["mixup", "cutmix", "rand_augment"])
def test_batch_augmentations_run(option):
    x, y = _arrays()
    d = data.from_arrays(x, y, x, y)
    images, labels = next(iter(data.train_pipeline(d, 8, **{option: True})))
    assert images.shape == (8, 16, 16, 3) and labels.shape == (8, 4)
    np.testing.assert_allclose(labels.numpy().sum(-1), 1.0, atol=1e-5)
    assert images.numpy().min() >= -1.0 - 1e-5 and images.numpy().max() <= 1.0 + 1e-5


def _write_folder(root, corrupt=True):
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for i in range(5):
            array = rng.integers(0, 256, size=(20 + i, 24, 3), dtype=np.uint8)
            ext = "png" if i % 2 else "jpg"
            Image.fromarray(array).save(root / name / f"{i}.{ext}")
    (root / "dog" / "notes.txt").write_text("not an image")
    if corrupt:
        (root / "cat" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")


def test_folder_corrupt_file_is_named(tmp_path):
    _write_folder(tmp_path)
    with pytest.raises(ValueError, match="broken.png"):
        data.load(str(tmp_path), image_size=16)


def test_folder_skips_and_counts_corrupt(tmp_path, capsys):
    _write_folder(tmp_path)
    paths, labels, names, skipped = data.list_image_folder(str(tmp_path), skip_corrupt=True)
    assert names == ["cat", "dog"] and len(paths) == 10 and len(skipped) == 1
    assert np.bincount(labels).tolist() == [5, 5]
    d = data.load(str(tmp_path), image_size=16, skip_corrupt=True)
    assert "Skipped 1" in capsys.readouterr().out
    assert d.train_size == 8 and d.validation_size == 2 and d.class_names == ["cat", "dog"]
    images, labels = next(iter(data.train_pipeline(d, 4)))
    assert images.shape == (4, 16, 16, 3) and labels.shape == (4, 2)


def test_npz_and_bad_specs(tmp_path):
    x, y = _arrays()
    path = tmp_path / "d.npz"
    np.savez(path, x_train=x, y_train=y, x_test=x[:8], y_test=y[:8])
    d = data.load(str(path))
    assert (d.train_size, d.validation_size, d.num_classes) == (40, 8, 4)
    np.savez(tmp_path / "bad.npz", x_train=x)
    with pytest.raises(ValueError, match="y_train"):
        data.load(str(tmp_path / "bad.npz"))
    with pytest.raises(ValueError, match="data="):
        data.load("nonsense")
    with pytest.raises(ValueError, match="batch_size"):
        data.eval_pipeline(d, 0)


def test_npz_images_are_resized_to_image_size(tmp_path):
    x, y = _arrays(n=8, size=16)
    path = tmp_path / "d.npz"
    np.savez(path, x_train=x, y_train=y, x_test=x[:4], y_test=y[:4])
    for size in (8, 24):
        d = data.load(str(path), image_size=size)
        images, _ = next(iter(data.eval_pipeline(d, 4)))
        assert images.shape == (4, size, size, 3)
        assert next(iter(data.train_pipeline(d, 4)))[0].shape == (4, size, size, 3)
    same = data.load(str(path), image_size=16)  # already the size: the pixels as stored
    np.testing.assert_array_equal(next(iter(same.train))[0].numpy(), x[0])
    gray = tmp_path / "gray.npz"
    np.savez(gray, x_train=x[..., 0], y_train=y, x_test=x[:4, ..., 0], y_test=y[:4])
    assert data.load(str(gray), image_size=8).train.element_spec[0].shape == (8, 8, 1)


def test_tfds_with_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=12):
        d = data.load("tfds:mnist", image_size=16)
        images, labels = next(iter(data.train_pipeline(d, 4, flip=False)))
    assert d.num_classes == 10 and images.shape == (4, 16, 16, 3) and labels.shape == (4, 10)
