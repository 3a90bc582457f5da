"""The fast paths compute the same numbers: rematerialization, and the benchmark's FLOPs."""

import importlib.util
import os

import keras
import numpy as np
import pytest

import keras_vit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_bench():
    path = os.path.join(ROOT, "benchmarks", "bench.py")
    spec = importlib.util.spec_from_file_location("keras_vit_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_sgd_step(model, images, labels, jit_compile):
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    loss = model.train_on_batch(images, labels)
    return loss, [np.array(w) for w in model.weights]


@pytest.mark.parametrize("how", ["argument", "scope"])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_remat_blocks_train_like_plain_blocks(tiny_config, images, jit_compile, how):
    labels = np.array([1, 7])
    plain = keras_vit.VisionTransformer(**tiny_config)
    if how == "argument":
        remat = keras_vit.VisionTransformer(**tiny_config, remat=True)
    else:
        names = [f"transformer_block_{i}" for i in range(tiny_config["num_layers"])]
        with keras.RematScope(mode="list_of_layers", layer_names=names):
            remat = keras_vit.VisionTransformer(**tiny_config)
    # The head starts at zero (the original init), which would stop every gradient
    # below it on the first step; give it random values.
    head = plain.get_layer("head")
    head.kernel.assign(np.random.default_rng(1).normal(0, 0.5, head.kernel.shape))
    remat.set_weights(plain.get_weights())
    np.testing.assert_allclose(
        remat.predict_on_batch(images), plain.predict_on_batch(images), rtol=1e-5, atol=1e-6
    )
    initial = plain.get_weights()
    plain_loss, plain_weights = one_sgd_step(plain, images, labels, jit_compile)
    remat_loss, remat_weights = one_sgd_step(remat, images, labels, jit_compile)
    np.testing.assert_allclose(remat_loss, plain_loss, rtol=1e-5)
    for after_plain, after_remat in zip(plain_weights, remat_weights):
        np.testing.assert_allclose(after_remat, after_plain, rtol=1e-4, atol=1e-6)
    # The step moved the weights, so equal results mean equal gradients.
    moved = [not np.allclose(a, b) for a, b in zip(initial, plain_weights)]
    assert all(moved)


def test_remat_mode_is_only_on_the_named_blocks(tiny_config):
    with keras.RematScope(mode="list_of_layers", layer_names=["transformer_block_1"]):
        model = keras_vit.VisionTransformer(**tiny_config)
    block = model.get_layer("transformer_block_1")
    assert block.rematerialized_call(block.call) is not block.call
    other = model.get_layer("transformer_block_0")
    assert other.rematerialized_call(other.call) == other.call


def test_remat_argument_recomputes_in_training_only_and_is_saved(tiny_config, monkeypatch):
    model = keras_vit.VisionTransformer(**tiny_config, remat=True)
    block = model.get_layer("transformer_block_0")
    assert block.get_config()["remat"] is True
    assert keras_vit.layers.TransformerBlock.from_config(block.get_config()).remat is True
    calls = []
    original = keras.remat

    def counting(function):
        calls.append(function)
        return original(function)

    monkeypatch.setattr(keras, "remat", counting)
    inputs = np.zeros((1, 5, tiny_config["hidden_dim"]), "float32")
    block(inputs, training=False)
    assert not calls
    block(inputs, training=True)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="remat"):
        keras_vit.VisionTransformer(**tiny_config, remat="yes")


@pytest.mark.parametrize(
    "model_name, image_size, timm_gmacs",
    # timm's model cards: vit_small_patch16_224 4.6, vit_base_patch16_224 17.6,
    # vit_small_patch16_384 15.5 GMACs per image.
    [("S16", 224, 4.6), ("B16", 224, 17.6), ("S16", 384, 15.5)],
)
def test_bench_flops_match_timm_model_cards(model_name, image_size, timm_gmacs):
    bench = load_bench()
    gmacs = bench.model_flops(model_name, image_size) / 2 / 1e9
    assert gmacs == pytest.approx(timm_gmacs, rel=0.02)
