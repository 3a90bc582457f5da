"""The docstring examples of the core modules run and print what they say."""

import doctest
import importlib

import pytest

MODULES = [
    "keras_vit.layers.patches",
    "keras_vit.layers.encoder",
    "keras_vit.layers.attention",
    "keras_vit.layers.transformer",
    "keras_vit.layers.pooling",
    "keras_vit.models",
    "keras_vit.preprocessing",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0
