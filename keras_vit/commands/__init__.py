"""Sub-commands of the `keras-vit` command line (see keras_vit.cli)."""
