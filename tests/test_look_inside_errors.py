"""Looking inside a ViT with the wrong input: clear errors, never a silently
wrong result (keras_vit.inspection, keras_vit.visualize, `keras-vit explain`)."""

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import cli


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


def softmax(logits):
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return weights / weights.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    "change, phrase",
    [
        (lambda w: np.log(w), "values down to"),  # logits, not weights
        (lambda w: w * 3, "rows summing to 3"),  # scores not normalised
        (lambda w: np.where(w > 0.1, np.nan, w), "NaN or infinite"),
    ],
)
def test_rollout_and_distance_refuse_maps_that_are_not_attention_weights(tiny, change, phrase):
    weights = softmax(np.random.default_rng(0).normal(size=(1, 2, 17, 17)))
    bad = [weights, change(weights)]
    with pytest.raises(ValueError, match=f"attention weights.*{phrase}"):
        keras_vit.attention_rollout(bad)
    with pytest.raises(ValueError, match=f"attention weights.*{phrase}"):
        keras_vit.mean_attention_distance(tiny, None, maps=bad)


def test_rollout_rows_sum_to_one_for_a_batch_of_real_maps(tiny):
    # Per image, the class token's rollout row sums to 1: the patches' part plus its
    # own weight, computed here in NumPy from the maps.
    images = np.random.default_rng(1).uniform(-1, 1, (3, 32, 32, 3)).astype("float32")
    maps = keras_vit.attention_maps(tiny, images)
    for layer_maps in maps:
        np.testing.assert_allclose(layer_maps.sum(-1), 1.0, atol=1e-5)
    rollout = keras_vit.attention_rollout(maps, discard_ratio=0.5, head_fusion="max")
    assert rollout.shape == (3, 4, 4) and np.all(rollout >= 0)
    assert np.all(rollout.reshape(3, -1).sum(-1) <= 1 + 1e-6)


def test_rollout_refuses_a_fractional_grid_size():
    uniform = np.full((1, 2, 17, 17), 1 / 17)
    # int(4.5) == 4 made it a 4 x 4 grid before.
    with pytest.raises(ValueError, match=r"grid_size=\(4.5, 4\)"):
        keras_vit.attention_rollout([uniform], grid_size=(4.5, 4))
    assert keras_vit.attention_rollout([uniform], grid_size=(np.int64(4), 4)).shape == (1, 4, 4)


def test_mean_attention_distance_checks_images_given_with_maps(tiny):
    maps = [np.full((1, 2, 17, 17), 1 / 17)]
    with pytest.raises(ValueError, match=r"images.shape=\(1, 64, 64, 3\)"):
        keras_vit.mean_attention_distance(tiny, np.zeros((1, 64, 64, 3)), maps=maps)


def test_feature_extractor_takes_ranges_and_arrays_of_block_indices(tiny):
    # A range or an array was taken for one index and refused before.
    for layers in (range(2), np.array([0, 1])):
        assert len(keras_vit.feature_extractor(tiny, layers=layers).outputs) == 2
    with pytest.raises(TypeError, match="has no order"):
        keras_vit.feature_extractor(tiny, layers={0, 1})
    with pytest.raises(TypeError, match="Received: 1.0 of type float"):
        keras_vit.feature_extractor(tiny, layers=[1.0])


def test_plots_refuse_a_folder_path_and_write_no_sibling_file(tmp_path):
    folder = tmp_path / "plots"
    folder.mkdir()
    image, heat = np.zeros((32, 32, 3), "uint8"), np.eye(4)
    # matplotlib wrote "plots.png" beside the folder before.
    with pytest.raises(ValueError, match="`path` must be a file path.*not a folder"):
        keras_vit.plot_attention(image, heat, path=folder)
    with pytest.raises(FileNotFoundError, match="`path`.*does not exist"):
        keras_vit.plot_attention(image, heat, path=folder / "missing" / "a.png")
    with pytest.raises(ValueError, match=r"`path` must end in a picture format.*a\.xyz"):
        keras_vit.plot_attention(image, heat, path=folder / "a.xyz")
    with pytest.raises(TypeError, match="path=3 of type int"):
        keras_vit.plot_attention(image, heat, path=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots"]
    assert list(folder.iterdir()) == []


def test_a_plot_path_without_extension_is_a_png_at_that_path(tmp_path):
    keras_vit.plot_attention(np.zeros((32, 32, 3), "uint8"), np.eye(4), path=tmp_path / "panel")
    assert [p.name for p in tmp_path.iterdir()] == ["panel"]
    assert (tmp_path / "panel").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "image, heat, error, phrase",
    [
        (
            np.zeros((32, 32, 3), "uint8"),
            np.array([[np.nan, 1.0], [0.0, 1.0]]),
            ValueError,
            "finite",
        ),
        (np.zeros((32, 32, 3), "uint8"), np.zeros((0, 4)), ValueError, r"shape=\(0, 4\)"),
        (np.zeros((32, 32, 3), "uint8"), "rollout", TypeError, "of type str"),
        (np.zeros((0, 0, 3), "uint8"), np.eye(4), ValueError, r"image.shape=\(0, 0, 3\)"),
        ("cat.png", np.eye(4), TypeError, "`image` must be an array.*of type str"),
    ],
)
def test_plot_attention_refuses_bad_images_and_maps(image, heat, error, phrase):
    with pytest.raises(error, match=phrase):
        keras_vit.plot_attention(image, heat)


def test_overlay_names_a_bad_colormap_and_size():
    from keras_vit.visualize import attention_overlay, upsample_map

    with pytest.raises(ValueError, match="colormap='nope'"):
        attention_overlay(np.zeros((8, 8, 3), "uint8"), np.eye(2), colormap="nope")
    with pytest.raises(ValueError, match=r"`size`.*size=\(0, 8\)"):
        upsample_map(np.eye(2), (0, 8))


def run_explain(capsys, *argv):
    """(exit status, stderr) of `keras-vit explain ARGV`, run in this process."""
    capsys.readouterr()
    code = cli.main(["explain", *map(str, argv)])
    return code, capsys.readouterr().err


def assert_usage_error(result, *phrases):
    code, err = result
    assert code == 2, err
    assert "usage:" in err and "Traceback" not in err
    for phrase in phrases:
        assert phrase in err, (phrase, err)


def png(path):
    from PIL import Image

    Image.fromarray(np.zeros((20, 30, 3), "uint8")).save(path)
    return path


def test_explain_checks_the_images_before_loading_the_model(capsys, tmp_path):
    # A folder was "no such image file"; images were read after the model.
    missing_model = tmp_path / "none.keras"
    result = run_explain(capsys, tmp_path, "--model", missing_model, "--output", tmp_path / "o")
    assert_usage_error(result, "IMAGE must be an image file, not a folder", str(tmp_path))


@pytest.mark.parametrize("ratio", ["1.5", "-0.1", "nan"])
def test_explain_names_a_bad_discard_ratio(capsys, tmp_path, ratio):
    missing_model = tmp_path / "none.keras"  # the flag is checked first
    result = run_explain(
        capsys, png(tmp_path / "x.png"), "--model", missing_model, "--output", tmp_path / "o",
        "--discard-ratio", ratio,
    )  # fmt: skip
    assert_usage_error(result, "--discard-ratio must be a number in [0, 1)", ratio)


def test_explain_refuses_a_model_that_is_not_a_vit(capsys, tmp_path):
    # A model with a "head" but no transformer: an IndexError traceback before.
    inputs = keras.Input((32, 32, 3))
    outputs = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling2D()(inputs))
    keras.Model(inputs, outputs).save(tmp_path / "cnn.keras")
    result = run_explain(
        capsys, png(tmp_path / "x.png"), "--model", tmp_path / "cnn.keras",
        "--output", tmp_path / "o",
    )  # fmt: skip
    assert_usage_error(result, "--model", "cnn.keras", "must be a ViT built by keras_vit")
    assert not (tmp_path / "o").exists()


def test_mean_attention_distance_leaves_out_queries_with_no_patch_weight(tiny):
    # All on the class token but one query of head 0: patch (1, 0) looks at patch (0, 1).
    # Before, 0 / 0 made both heads NaN (with a RuntimeWarning).
    maps = np.zeros((1, 2, 17, 17))
    maps[..., 0] = 1.0
    maps[0, 0, 1 + 4] = 0.0
    maps[0, 0, 1 + 4, 1 + 1] = 1.0
    with np.errstate(all="raise"):
        got = keras_vit.mean_attention_distance(tiny, None, maps=[maps])
    np.testing.assert_allclose(got[0, 0], np.hypot(8.0, 8.0), rtol=1e-6)
    assert np.isnan(got[0, 1])


def test_explain_reads_16_bit_grayscale_images_at_their_range(tmp_path):
    from PIL import Image

    from keras_vit.commands.explain import load_image

    pixels = (np.arange(20 * 30).reshape(20, 30) * 100).astype(np.uint16)  # 0 .. 59900
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    # PIL's convert("RGB") clipped them at 255: a white image before.
    expected = np.round(pixels / 257.0).astype("uint8")
    got = load_image(str(tmp_path / "wide.png"))
    assert got.shape == (20, 30, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, np.repeat(expected[..., None], 3, axis=-1))


def test_explain_refuses_float_images_of_unknown_range(tmp_path):
    from PIL import Image

    from keras_vit.cli import UsageError
    from keras_vit.commands.explain import load_image

    Image.fromarray(np.full((8, 8), 0.5, np.float32), mode="F").save(tmp_path / "f.tiff")
    # They read as an all-black image before.
    with pytest.raises(UsageError, match="f.tiff.*mode 'F'"):
        load_image(str(tmp_path / "f.tiff"))
