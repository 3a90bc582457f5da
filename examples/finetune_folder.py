"""Fine-tune a pre-trained ViT on a folder of images (one sub-folder per class).

    python examples/finetune_folder.py IMAGES_DIR CHECKPOINT [--epochs 10]

CHECKPOINT is a checkpoint file readable by keras_vit.weights.load_weights (.npz,
.safetensors) or a model.keras; the head is re-initialised for the folder's classes.
"""

import sys

from keras_vit import cli

if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    folder, checkpoint, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    args = ["train", "--data", folder, "--weights", checkpoint, "--model", "ViT_B16"]
    args += ["--image-size", "224", "--epochs", "10", "--batch-size", "64", "--lr", "0.01"]
    args += ["--optimizer", "sgd", "--weight-decay", "0", "--warmup-epochs", "1"]
    args += ["--skip-corrupt", "--flip", "yes"]
    sys.exit(cli.main(args + rest, own_process=True))  # this script owns its process
