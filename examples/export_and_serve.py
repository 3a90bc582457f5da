"""Export a ViT as a SavedModel and a TFLite file, then serve both without keras_vit.

    python examples/export_and_serve.py                       # a small fresh model
    python examples/export_and_serve.py --model runs/flowers  # a `keras-vit train` folder
    python examples/export_and_serve.py --model model.keras --output exported/

Writes OUTPUT/saved_model (for TF Serving or `tf.saved_model.load`),
OUTPUT/model.tflite and OUTPUT/request.json, a TF Serving REST request body
for the uint8 `serving_default` signature. Then reloads the SavedModel in a
new Python process that imports TensorFlow alone and prints its top classes.

Serving with TF Serving (Docker), once exported:

    docker run -p 8501:8501 -v "$PWD/OUTPUT/saved_model:/models/vit/1" \\
        -e MODEL_NAME=vit tensorflow/serving
    curl -X POST localhost:8501/v1/models/vit:predict -d @OUTPUT/request.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

import keras_vit
from keras_vit.export import load_trained

# What a client runs: TensorFlow only, no keras_vit and no Keras.
CLIENT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tensorflow as tf

    served = tf.saved_model.load(sys.argv[1])
    images = np.random.default_rng(0).integers(0, 256, size=(2, 300, 200, 3), dtype=np.uint8)
    outputs = served.signatures["serving_default"](images=tf.constant(images))
    if "features" in outputs:  # a model without a head (num_classes=0)
        print("features:", outputs["features"].shape)
    for index in range(len(images) if "top_k_indices" in outputs else 0):
        names = outputs.get("top_k_class_names", outputs["top_k_indices"])[index].numpy()
        scores = outputs["top_k_probabilities"][index].numpy()
        best = ", ".join(
            f"{name.decode() if isinstance(name, bytes) else name} {score:.3f}"
            for name, score in zip(names, scores)
        )
        print(f"image {index}: {best}")
    print("keras_vit imported by the client:", "keras_vit" in sys.modules)
    """
)


def demo_model():
    """A small ViT with a random head, so that the classes differ."""
    model = keras_vit.VisionTransformer(
        image_size=64, patch_size=16, num_layers=2, num_heads=3, hidden_dim=96, mlp_dim=192,
        num_classes=5,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for weight in model.get_layer("head").weights:
        weight.assign(rng.normal(0, 0.1, size=weight.shape).astype("float32"))
    return model, ["daisy", "dandelion", "rose", "sunflower", "tulip"]


def run_tflite(path, images):
    import tensorflow as tf

    interpreter = tf.lite.Interpreter(model_path=path)
    interpreter.resize_tensor_input(interpreter.get_input_details()[0]["index"], images.shape)
    interpreter.allocate_tensors()
    return interpreter.get_signature_runner("serving_default")(images=images)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a .keras file or a training output folder")
    parser.add_argument("--output", help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)

    if args.model:
        model, class_names = load_trained(args.model)
    else:
        model, class_names = demo_model()
    output = args.output or tempfile.mkdtemp(prefix="keras_vit_export_")
    os.makedirs(output, exist_ok=True)
    # The size it was built for (a dynamic_image_size model's input has none).
    height, width = keras_vit.models.model_image_size(model)

    # 1. The SavedModel: uint8 images of any size in, logits/probabilities/top-k out.
    saved_model = keras_vit.export_saved_model(
        model,
        os.path.join(output, "saved_model"),
        class_names=class_names,
        top_k=3,
        overwrite=True,  # this example's own folder: a second run replaces its files
    )
    print(f"SavedModel: {saved_model}")

    # 2. A TF Serving REST request: the "instances" are uint8 images [H, W, 3].
    image = np.random.default_rng(1).integers(0, 256, size=(48, 40, 3), dtype=np.uint8)
    request = {"signature_name": "serving_default", "instances": [image.tolist()]}
    with open(os.path.join(output, "request.json"), "w") as file:
        json.dump(request, file)
    print(f"TF Serving request body: {os.path.join(output, 'request.json')}")

    # 3. The client: a new process with TensorFlow alone.
    client = subprocess.run(
        [sys.executable, "-c", CLIENT, saved_model],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    print(client.stdout.strip() or client.stderr[-2000:])

    # 4. TFLite: float images at the model's size, scaled to [-1, 1].
    tflite = keras_vit.export_tflite(model, os.path.join(output, "model.tflite"), overwrite=True)
    images = keras_vit.preprocess_inputs(
        np.random.default_rng(2).integers(0, 256, size=(1, height, width, 3), dtype=np.uint8)
    )
    images = np.asarray(images)
    outputs = run_tflite(tflite, images)
    # What the Keras model returns: features (no head), logits, or the head's activation.
    activation = getattr(model.layers[-1], "activation", None)
    activated = activation is not None and activation.__name__ != "linear"
    key = "features" if "features" in outputs else "probabilities" if activated else "logits"
    difference = np.abs(outputs[key] - np.asarray(model(images))).max()
    size = os.path.getsize(tflite) / 1e6
    print(f"TFLite: {tflite} ({size:.2f} MB), max |{key} - Keras| = {difference:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
