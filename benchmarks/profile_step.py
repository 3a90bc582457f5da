"""Where a keras_vit step's time goes: per-operation time from a profiler trace.

    python benchmarks/profile_step.py                          # ViT-S/16 224 training step, XLA
    python benchmarks/profile_step.py --mode infer             # predict_on_batch
    python benchmarks/profile_step.py --image-size 384 --jit 0 # graph-mode training at 384
    python benchmarks/profile_step.py --streams 2              # two CPU streams
    python benchmarks/profile_step.py --dtype mixed_bfloat16   # bfloat16 compute
    KERAS_BACKEND=jax python benchmarks/profile_step.py        # the JAX backend

The model and its compile settings are benchmarks/runner.py's `keras_vit`
contender (`--jit auto` as keras_vit.training.compile_model). After warm-up
steps, `--steps` steps run under the TensorFlow or JAX profiler. The trace
(an XSpace protocol buffer, read with TensorFlow's xplane_pb2) gives each
operation's time on the executor threads: TensorFlow kernels in graph mode,
XLA thunks (dots, fusions) with XLA. Names lose their numeric suffixes
("MatMul.406" counts as "MatMul"), so each row is one kind of operation.

Operations running at the same time on the two cores each count their own
time, so the rows can add up to more than the step's wall time; the shares
are of their sum. Compare shares, not milliseconds, across runs: the machine
is shared.
"""

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runner import ARCHITECTURES, KerasContender, build_keras_vit  # noqa: E402

# Events that only wrap others (the executor's loop, a thread waiting).
WRAPPERS = ("Execute", "Process", "Await", "wait for completion", "BlockUntilReady")
# Operation kinds that are matrix products (TensorFlow kernels, XLA thunks).
PRODUCTS = re.compile(r"^_?(Mkl)?(Native)?(Fused)?(MatMul|Einsum|BatchMatMulV2|Conv2D)|^dot|^conv")
# XLA's YNNPACK fusions hold products (most of them on JAX) and reductions.
YNNPACK = "ynn_fusion"


def operation_kind(name):
    """The kind of an event: its TensorFlow op type, or an XLA thunk's name less its number.

    'block_0/mlp/fc1/MatMul:_MklMatMul' -> '_MklMatMul' (graph mode),
    'MatMul.406' -> 'MatMul', 'add_multiply_fusion.12' -> 'add_multiply_fusion' (XLA).
    """
    node_and_type = re.match(r"^.*[^:]:(\w+)$", name.strip())
    if node_and_type:
        return node_and_type.group(1)
    return re.sub(r"([._]\d+)+$", "", name.strip())


def is_product(kind):
    return bool(PRODUCTS.search(kind))


def category(kind):
    if is_product(kind):
        return "matrix products"
    if kind == YNNPACK:
        return "YNNPACK fusions (products, reductions)"
    return "everything else"


def aggregate(events, steps):
    """Per-step milliseconds and counts per operation kind.

    `events` are (thread name, event name, duration in picoseconds). Events of
    the Python thread, the Python tracer's function events (named "$file:line
    function" on whichever thread ran them, keras_vit's memory thread's sleeps
    among them), wrapper events and completion markers are left out.
    """
    milliseconds, counts = collections.Counter(), collections.Counter()
    for thread, name, picoseconds in events:
        if thread.startswith("python") or name.startswith(("$", "end: ")):
            continue  # Python's frames; the completion markers of asynchronous thunks
        if any(wrapper in name for wrapper in WRAPPERS):
            continue
        kind = operation_kind(name)
        milliseconds[kind] += picoseconds / 1e9 / steps
        counts[kind] += 1 / steps
    return milliseconds, counts


def read_trace(directory):
    """(thread, event, duration ps) of every event in the newest trace under `directory`."""
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError as error:
        raise SystemExit(f"reading the trace needs TensorFlow's xplane_pb2: {error}") from error
    paths = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise SystemExit(f"the profiler wrote no trace under {directory}")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as file:
        space.ParseFromString(file.read())
    for plane in space.planes:
        names = {key: value.name for key, value in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                yield line.name, names.get(event.metadata_id, "?"), event.duration_ps


def profile(step, steps, directory):
    import keras

    if keras.backend.backend() == "jax":
        import jax

        def start(directory):
            # JAX traces Python calls by default; they are not operations (and `aggregate`
            # drops them where a JAX without ProfileOptions records them anyway).
            if not hasattr(jax.profiler, "ProfileOptions"):
                return jax.profiler.start_trace(directory)
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            return jax.profiler.start_trace(directory, profiler_options=options)

        stop = jax.profiler.stop_trace
    else:
        import tensorflow as tf

        start, stop = tf.profiler.experimental.start, tf.profiler.experimental.stop
    start(directory)
    try:
        for _ in range(steps):
            step()
    finally:
        stop()


def report(milliseconds, counts, top):
    total = sum(milliseconds.values())
    lines = [f"{'operation':40s} {'ms/step':>9s} {'calls':>6s} {'share':>6s}"]
    for kind, value in milliseconds.most_common(top):
        lines.append(f"{kind[:40]:40s} {value:9.2f} {counts[kind]:6.0f} {value / total:6.1%}")
    categories = collections.Counter()
    for kind, value in milliseconds.items():
        categories[category(kind)] += value
    lines.append(
        "; ".join(
            f"{name}: {value:.1f} ms/step ({value / total:.0%})"
            for name, value in categories.most_common()
        )
    )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="S16", choices=sorted(ARCHITECTURES))
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--mode", default="train", choices=("train", "infer"))
    parser.add_argument("--jit", default="auto", choices=("auto", "0", "1"))
    parser.add_argument("--streams", type=int, default=1, help="CPU streams (keras_vit.streams)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "mixed_bfloat16"))
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (after 3 warm-up)")
    parser.add_argument("--top", type=int, default=25, help="rows to print")
    parser.add_argument("--trace-dir", help="keep the trace here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.top < 1 or args.streams < 1:
        parser.error(
            "--steps, --top and --streams must be >= 1. "
            f"Received: {args.steps}, {args.top}, {args.streams}"
        )
    if args.image_size < 16 or args.image_size % 16:
        parser.error(f"--image-size must be a multiple of 16. Received: {args.image_size}")

    arch = ARCHITECTURES[args.model]
    contender = KerasContender(
        build_keras_vit,
        arch,
        args.image_size,
        args.batch_size,
        {"jit": args.jit, "streams": str(args.streams), "dtype": args.dtype},
    )
    step = getattr(contender, args.mode)
    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    wall = (time.perf_counter() - start) / args.steps

    with tempfile.TemporaryDirectory() as scratch:
        directory = args.trace_dir or scratch
        profile(step, args.steps, directory)
        milliseconds, counts = aggregate(read_trace(directory), args.steps)
    if not milliseconds:
        raise SystemExit("the trace holds no operation events")
    print(
        f"{contender.description}: ViT-{args.model} {args.image_size}, batch "
        f"{args.batch_size}, {args.mode} step {wall * 1e3:.0f} ms "
        f"({args.batch_size / wall:.2f} images/s, unprofiled), {args.steps} steps profiled"
    )
    print(report(milliseconds, counts, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
