"""NumPy reference pieces of a ViT, written independently of keras_vit, for
the tests to compare the layers against."""

import math

import numpy as np


def np_layer_norm(x, gamma, beta, epsilon=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + epsilon) * gamma + beta


def np_gelu(x, approximate=False):
    if approximate:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
