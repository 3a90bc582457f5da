"""Bad arguments get errors that name the argument, what was expected and what
was received (DESIGN.md, "Rules of the house"). Tiny models only: seconds."""

import json
import os

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import layers
from keras_vit.layers._checks import ArgumentTypeError, boolean, real

# Flags ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["false", "yes", None, 0, 1, 1.0, [True]])
@pytest.mark.parametrize("flag", ["approximate_gelu", "remat", "dynamic_image_size"])
def test_model_flags_take_bools_only(tiny_config, flag, value):
    with pytest.raises(TypeError, match=f"`{flag}` must be True or False. Received: {flag}="):
        keras_vit.VisionTransformer(**tiny_config, **{flag: value})


def test_flag_errors_are_value_errors_too():
    # Code that catches ValueError (as the command line does) sees them.
    with pytest.raises(ValueError, match="remat"):
        boolean("remat", "yes")
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ValueError)


def test_numpy_bools_are_bools_and_configs_store_python_bools(tiny_config):
    model = keras_vit.VisionTransformer(**tiny_config, approximate_gelu=np.bool_(True))
    block = model.get_layer("transformer_block_0")
    assert block.approximate_gelu is True and block.get_config()["approximate_gelu"] is True
    restored = keras.Model.from_config(model.get_config())
    assert restored.get_layer("transformer_block_0").approximate_gelu is True


@pytest.mark.parametrize(
    "make",
    [
        lambda v: layers.MLP(8, approximate_gelu=v),
        lambda v: layers.TransformerBlock(2, 8, approximate_gelu=v),
        lambda v: layers.TransformerBlock(2, 8, first_token_only=v),
        lambda v: layers.TransformerBlock(2, 8, remat=v),
        lambda v: layers.PatchEncoder(8, 8, class_token=v),
    ],
)
def test_layer_flags_take_bools_only(make):
    with pytest.raises(TypeError, match=r"must be True or False. Received: \w+='no'"):
        make("no")


def test_token_pooling_checks_the_rank():
    with pytest.raises(ValueError, match=r"rank 3 \(batch, tokens, hidden_dim\).*\(2, 5\)"):
        layers.TokenPooling()(np.zeros((2, 5), "float32"))
    assert tuple(layers.TokenPooling("gap")(np.zeros((2, 5, 4), "float32")).shape) == (2, 4)


# Activation and dtype ---------------------------------------------------------


@pytest.mark.parametrize("activation", ["softmaxx", 3])
def test_unknown_classifier_activation_is_named(tiny_config, activation):
    with pytest.raises(ValueError, match=r"`classifier_activation` must be None.*Received"):
        keras_vit.VisionTransformer(**tiny_config, classifier_activation=activation)


@pytest.mark.parametrize("dtype", ["float8_bogus", "mixed_float17", "int32", 3])
def test_bad_dtype_is_named(tiny_config, dtype):
    with pytest.raises(ValueError, match=r"`dtype` must be None, a float dtype.*Received: dtype="):
        keras_vit.VisionTransformer(**tiny_config, dtype=dtype)


def test_real_checks_range_and_type():
    assert real("alpha", 0.5, 0, 1) == 0.5
    with pytest.raises(
        ValueError, match=r"`alpha` must be a number in \[0, 1\]. Received: alpha=2"
    ):
        real("alpha", 2, 0, 1)
    with pytest.raises(TypeError, match="a positive number. Received: lr='4e-3' of type str"):
        real("lr", "4e-3", low=0, low_open=True)
    with pytest.raises(ValueError, match="non-negative"):
        real("weight_decay", float("nan"), low=0)


# Images of the wrong size in a traced function --------------------------------


def test_a_single_image_is_told_to_get_a_batch_axis():
    encoder = layers.PatchEncoder(8, hidden_dim=8)
    with pytest.raises(ValueError, match=r"batch of images, of rank 4.*\(32, 32, 3\).*batch axis"):
        encoder(np.zeros((32, 32, 3), "float32"))


def test_a_fixed_encoder_names_its_size():
    encoder = layers.PatchEncoder(8, hidden_dim=8)
    encoder(np.zeros((1, 32, 32, 3), "float32"))
    with pytest.raises(ValueError, match=r"\(batch, 32, 32, 3\).*Received: images.shape=\(1, 48"):
        encoder(np.zeros((1, 48, 48, 3), "float32"))


@pytest.mark.tensorflow_only
@pytest.mark.parametrize("jit_compile", [False, True])
def test_predict_at_another_size_after_a_first_call_names_both_sizes(tiny_config, jit_compile):
    # Keras traces predict anew for any size once it has seen a second one:
    # the sizes are then checked when the function runs.
    tf = pytest.importorskip("tensorflow")
    model = keras_vit.VisionTransformer(**tiny_config)
    model.compile(jit_compile=jit_compile)
    model.predict(np.zeros((2, 32, 32, 3), "float32"), verbose=0)
    for shape in [(2, 64, 64, 3), (3, 40, 40, 3)]:
        with pytest.raises(tf.errors.InvalidArgumentError) as error:
            model.predict(np.zeros(shape, "float32"), verbose=0)
        message = str(error.value)
        assert "32, 32, 3" in message or "32,32,3" in message
        received = ",".join(map(str, shape))
        assert received in message or received.replace(",", " ") in message
    assert model.predict(np.zeros((1, 32, 32, 3), "float32"), verbose=0).shape == (1, 10)


@pytest.mark.tensorflow_only
def test_images_of_unknown_static_size_run_when_they_fit(tiny_config):
    tf = pytest.importorskip("tensorflow")
    model = keras_vit.VisionTransformer(**tiny_config)
    images = np.random.default_rng(0).uniform(-1, 1, (4, 32, 32, 3)).astype("float32")
    function = tf.function(lambda x: model(x, training=False))
    unknown = function.get_concrete_function(tf.TensorSpec([None, None, None, None]))
    np.testing.assert_allclose(unknown(tf.constant(images)), model(images), atol=1e-5)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"\(batch, 32, 32, 3\).*\[4 32 32 1\]"
    ):
        unknown(tf.zeros((4, 32, 32, 1)))


@pytest.mark.tensorflow_only
@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_dynamic_model_refuses_sizes_that_do_not_tile(tiny_config, jit_compile):
    # XLA drops assertions: without another check, the convolution would
    # silently drop the leftover rows and columns.
    tf = pytest.importorskip("tensorflow")
    model = keras_vit.VisionTransformer(**tiny_config, dynamic_image_size=True)
    model.compile(jit_compile=jit_compile)
    for size in (32, 40):
        model.predict(np.zeros((2, size, size, 3), "float32"), verbose=0)
    for size in (36, 4):
        with pytest.raises(tf.errors.InvalidArgumentError, match="multiple"):
            model.predict(np.zeros((2, size, size, 3), "float32"), verbose=0)
    assert model.predict(np.zeros((1, 48, 24, 3), "float32"), verbose=0).shape == (1, 10)


# The training recipe -----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(total_steps="100"), ValueError, "`total_steps` must be a positive integer"),
        (dict(total_steps=0), ValueError, "total_steps=0"),
        (dict(learning_rate=-1), ValueError, "`learning_rate` must be a positive number"),
        (dict(learning_rate="1e-3"), TypeError, "learning_rate='1e-3' of type str"),
        (dict(label_smoothing=2), ValueError, r"`label_smoothing` must be a number in \[0, 1\)"),
        (dict(weight_decay=-1), ValueError, "`weight_decay` must be a non-negative number"),
        (dict(warmup_steps=-5), ValueError, "`warmup_steps` must be a non-negative integer"),
        (dict(clipnorm=-1.0), ValueError, "`clipnorm` must be a non-negative number"),
        (dict(optimizer="adam"), ValueError, "`optimizer` must be 'adamw' or 'sgd'"),
    ],
)
def test_compile_model_names_bad_arguments(tiny_config, kwargs, error, message):
    from keras_vit import training

    model = keras_vit.VisionTransformer(**tiny_config)
    kwargs = {"total_steps": 100, **kwargs}
    with pytest.raises(error, match=message):
        training.compile_model(model, **kwargs)


def test_compile_model_needs_a_model():
    from keras_vit import training

    with pytest.raises(ValueError, match="`model` must be a keras.Model. Received: model='m'"):
        training.compile_model("m", 100)


def test_warmup_longer_than_the_run_warms_up_over_the_whole_run(tiny_config):
    # Documented: keras-vit train passes more warm-up than steps for short runs.
    from keras_vit import training

    model = keras_vit.VisionTransformer(**tiny_config)
    training.compile_model(model, total_steps=100, warmup_steps=200, jit_compile=False)
    schedule = model.optimizer._learning_rate
    assert isinstance(schedule, training.WarmupCosine)
    assert schedule.warmup_steps == schedule.total_steps == 100


def test_schedule_optimizer_and_scaling_check_their_arguments():
    from keras_vit import training

    with pytest.raises(TypeError, match="`base_lr` must be a positive number.*'4e-3'"):
        training.scaled_learning_rate("4e-3", 64)
    with pytest.raises(ValueError, match="`global_batch_size` must be a positive integer"):
        training.scaled_learning_rate(4e-3, 0)
    assert training.scaled_learning_rate(4e-3, 64) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="`total_steps` must be a positive integer"):
        training.WarmupCosine(1e-3, total_steps=10.5)
    with pytest.raises(ValueError, match="`peak` must be a non-negative number"):
        training.WarmupCosine(-1e-3, total_steps=10)
    with pytest.raises(ValueError, match="`momentum` must be a number in"):
        training.build_optimizer("sgd", 0.1, momentum=1.5)
    with pytest.raises(ValueError, match="`learning_rate` must be a positive number"):
        training.build_optimizer("adamw", 0.0)
    schedule = training.WarmupCosine(1e-3, total_steps=10)
    assert training.build_optimizer("adamw", schedule, weight_decay=None) is not None


# Checkpoints --------------------------------------------------------------------

SQUARE = os.path.join(os.path.dirname(__file__), "data", "timm_square.safetensors")
SQUARE_CONFIG = dict(
    image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128
)


@pytest.mark.parametrize("path", [None, 123, b"model.npz"])
def test_load_weights_names_a_path_that_is_not_one(tiny_config, path):
    model = keras_vit.VisionTransformer(**tiny_config)
    with pytest.raises(TypeError, match=r"`path` must be a file system path.*Received: path="):
        keras_vit.load_weights(model, path)


def test_load_weights_names_a_model_that_is_not_a_vit():
    with pytest.raises(TypeError, match="`model` must be a keras.Model.*'notamodel'"):
        keras_vit.load_weights("notamodel", SQUARE)
    dense = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"no PatchEncoder layer.*\['dense'\]"):
        keras_vit.load_weights(dense, SQUARE)


def test_load_weights_checks_grid_and_method_before_reading():
    model = keras_vit.VisionTransformer(**{**SQUARE_CONFIG, "image_size": 48})
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"`source_grid` must be a positive int or a.*'4x4'"):
        keras_vit.load_weights(model, SQUARE, source_grid="4x4")
    with pytest.raises(ValueError, match=r"`resize_method` must be None.*'bicubic'"):
        keras_vit.load_weights(model, SQUARE, resize_method="bicubic")
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert keras_vit.load_weights(model, SQUARE, source_grid=4)["resized"] == ((4, 4), (6, 6))


def test_resize_position_embedding_names_its_grids():
    posemb = np.zeros((1, 17, 8), "float32")
    with pytest.raises(ValueError, match=r"`target_grid` must be.*target_grid=\(0, 6\)"):
        keras_vit.resize_position_embedding(posemb, (4, 4), (0, 6))
    with pytest.raises(ValueError, match=r"`source_grid` must be.*source_grid='4x4'"):
        keras_vit.resize_position_embedding(posemb, "4x4", (6, 6))
    with pytest.raises(ValueError, match="`num_prefix_tokens` must be a non-negative integer"):
        keras_vit.resize_position_embedding(posemb, (4, 4), (6, 6), num_prefix_tokens=-1)
    # An int is a square grid, as for image_size.
    assert keras_vit.resize_position_embedding(posemb, (4, 4), 6).shape == (1, 37, 8)


def test_infer_config_checks_its_overrides():
    from keras_vit.weights import infer_config

    with pytest.raises(ValueError, match="`num_heads` must be a positive integer.*'2'"):
        infer_config(SQUARE, num_heads="2")
    with pytest.raises(ValueError, match="`num_heads` must divide.*hidden_dim=64.*num_heads=3"):
        infer_config(SQUARE, num_heads=3)
    assert infer_config(SQUARE, num_heads=2)["num_heads"] == 2


def test_infer_config_takes_the_published_heads_of_a_timm_vit_h(tmp_path):
    """timm files do not store the head count; hidden_dim / 64 gave ViT-H/14 20 heads
    where it has 16 of 80. Only the shapes matter here: a one-block ViT-H/14 file."""
    from keras_vit.weights import infer_config

    dim, grid = 1280, 2
    params = {
        "patch_embed.proj.weight": np.zeros((dim, 3, 14, 14), "float32"),
        "cls_token": np.zeros((1, 1, dim), "float32"),
        "pos_embed": np.zeros((1, 1 + grid * grid, dim), "float32"),
        "blocks.0.mlp.fc1.weight": np.zeros((5120, dim), "float32"),
        "blocks.0.attn.qkv.weight": np.zeros((3 * dim, dim), "float32"),
    }
    path = str(tmp_path / "vit_h.npz")
    np.savez(path, **params)
    assert infer_config(path)["num_heads"] == 16
    assert infer_config(path, num_heads=20)["num_heads"] == 20


# Inspection and plots -------------------------------------------------------------


def test_inspection_names_a_model_that_is_not_one(tiny_config):
    with pytest.raises(TypeError, match="`model` must be a keras.Model.*Received: model='m'"):
        keras_vit.position_embedding_similarity("m")
    with pytest.raises(TypeError, match="`model` must be a keras.Model.*Received: model='m'"):
        keras_vit.plot_position_embedding_similarity("m")
    model = keras_vit.VisionTransformer(**tiny_config)
    with pytest.raises(TypeError, match="`maps` must be the list.*not a model"):
        keras_vit.attention_rollout(model)
    with pytest.raises(TypeError, match="`maps` must be a list of"):
        keras_vit.attention_rollout(3)
    maps = keras_vit.attention_maps(model, np.zeros((1, 32, 32, 3), "float32"))
    with pytest.raises(ValueError, match="one layer's maps"):
        keras_vit.attention_rollout(maps[0])
    with pytest.raises(TypeError, match="`patch_grid` must be True or False.*'no'"):
        keras_vit.feature_extractor(model, patch_grid="no")
    with pytest.raises(ValueError, match="`images` must be given when `maps` is not"):
        keras_vit.mean_attention_distance(model, None)


def test_unscaled_images_are_refused_where_scaled_ones_are_expected(tiny_config):
    model = keras_vit.VisionTransformer(**tiny_config)
    pixels = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"keras_vit.preprocess_inputs.*Received: uint8 images"):
        keras_vit.attention_maps(model, pixels)
    with pytest.raises(ValueError, match=r"scaled to \[-1, 1\].*values in \[0, 255\]"):
        keras_vit.attention_maps(model, pixels.astype("float32"))
    with pytest.raises(ValueError, match="uint8 images"):
        keras_vit.plot_mean_attention_distance(model, pixels)
    scaled = keras_vit.preprocess_inputs(pixels)  # a tensor: checked too, and accepted
    assert [m.shape for m in keras_vit.attention_maps(model, scaled)] == [(2, 2, 17, 17)] * 2


def test_plot_attention_refuses_images_it_would_misread():
    rollout = np.random.default_rng(0).uniform(size=(4, 4))
    pixels = np.random.default_rng(1).integers(0, 256, (32, 32, 3))
    with pytest.raises(
        ValueError, match=r"astype\('uint8'\). Received: float64 values in \[0, 25\d\]"
    ):
        keras_vit.plot_attention(pixels.astype("float64"), rollout)
    with pytest.raises(ValueError, match=r"astype\('uint8'\). Received: an image of dtype int64"):
        keras_vit.plot_attention(pixels.astype("int64"), rollout)
    with pytest.raises(TypeError, match=r"`alpha` must be a number in \[0, 1\].*'0.5'"):
        keras_vit.plot_attention(pixels.astype("uint8"), rollout, alpha="0.5")
    # What the docstring promises still works: uint8, and floats in [-1, 1].
    keras_vit.plot_attention(pixels.astype("uint8"), rollout)
    keras_vit.plot_attention(pixels / 127.5 - 1.0, rollout)


# Reloading a trained model -------------------------------------------------------


@pytest.mark.parametrize(
    "content, phrase",
    [
        (b"{'a', 'b'", "is not valid JSON"),
        (b'["\xff\xfe"]', "is not UTF-8 text"),
        (b'{"classes": 3}', "must hold a JSON list of class names"),
    ],
)
def test_read_class_names_names_the_file(tmp_path, content, phrase):
    from keras_vit.export import read_class_names

    file = tmp_path / "classes.json"
    file.write_bytes(content)
    with pytest.raises(ValueError, match=phrase) as raised:
        read_class_names(file)
    assert str(file) in str(raised.value)


def test_find_trained_resolves_files_and_folders(tmp_path):
    from keras_vit.export import find_trained

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(FileNotFoundError, match="No model.keras in the folder"):
        find_trained(run)
    (run / "model.keras").write_bytes(b"")
    assert find_trained(run) == (os.path.join(run, "model.keras"), None)
    (run / "class_names.json").write_text("[]")
    assert find_trained(run)[1] == os.path.join(run, "class_names.json")
    (run / "classes.json").write_text("[]")  # the first of CLASS_NAME_FILES wins
    found = find_trained(os.path.join(run, "model.keras"))
    assert found == (os.path.join(run, "model.keras"), os.path.join(run, "classes.json"))
    with pytest.raises(ValueError, match=r"Received: --model=.*classes.json"):
        find_trained(run / "classes.json", argument="--model")
    with pytest.raises(FileNotFoundError, match="No such file or folder"):
        find_trained(tmp_path / "gone.keras")


def test_load_trained_checks_one_name_per_class(tiny_config, tmp_path):
    from keras_vit.export import load_trained

    model = keras_vit.VisionTransformer(**tiny_config)  # 10 classes
    model.save(tmp_path / "model.keras")
    (tmp_path / "classes.json").write_text('["cat", "dog"]')
    with pytest.raises(ValueError, match="lists 2 class names but the model has 10 classes"):
        load_trained(tmp_path)
    names = [f"class {i}" for i in range(10)]
    (tmp_path / "classes.json").write_text(json.dumps(names))
    assert load_trained(tmp_path)[1] == names


def test_load_trained_refuses_repeated_names_and_drops_names_without_a_head(tiny_config, tmp_path):
    from keras_vit.export import export_saved_model, load_trained

    model = keras_vit.VisionTransformer(**tiny_config)  # 10 classes
    model.save(tmp_path / "model.keras")
    names = [f"class {i}" for i in range(9)] + ["class 0"]
    (tmp_path / "classes.json").write_text(json.dumps(names))
    with pytest.raises(ValueError, match=r"classes.json.*\['class 0'\] more than once"):
        load_trained(tmp_path)

    headless = tmp_path / "features"
    headless.mkdir()
    keras_vit.VisionTransformer(**{**tiny_config, "num_classes": 0}).save(headless / "model.keras")
    (headless / "classes.json").write_text(json.dumps([f"class {i}" for i in range(10)]))
    features, class_names = load_trained(headless)
    assert class_names is None
    # What load_trained gives is what export_saved_model takes.
    export_saved_model(features, tmp_path / "exported", class_names=class_names)
    assert (tmp_path / "exported" / "saved_model.pb").exists()


def test_find_trained_points_at_the_best_model_of_a_run_without_model_keras(tmp_path):
    from keras_vit.export import find_trained

    (tmp_path / "best.keras").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"No model.keras .*holds best.keras.*best.keras'"):
        find_trained(tmp_path, argument="--model")
    (tmp_path / "best.keras").unlink()
    with pytest.raises(FileNotFoundError) as raised:
        find_trained(tmp_path, argument="--model")
    assert "best.keras" not in str(raised.value)
