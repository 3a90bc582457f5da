"""Train a ViT on CIFAR-10 from TensorFlow Datasets (needs a download once).

python examples/train_cifar10.py  [--epochs 100]
"""

import sys

from keras_vit import cli

if __name__ == "__main__":
    args = ["train", "--data", "tfds:cifar10", "--image-size", "32", "--model", "vit-digits"]
    args += ["--epochs", "100", "--batch-size", "128", "--flip", "yes", "--rand-augment"]
    sys.exit(cli.main(args + sys.argv[1:], own_process=True))  # this script owns its process
