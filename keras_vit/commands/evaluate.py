"""`keras-vit evaluate`: loss and accuracy of a trained model on a dataset."""

from keras_vit.cli import UsageError

HELP = "Evaluate a trained model (training folder or .keras file): loss and accuracy."


def add_arguments(parser):
    parser.add_argument(
        "--model", required=True, metavar="DIR_OR_FILE", help="training output folder or .keras"
    )
    parser.add_argument(
        "--data",
        default="digits",
        help="digits | tfds:NAME | a folder of class sub-folders | a .npz (its test split, "
        "or for a folder the same 20%% validation split as training)",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="split seed of digits / folder data")
    parser.add_argument("--skip-corrupt", action="store_true")


def run(args):
    import keras

    from keras_vit import data as data_module
    from keras_vit import training
    from keras_vit.commands._common import (
        check_data_spec,
        find_trained,
        load_data,
        load_keras_file,
        num_classes,
        validation_hint,
    )
    from keras_vit.models import model_image_size

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive. Received: {args.batch_size}")
    check_data_spec(args.data)
    model = load_keras_file(find_trained(args.model)[0])
    classes = num_classes(model)
    if classes is None:
        raise UsageError(f"--model {args.model!r} has no classification head (num_classes=0)")
    # (height, width); for a dynamic model the size it was built for.
    height, width = model_image_size(model)
    data = load_data(
        args.data,
        (height, width),
        seed=args.seed,
        skip_corrupt=args.skip_corrupt,
    )
    if data.num_classes != classes:
        raise ValueError(
            f"--data has {data.num_classes} classes but the model predicts {classes}. "
            f"Received: data={args.data!r}"
        )
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
        metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")],
    )
    loss, accuracy = model.evaluate(data_module.eval_pipeline(data, args.batch_size), verbose=0)
    print(f"{data.validation_size} images: loss {loss:.4f}, accuracy {accuracy:.4f}")
    return 0
