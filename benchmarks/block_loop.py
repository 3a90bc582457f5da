"""The transformer blocks unrolled (keras_vit's model) or run by one while loop.

    python benchmarks/block_loop.py --arch S16 --mode unrolled
    python benchmarks/block_loop.py --arch S16 --mode loop --remat
    python benchmarks/block_loop.py --arch tiny --mode loop --check

A question this answers: would one XLA `while` loop over the blocks (as
`nn.scan` in Flax, or a scan over stacked layers) compile a smaller program
and so lower the training process's peak memory? Run each mode in its own
process; the peak resident set (`VmHWM`) is the process's.

`unrolled` trains the keras_vit model as it is: twelve blocks, one after
the other, in one XLA train step. `loop` runs the same model's blocks but
the last through a `tf.while_loop`: the first block is called with each
block's weights in turn (stacked once per step, and mapped onto its
variables by `keras.StatelessScope`); the class-token-only last block, the
final norm and the head follow. `--remat` is keras_vit's `remat=True` for
`unrolled`, and `tf.recompute_grad` of the loop's body for `loop`.
`--check` first compares the loop's logits and gradients with the model's
(a small model is enough for that).

The train step is a plain one (AdamW, softmax cross-entropy, one
`tf.function(jit_compile=True)`), not compile_fast's, so that both modes
share everything but the blocks. Random images, batch 8 (4 for tiny).
"""

import argparse
import sys
import time

ARCHES = ("tiny", "S16", "B16", "S16-384")


def resident_gb():
    """The resident set and its peak, in GB (Linux)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024 / 1e9
    return fields["VmRSS"], fields["VmHWM"]


def report(stage):
    now, peak = resident_gb()
    print(f"{stage:<34} resident {now:.2f} GB, peak {peak:.2f} GB", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=ARCHES, default="S16")
    parser.add_argument("--mode", choices=("unrolled", "loop"), default="unrolled")
    parser.add_argument("--remat", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_vit

    report("imported")
    keras_vit._memory.return_freed_memory()  # as compile_fast does
    model_remat = args.remat and args.mode == "unrolled"
    if args.arch == "tiny":
        model = keras_vit.VisionTransformer(
            image_size=32,
            patch_size=8,
            num_layers=5,
            num_heads=2,
            hidden_dim=32,
            mlp_dim=64,
            num_classes=10,
            remat=model_remat,
        )
        batch, size, classes = 4, 32, 10
    else:
        size = 384 if args.arch.endswith("384") else 224
        model = getattr(keras_vit, "ViT_" + args.arch[:3])(image_size=size, remat=model_remat)
        batch, classes = 8, 1000

    names = [layer.name for layer in model.layers if layer.name.startswith("transformer_block_")]
    blocks = [model.get_layer(name) for name in names]
    looped, last = blocks[:-1], blocks[-1]
    template = looped[0]
    variables = template.trainable_variables
    for block in looped:
        if [v.shape for v in block.trainable_variables] != [v.shape for v in variables]:
            sys.exit(f"block {block.name} has other weights than {template.name}")
    embed, dropout, norm, pooling, head = (
        model.get_layer(name)
        for name in ("patch_encoder", "embedding_dropout", "encoder_norm", "pooling", "head")
    )

    def template_with(x, weights, training):
        with keras.StatelessScope(state_mapping=list(zip(variables, weights))):
            return template._forward(x, training, False)

    def loop_forward(images, training):
        x = dropout(embed(images), training=training)
        stacked = [
            tf.stack([block.trainable_variables[j].value for block in looped])
            for j in range(len(variables))
        ]

        def body(index, x):
            weights = [s[index] for s in stacked]
            if args.remat and training:
                recomputed = tf.recompute_grad(lambda x, *w: template_with(x, w, training))
                y = recomputed(x, *weights)
            else:
                y = template_with(x, weights, training)
            y.set_shape(x.shape)
            return index + 1, y

        _, x = tf.while_loop(
            lambda index, x: index < len(looped),
            body,
            (tf.constant(0), x),
            maximum_iterations=len(looped),
        )
        return head(pooling(norm(last(x, training=training))))

    def model_forward(images, training):
        return model(images, training=training)

    forward = loop_forward if args.mode == "loop" else model_forward
    optimizer = keras.optimizers.AdamW(1e-4)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=True)
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, forward(images, True))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    rng = np.random.default_rng(0)
    images = tf.constant(rng.uniform(-1, 1, (batch, size, size, 3)).astype("float32"))
    labels = tf.constant(rng.integers(0, classes, batch))
    if args.check:
        gap = float(tf.reduce_max(tf.abs(model(images) - loop_forward(images, False))))
        grads = []
        for run in (model_forward, loop_forward):
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, run(images, True))
            grads.append(tape.gradient(loss, model.trainable_variables))
        missing = sum(g is None for g in grads[1])
        worst = max(
            float(tf.reduce_max(tf.abs(a - b)) / (tf.reduce_max(tf.abs(a)) + 1e-12))
            for a, b in zip(*grads)
            if b is not None
        )
        print(
            f"loop against model: logits differ by {gap:.3g}, gradients by {worst:.3g} "
            f"(relative), {missing} gradients missing"
        )
        if gap > 1e-5 or worst > 1e-4 or missing:
            sys.exit("the loop does not compute what the model computes")
    report("built")
    start = time.perf_counter()
    train_step(images, labels)
    report(f"first step ({time.perf_counter() - start:.1f} s)")
    start = time.perf_counter()
    for _ in range(args.steps):
        float(train_step(images, labels))
    seconds = (time.perf_counter() - start) / args.steps
    report(f"{args.steps} steps ({batch / seconds:.2f} images/s)")


if __name__ == "__main__":
    main()
