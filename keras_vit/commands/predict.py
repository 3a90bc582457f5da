"""`keras-vit predict`: the top-k classes of images, with class names."""

HELP = "Classify image files with a trained model; prints the top-k classes."


def add_arguments(parser):
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="JPEG/PNG/... files")
    parser.add_argument(
        "--model", required=True, metavar="DIR_OR_FILE", help="training output folder or .keras"
    )
    parser.add_argument("--top-k", type=int, default=5, help="classes to print (default 5)")


def predict_files(model, paths, class_names=None, top_k=5):
    """[(path, [(class name, probability), ...])] for image files."""
    import numpy as np

    from keras_vit.commands._common import class_probabilities, model_images, read_image
    from keras_vit.models import model_image_size
    from keras_vit.preprocessing import preprocess_inputs

    # A model built with dynamic_image_size=True gets the size it was built for.
    size, channels = model_image_size(model), model.inputs[0].shape[-1]
    # Each image is resized as soon as it is read: only the model-size copies are kept
    # (a 12-megapixel photo is 36 MB decoded, 0.15 MB at 224 x 224).
    images = model_images((read_image(path) for path in paths), size, channels)
    # Softmax of the logits, or the head's own activation's output when it has one.
    probabilities = class_probabilities(model, preprocess_inputs(images))
    if class_names and len(class_names) != probabilities.shape[-1]:
        raise ValueError(
            f"`class_names` must list one name per class of the model ({probabilities.shape[-1]})."
            f" Received: {len(class_names)} names"
        )
    names = class_names or [str(i) for i in range(probabilities.shape[-1])]
    results = []
    for path, row in zip(paths, probabilities):
        best = np.argsort(-row)[:top_k]
        results.append((path, [(names[i], float(row[i])) for i in best]))
    return results


def run(args):
    from keras_vit.commands._common import load_trained

    if args.top_k < 1:
        raise ValueError(f"--top-k must be a positive integer. Received: {args.top_k}")
    model, class_names = load_trained(args.model)
    top_k = min(args.top_k, model.outputs[0].shape[-1])
    for path, best in predict_files(model, args.images, class_names, top_k):
        print(path)
        for rank, (name, probability) in enumerate(best, 1):
            print(f"  {rank}. {name:20s} {probability:.4f}")
    return 0
