"""The layers of keras_vit, each usable on its own."""

from keras_vit.layers.attention import MultiHeadSelfAttention
from keras_vit.layers.encoder import PatchEncoder
from keras_vit.layers.normalization import LayerNorm
from keras_vit.layers.patches import Patches, PatchGrid
from keras_vit.layers.pooling import TokenPooling
from keras_vit.layers.resnet import BottleneckUnit, GroupNorm, ResNetStage, ResNetStem, StdConv
from keras_vit.layers.transformer import MLP, DropPath, TransformerBlock

__all__ = [
    "BottleneckUnit",
    "MLP",
    "DropPath",
    "GroupNorm",
    "LayerNorm",
    "MultiHeadSelfAttention",
    "PatchEncoder",
    "PatchGrid",
    "Patches",
    "ResNetStage",
    "ResNetStem",
    "StdConv",
    "TokenPooling",
    "TransformerBlock",
]
