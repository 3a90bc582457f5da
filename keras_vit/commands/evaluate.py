"""`keras-vit evaluate`: loss and accuracy of a trained model on a dataset."""

from keras_vit.cli import UsageError

HELP = "Evaluate a trained model (training folder or .keras file): loss and accuracy."


def add_arguments(parser):
    from keras_vit.commands._common import seed_argument

    parser.add_argument(
        "--model", required=True, metavar="DIR_OR_FILE", help="training output folder or .keras"
    )
    parser.add_argument(
        "--data",
        default="digits",
        help="digits | tfds:NAME | a folder of class sub-folders | a .npz (its test split, "
        "or for a folder the same 20%% validation split as training)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="default 64")
    parser.add_argument(
        "--seed",
        type=seed_argument,
        default=None,
        help="split seed of digits / folder data (default: the run's --seed, from run.json "
        "beside the model, else 0), so that a folder is split as it was for training",
    )
    parser.add_argument(
        "--skip-corrupt", action="store_true", help="folder data: skip unreadable images"
    )


def run(args):
    from keras_vit import data as data_module
    from keras_vit import training
    from keras_vit.commands._common import (
        check_data_spec,
        load_data,
        load_trained,
        num_classes,
        validation_hint,
    )
    from keras_vit.models import model_image_size

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive. Received: {args.batch_size}")
    check_data_spec(args.data)
    model, model_names = load_trained(args.model)
    classes = num_classes(model)
    if classes is None:
        raise UsageError(f"--model {args.model!r} has no classification head (num_classes=0)")
    # (height, width); for a dynamic model the size it was built for.
    height, width = model_image_size(model)
    data = load_data(
        args.data,
        (height, width),
        seed=_run_seed(args.model) if args.seed is None else args.seed,
        skip_corrupt=args.skip_corrupt,
    )
    data = _match_classes(data, model_names, classes, args)
    channels, model_channels = data.validation.element_spec[0].shape[-1], model.inputs[0].shape[-1]
    if channels != model_channels:
        raise UsageError(
            f"--data {args.data!r} has images of {channels} channel(s) but the model takes "
            f"{model_channels}"
        )
    if data.validation_size == 0:
        raise UsageError(
            f"--data {args.data!r} has no image to evaluate: {validation_hint(args.data, data)}"
        )
    # No optimizer: evaluation only. XLA or graph mode as compile_model plans
    # inference for this machine (a plain compile() leaves a CPU without XLA).
    training.compile_fast(
        model,
        None,
        training.build_loss(0.0),
        metrics=[training.Accuracy()],
    )
    loss, accuracy = model.evaluate(data_module.eval_pipeline(data, args.batch_size), verbose=0)
    print(
        f"{data.validation_size} images: loss {loss:.4f} (cross-entropy without label "
        f"smoothing), accuracy {accuracy:.4f}"
    )
    return 0


def _run_seed(model_path):
    """The --seed of the training run whose folder holds the model (its run.json), else 0
    (also when run.json cannot be read: evaluate does not need it)."""
    import os

    from keras_vit.commands.train import read_run_file

    folder = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    try:
        stored = read_run_file(folder)
    except UsageError:
        return 0
    seed = (stored or {"args": {}})["args"].get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else 0


def _numbered(names):
    """Whether `names` are the ones a source without class names gets: "0", "1", ..."""
    return list(names) == [str(index) for index in range(len(names))]


def _match_classes(data, model_names, classes, args):
    """`data` with its labels in the model's class order, or a usage error.

    The data's classes are matched to the model's class names (its
    classes.json) by name: in another order, or only some of them, the
    labels are mapped to the model's. Names that the model has not are
    refused, unless one side has only the numbers "0", "1", ... of a source
    without class names: then the class counts must agree.
    """
    import tensorflow as tf

    from keras_vit import data as data_module

    names = data.class_names
    if model_names is not None and set(names) <= set(model_names):
        if names == list(model_names):
            return data
        position = {name: index for index, name in enumerate(model_names)}
        mapping = tf.constant([position[name] for name in names], tf.int32)

        def relabel(image, label):
            return image, tf.gather(mapping, label)

        print(
            f"--data {args.data!r}: its {len(names)} classes are matched to the model's "
            f"{len(model_names)} by name"
        )
        return data_module.Data(
            data.train.map(relabel),
            data.validation.map(relabel),
            model_names,
            data.train_size,
            data.validation_size,
        )
    if model_names is not None and not (_numbered(names) or _numbered(model_names)):
        unknown = [name for name in names if name not in model_names]
        raise UsageError(
            f"--data {args.data!r} has classes the model was not trained on: "
            f"{unknown[:10]!r}; the model's classes are {list(model_names)[:20]!r}"
        )
    if data.num_classes != classes:
        raise UsageError(
            f"--data {args.data!r} has {data.num_classes} classes but the model predicts {classes}"
        )
    return data
