"""Bad arguments get errors that name the argument, what was expected and what
was received (DESIGN.md, "Rules of the house"). Tiny models only: seconds."""

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
