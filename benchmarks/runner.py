"""One benchmark contender in its own process, driven by benchmarks/bench.py.

The runner builds one model of one library, warms it up (tracing, XLA
compilation, first allocations), prints a JSON line ``{"ready": ...}`` (or
``{"skipped": reason}`` and exits), then answers commands read one per line
on stdin, each with one JSON line on stdout:

    infer SECONDS   run inference batches for at least SECONDS (at least one)
    train SECONDS   run training steps (AdamW, softmax cross-entropy) likewise
    gemm SECONDS    (contender "gemm" only) float32 matrix products likewise
    quit            print the final memory figures and exit

Every answer carries ``peak_rss_mb``: the process's peak resident set
(getrusage ru_maxrss) so far. The orchestrator sends the commands of all
contenders interleaved, so each figure is measured under the same load.

Contenders: keras_vit (Keras on TensorFlow, or on JAX with KERAS_BACKEND=jax,
see bench.py), keras_hub (ViTBackbone + Dense head), vit_keras (build_model),
timm (VisionTransformer on PyTorch CPU, eager), gemm (the machine limit).
"""

import argparse
import json
import os
import resource
import sys
import time

import numpy as np

ARCHITECTURES = {
    # name -> (patch_size, hidden_dim, mlp_dim, num_heads, num_layers)
    "S16": (16, 384, 1536, 6, 12),
    "B16": (16, 768, 3072, 12, 12),
    "Ti16": (16, 192, 768, 3, 12),
}
NUM_CLASSES = 1000
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.05
GEMM_SIZE = 2048


class Skip(Exception):
    """The contender cannot run here; the message says why."""


def peak_rss_mb():
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def emit(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- Keras contenders


def seed_keras(seed):
    """keras.utils.set_random_seed, without loading TensorFlow where it is not used.

    Keras also seeds TensorFlow whenever TensorFlow is installed, and imports
    it to do so, on any backend. In a JAX process that alone held ~0.45 GB
    (ViT-S/16 224, peak 1.92 against 1.43 GB) that the JAX model, its train
    step and the runner's NumPy batches never use. So on a backend other than
    TensorFlow, and while nothing else has imported it, the import is refused
    for the call (a None entry in sys.modules makes it raise ImportError,
    which Keras takes for "not installed" and remembers: for the rest of the
    process Keras treats TensorFlow as absent, which the runner's NumPy
    batches never ask about).
    """
    import keras

    if keras.backend.backend() == "tensorflow" or "tensorflow" in sys.modules:
        keras.utils.set_random_seed(seed)
        return
    sys.modules["tensorflow"] = None
    try:
        keras.utils.set_random_seed(seed)
    finally:
        del sys.modules["tensorflow"]


def keras_loss_and_optimizer():
    import keras

    optimizer = keras.optimizers.AdamW(learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return optimizer, loss


def build_keras_vit(arch, image_size, options):
    import keras

    try:
        import keras_vit
    except ImportError as error:  # pragma: no cover - only outside the repo
        raise Skip(f"keras_vit not importable: {error}") from error
    patch, dim, mlp, heads, layers = arch
    # CPU streams (keras_vit.streams): set before TensorFlow runs an operation.
    streams = int(options.get("streams", "1"))
    if streams > 1:
        keras_vit.streams.configure_cpu_streams(streams)
    # Gradient checkpointing of every block: VisionTransformer(remat=True).
    remat = options.get("remat", "0") == "1"
    # dtype=mixed_bfloat16: the model computes in bfloat16 (variables float32).
    dtype = options.get("dtype", "float32")
    model = keras_vit.VisionTransformer(
        image_size=image_size,
        patch_size=patch,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=dim,
        mlp_dim=mlp,
        num_classes=NUM_CLASSES,
        remat=remat,
        dtype=dtype,
    )
    # "auto": as keras_vit.training.compile_model decides (plan_xla): on a
    # TensorFlow machine without GPU/TPU, XLA for the float32 train step, and
    # graph mode for inference on Intel CPUs with AVX-512 (XLA elsewhere);
    # graph-mode training from 512 tokens (384 x 384), and inference too where
    # oneDNN runs AVX-512; bfloat16 in graph
    # mode where the CPU has it. compile_fast is compile_model's plan for the
    # bench's own optimizer and loss; it also builds the optimizer's slots and,
    # with streams configured, cuts each batch into parts (use_streams).
    jit = options.get("jit", "auto")
    jit_compile = {"0": False, "1": True}.get(jit, "auto")
    optimizer, loss = keras_loss_and_optimizer()
    # streams="auto" (no streams option): the streams configured above, or,
    # with none, inference in parts (at least two, of at most 1600 tokens)
    # where it runs as XLA programs; streams=1 keeps every batch whole.
    keras_vit.training.compile_fast(
        model,
        optimizer,
        loss,
        jit_compile=jit_compile,
        streams=streams if "streams" in options else "auto",
    )
    train_xla, infer_xla = keras_vit.training.plan_xla(model, jit_compile, streams)
    description = (
        f"keras {keras.__version__} ({keras.backend.backend()}), {dtype}, "
        f"{'XLA' if train_xla else 'graph-mode'} training, "
        f"{'XLA' if infer_xla else 'graph-mode'} inference"
    )
    inference_parts = keras_vit.streams.parts(model)[1]
    if streams > 1:
        description += f", {streams} CPU streams"
    elif inference_parts > 1:
        description += f", inference in {inference_parts} parts"
        limit = keras_vit.streams.part_tokens(model)
        if limit is not None:
            description += f" or more, of at most {limit} tokens"
    if keras.backend.backend() == "tensorflow":
        # Importing keras_vit turns on TensorFlow's pooling CPU allocator
        # (keras_vit/_memory.py) unless TF_CPU_ALLOCATOR_USE_BFC says otherwise.
        pooled = keras_vit._memory.cpu_memory_pooled()
        description += ", pooled CPU memory" if pooled else ", malloc CPU memory"
    return model, description + (", remat of every block" if remat else "")


def build_keras_hub(arch, image_size, options):
    import keras

    try:
        import keras_hub
    except ImportError as error:
        raise Skip(f"keras-hub not installed: {error}") from error
    patch, dim, mlp, heads, layers = arch
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(image_size, image_size, 3),
        patch_size=patch,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=dim,
        mlp_dim=mlp,
    )
    images = keras.Input((image_size, image_size, 3))
    tokens = backbone(images)
    logits = keras.layers.Dense(NUM_CLASSES, name="head")(tokens[:, 0])
    model = keras.Model(images, logits)
    optimizer, loss = keras_loss_and_optimizer()
    model.compile(optimizer=optimizer, loss=loss)
    return model, f"keras-hub {keras_hub.__version__}, compile() defaults"


def build_vit_keras(arch, image_size, options):
    try:
        from vit_keras import vit
    except ImportError as error:
        raise Skip(f"vit-keras not installed or not importable: {error}") from error
    import importlib.metadata

    patch, dim, mlp, heads, layers = arch
    model = vit.build_model(
        image_size=image_size,
        patch_size=patch,
        num_layers=layers,
        hidden_size=dim,
        num_heads=heads,
        name="vit",
        mlp_dim=mlp,
        classes=NUM_CLASSES,
        dropout=0.0,
    )
    optimizer, loss = keras_loss_and_optimizer()
    model.compile(optimizer=optimizer, loss=loss)
    return model, f"vit-keras {importlib.metadata.version('vit-keras')}, compile() defaults"


class KerasContender:
    def __init__(self, builder, arch, image_size, batch_size, options):
        import keras

        seed_keras(0)
        # dtype=mixed_bfloat16 for every Keras contender (keras_vit also takes it directly).
        keras.config.set_dtype_policy(options.get("dtype", "float32"))
        self.model, self.description = builder(arch, image_size, options)
        # Every Keras contender gets its optimizer slots before the rounds, as
        # keras_vit.training.compile_model creates them. Left to Keras, they are
        # created while the first train step is traced, and after a predict
        # function an XLA train step then keeps ~2 GB more at ViT-S/16 384.
        if not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        rng = np.random.default_rng(0)
        self.images = rng.uniform(-1, 1, (batch_size, image_size, image_size, 3)).astype("float32")
        self.labels = rng.integers(0, NUM_CLASSES, (batch_size,)).astype("int32")
        self.parameters = self.model.count_params()

    def infer(self):
        return self.model.predict_on_batch(self.images)

    def train(self):
        return self.model.train_on_batch(self.images, self.labels)


# --------------------------------------------------------------------------- timm


class TimmContender:
    def __init__(self, arch, image_size, batch_size, options):
        try:
            import timm
            import torch
        except ImportError as error:
            raise Skip(f"timm/torch not installed: {error}") from error
        from timm.models.vision_transformer import VisionTransformer

        torch.manual_seed(0)
        patch, dim, mlp, heads, layers = arch
        self.torch = torch
        self.model = VisionTransformer(
            img_size=image_size,
            patch_size=patch,
            embed_dim=dim,
            depth=layers,
            num_heads=heads,
            mlp_ratio=mlp / dim,
            num_classes=NUM_CLASSES,
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY
        )
        self.loss = torch.nn.CrossEntropyLoss()
        rng = np.random.default_rng(0)
        images = rng.uniform(-1, 1, (batch_size, 3, image_size, image_size)).astype("float32")
        self.images = torch.from_numpy(images)
        self.labels = torch.from_numpy(rng.integers(0, NUM_CLASSES, (batch_size,)))
        self.parameters = sum(p.numel() for p in self.model.parameters())
        # dtype=mixed_bfloat16: bfloat16 autocast, PyTorch's mixed precision on the CPU.
        self.bfloat16 = options.get("dtype", "float32") == "mixed_bfloat16"
        self.description = (
            f"timm {timm.__version__}, torch {torch.__version__} eager, "
            f"{torch.get_num_threads()} threads" + (", bfloat16 autocast" if self.bfloat16 else "")
        )

    def autocast(self):
        return self.torch.autocast("cpu", dtype=self.torch.bfloat16, enabled=self.bfloat16)

    def infer(self):
        self.model.eval()
        with self.torch.inference_mode(), self.autocast():
            return self.model(self.images).float().numpy()

    def train(self):
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.loss(self.model(self.images), self.labels)
        loss.backward()
        self.optimizer.step()
        return loss.item()


# --------------------------------------------------------------------------- the machine limit


class GemmContender:
    """GEMM throughput of NumPy, TensorFlow and PyTorch (where installed), float32 or bfloat16.

    The fastest counts: the machine's limit is what its best product reaches.
    """

    def __init__(self, arch, image_size, batch_size, options):
        # gemm_size=N: a smaller square product for quick checks (the bench keeps 2048).
        self.size = int(options.get("gemm_size", GEMM_SIZE))
        if self.size < 1:
            raise ValueError(f"gemm_size must be a positive integer, got {self.size}")
        rng = np.random.default_rng(0)
        self.a = rng.standard_normal((self.size, self.size)).astype("float32")
        self.b = rng.standard_normal((self.size, self.size)).astype("float32")
        # dtype=mixed_bfloat16: bfloat16 products (NumPy has none).
        self.dtype = "float32" if options.get("dtype", "float32") == "float32" else "bfloat16"
        self.candidates = []
        if self.dtype == "float32":
            self.candidates.append(("numpy", lambda: self.a @ self.b))
        try:
            import tensorflow as tf

            ta, tb = (tf.cast(tf.constant(m), self.dtype) for m in (self.a, self.b))
            self.candidates.append(("tensorflow", lambda: tf.matmul(ta, tb).numpy()))
        except ImportError:
            pass
        try:
            import torch

            pa, pb = (torch.from_numpy(m).to(getattr(torch, self.dtype)) for m in (self.a, self.b))
            self.candidates.append(("torch", lambda: torch.mm(pa, pb)))
        except ImportError:
            pass
        names = ", ".join(name for name, _ in self.candidates)
        self.description = f"{self.size}x{self.size} {self.dtype} matmul, the fastest of {names}"
        self.parameters = 0
        for _ in range(2):
            self.gemm(1.0)

    def gemm(self, seconds):
        flops = 2.0 * self.size**3
        best = {}
        for name, product in self.candidates:
            count, start = 0, time.perf_counter()
            while True:
                product()
                count += 1
                elapsed = time.perf_counter() - start
                if elapsed >= seconds / len(self.candidates):
                    break
            best[name] = flops * count / elapsed / 1e9
        return best


# --------------------------------------------------------------------------- driver


def timed(step, seconds):
    count, start = 0, time.perf_counter()
    while True:
        step()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count, elapsed


def make_contender(name, arch, image_size, batch_size, options):
    if name == "timm":
        return TimmContender(arch, image_size, batch_size, options)
    if name == "gemm":
        return GemmContender(arch, image_size, batch_size, options)
    builders = {
        "keras_vit": build_keras_vit,
        "keras_hub": build_keras_hub,
        "vit_keras": build_vit_keras,
    }
    if name not in builders:
        raise ValueError(f"unknown contender: {name!r}; expected one of {sorted(builders)}")
    return KerasContender(builders[name], arch, image_size, batch_size, options)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contender", required=True)
    parser.add_argument("--model", default="S16", choices=sorted(ARCHITECTURES))
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up calls of each kind")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE")
    args = parser.parse_args(argv)
    options = dict(item.split("=", 1) for item in args.option)
    arch = ARCHITECTURES[args.model]
    start = time.perf_counter()
    try:
        contender = make_contender(args.contender, arch, args.image_size, args.batch_size, options)
    except Skip as reason:
        emit(skipped=str(reason))
        return 0
    except Exception as error:  # a peer that fails to build is skipped, with the reason
        emit(skipped=f"{type(error).__name__}: {error}")
        return 0
    warm = {}
    if args.contender != "gemm":
        for kind in ("infer", "train"):
            begin = time.perf_counter()
            for _ in range(args.warmup):
                getattr(contender, kind)()
            warm[kind] = time.perf_counter() - begin
    emit(
        ready=True,
        description=contender.description,
        parameters=int(contender.parameters),
        setup_s=time.perf_counter() - start,
        warmup_s=warm,
        peak_rss_mb=peak_rss_mb(),
        tensorflow_loaded="tensorflow" in sys.modules,
        pid=os.getpid(),
    )
    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "quit":
            emit(done=True, peak_rss_mb=peak_rss_mb())
            return 0
        seconds = float(command[1]) if len(command) > 1 else 1.0
        if command[0] == "gemm":
            emit(gflops=contender.gemm(seconds), peak_rss_mb=peak_rss_mb())
            continue
        count, elapsed = timed(getattr(contender, command[0]), seconds)
        emit(
            kind=command[0],
            steps=count,
            seconds=elapsed,
            images_per_s=count * args.batch_size / elapsed,
            peak_rss_mb=peak_rss_mb(),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
