"""keras_vit: Vision Transformers for Keras 3."""

from keras_vit import (
    _memory,  # noqa: F401  (first: TensorFlow's pooling CPU allocator, see _memory.py)
    layers,
    streams,  # noqa: F401  (keras_vit.streams.configure_cpu_streams, use_streams)
    training,  # noqa: F401  (registers WarmupCosine for model.keras)
)
from keras_vit.export import export_saved_model, export_tflite
from keras_vit.inspection import (
    attention_maps,
    attention_rollout,
    feature_extractor,
    mean_attention_distance,
    position_embedding_similarity,
)
from keras_vit.models import (
    VARIANTS,
    VisionTransformer,
    ViT_B8,
    ViT_B16,
    ViT_B32,
    ViT_H14,
    ViT_L16,
    ViT_L32,
    ViT_R50_B16,
    ViT_S16,
    ViT_S32,
    ViT_Ti16,
)
from keras_vit.preprocessing import preprocess_inputs
from keras_vit.visualize import (
    plot_attention,
    plot_mean_attention_distance,
    plot_position_embedding_similarity,
)
from keras_vit.weights import load_weights, resize_position_embedding

__version__ = "0.1.0"

__all__ = [
    "VARIANTS",
    "ViT_B8",
    "ViT_B16",
    "ViT_B32",
    "ViT_H14",
    "ViT_L16",
    "ViT_L32",
    "ViT_R50_B16",
    "ViT_S16",
    "ViT_S32",
    "ViT_Ti16",
    "VisionTransformer",
    "attention_maps",
    "attention_rollout",
    "export_saved_model",
    "export_tflite",
    "feature_extractor",
    "layers",
    "load_weights",
    "mean_attention_distance",
    "plot_attention",
    "plot_mean_attention_distance",
    "plot_position_embedding_similarity",
    "position_embedding_similarity",
    "preprocess_inputs",
    "resize_position_embedding",
]
