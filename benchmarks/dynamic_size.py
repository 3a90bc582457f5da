"""Predict speed of a model built with dynamic_image_size against the fixed one.

    python benchmarks/dynamic_size.py                 # ViT-S/16 at 224, 2 rounds
    python benchmarks/dynamic_size.py --rounds 3 --model ViT_B16

Each round runs four processes one after the other: the fixed and the dynamic
model, in TensorFlow's graph mode and with XLA. Each process times five
groups of four `predict_on_batch` calls (batch 8) at the model's own size and
reports the best group. The dynamic model is first called at two other sizes,
so that its Keras predict function is the relaxed trace that serves every
size. The table gives the median over rounds and dynamic / fixed.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def child(model_name, dynamic, jit, image_size):
    import keras_vit

    model = getattr(keras_vit, model_name)(
        image_size=image_size, num_classes=1000, dynamic_image_size=dynamic
    )
    model.compile(jit_compile=jit)
    images = np.random.default_rng(0).uniform(-1, 1, (8, image_size, image_size, 3))
    images = images.astype("float32")
    if dynamic:  # two other sizes first: the trace that serves every size
        model.predict_on_batch(images[:, : image_size - 32, : image_size - 32])
        model.predict_on_batch(images[:, : image_size - 64])
    for _ in range(2):
        model.predict_on_batch(images)
    groups = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(4):
            model.predict_on_batch(images)
        groups.append(4 * len(images) / (time.perf_counter() - start))
    print(json.dumps({"images_per_s": max(groups)}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ViT_S16")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("DYNAMIC", "JIT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.image_size < 80:
        parser.error(
            f"--rounds must be positive and --image-size at least 80. "
            f"Received: {args.rounds}, {args.image_size}"
        )
    if args.child:
        child(args.model, args.child[0] == "1", args.child[1] == "1", args.image_size)
        return 0
    results = {}
    for index in range(args.rounds):
        for jit in ("0", "1"):
            for dynamic in ("0", "1"):
                command = [sys.executable, os.path.abspath(__file__), "--child", dynamic, jit]
                command += ["--model", args.model, "--image-size", str(args.image_size)]
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                rate = json.loads(done.stdout.strip().splitlines()[-1])["images_per_s"]
                results.setdefault((jit, dynamic), []).append(rate)
                print(f"round {index + 1}: jit={jit} dynamic={dynamic} {rate:.2f} images/s")
    print(f"\n{args.model} {args.image_size}, batch 8, best of 5 groups, median of rounds:")
    print("| mode | fixed img/s | dynamic img/s | dynamic / fixed |\n|---|---:|---:|---:|")
    for jit, mode in (("0", "graph mode"), ("1", "XLA")):
        fixed, dynamic = (float(np.median(results[(jit, d)])) for d in ("0", "1"))
        print(f"| {mode} | {fixed:.2f} | {dynamic:.2f} | {dynamic / fixed:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
