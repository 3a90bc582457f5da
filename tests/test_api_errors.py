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
