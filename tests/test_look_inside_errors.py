"""Looking inside a ViT with the wrong input: clear errors, never a silently
wrong result (keras_vit.inspection, keras_vit.visualize, `keras-vit explain`)."""

import numpy as np
import pytest

import keras_vit


@pytest.fixture
def tiny(tiny_config):
    return keras_vit.VisionTransformer(**tiny_config)


@pytest.mark.parametrize(
    "images, phrase",
    [
        ("cat.png", "of type str"),
        (None, "of type NoneType"),
        (np.zeros((1, 32, 32, 3), bool), "dtype bool"),
    ],
)
def test_attention_maps_refuse_what_is_not_an_image_array(tiny, images, phrase):
    with pytest.raises(TypeError, match=f"`images` must be .*array.*{phrase}"):
        keras_vit.attention_maps(tiny, images)


def test_attention_maps_refuse_an_empty_batch(tiny):
    # It returned [] (no maps, not one per block) before.
    with pytest.raises(ValueError, match=r"at least one image.*\(0, 32, 32, 3\)"):
        keras_vit.attention_maps(tiny, np.zeros((0, 32, 32, 3), "float32"))


def test_attention_maps_refuse_non_finite_images(tiny):
    images = np.zeros((1, 32, 32, 3), "float32")
    images[0, 3, 4, 1] = np.nan
    with pytest.raises(ValueError, match="`images` must hold finite values.*1 NaN"):
        keras_vit.attention_maps(tiny, images)


def test_a_single_image_gets_a_batch_axis_hint(tiny):
    with pytest.raises(ValueError, match=r"\(32, 32, 3\) \(one image\? add a batch axis"):
        keras_vit.attention_maps(tiny, np.zeros((32, 32, 3), "float32"))


def test_batch_size_takes_numpy_integers(tiny):
    images = np.random.default_rng(0).uniform(-1, 1, (3, 32, 32, 3)).astype("float32")
    maps = keras_vit.attention_maps(tiny, images, batch_size=np.int64(2))
    assert [m.shape for m in maps] == [(3, 2, 17, 17)] * 2
    with pytest.raises(ValueError, match="batch_size=1.0"):
        keras_vit.attention_maps(tiny, images, batch_size=1.0)
