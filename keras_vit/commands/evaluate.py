"""`keras-vit evaluate`: loss and accuracy of a trained model on a dataset."""

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
    from keras_vit.export import load_trained
    from keras_vit.models import model_image_size

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive. Received: {args.batch_size}")
    model, _ = load_trained(args.model)
    image_size = model_image_size(model)[0]  # a dynamic model: the size it was built for
    data = data_module.load(
        args.data, image_size=image_size, seed=args.seed, skip_corrupt=args.skip_corrupt
    )
    classes = model.outputs[0].shape[-1]
    if data.num_classes != classes:
        raise ValueError(
            f"--data has {data.num_classes} classes but the model predicts {classes}. "
            f"Received: data={args.data!r}"
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
