#!/usr/bin/env bash
# ViT-B/16 training throughput on one NVIDIA GPU, bfloat16 mixed precision:
# keras_vit on the JAX backend against timm with torch.compile and fused
# attention (scaled_dot_product_attention), AdamW for both, the same fixed
# batch on the GPU for both. Prints images/s and model-FLOPs utilisation
# (MFU = images/s x 3 x forward FLOPs / peak dense bf16 FLOP/s).
#
#   bash benchmarks/gpu.sh                 # batch 128, 224x224, 30 timed steps
#   BATCH=256 STEPS=50 PEAK_TFLOPS=989 bash benchmarks/gpu.sh
#   CPU_CHECK=1 bash benchmarks/gpu.sh     # tiny sizes on the CPU (2 blocks, 64x64,
#                                          # batch 2): checks the script, measures nothing
#   PART_TIMEOUT=250 bash benchmarks/gpu.sh  # seconds for each contender (default 900)
#
# keras_vit is timed two ways: "jit step", one jax.jit program of the forward
# pass, the backward pass and the AdamW update over Keras' stateless API (what
# Keras' own JAX trainer compiles), and "train_on_batch", Keras' trainer, which
# copies the state back and waits for the loss after every step. Where the model's
# attention is keras.ops.dot_product_attention (JAX with a GPU), the jit step is
# also timed with keras_vit's hand-written attention core, first.
#
# Needs jax with CUDA (or TensorFlow with a GPU: KERAS_BACKEND=tensorflow, which
# times the trainer only) and keras; torch with CUDA and timm for the
# comparison (reported as failed when absent). Where keras is not installed
# (the lent GPU machines have jax, torch and timm but no keras), fetch its
# wheels on a machine with pip access first: `bash benchmarks/gpu_wheels.sh`
# writes them to .whl/, and this script installs them into a temporary folder.
# Writes benchmarks/results/gpu-<UTC time>.json (or $OUT/gpu.json when OUT is set).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=3 XLA_PYTHON_CLIENT_PREALLOCATE=false
export CPU_CHECK="${CPU_CHECK:-0}"
if [ "$CPU_CHECK" = 1 ]; then
    # Two of the twelve blocks: every stage runs, compiles stay short on a CPU.
    BATCH="${BATCH:-2}" STEPS="${STEPS:-2}" WARMUP="${WARMUP:-1}" IMAGE="${IMAGE:-64}" LAYERS="${LAYERS:-2}"
    export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
else
    BATCH="${BATCH:-128}" STEPS="${STEPS:-30}" WARMUP="${WARMUP:-5}" IMAGE="${IMAGE:-224}" LAYERS="${LAYERS:-12}"
fi
PART_TIMEOUT="${PART_TIMEOUT:-900}"
STAMP="$(date -u +%Y%m%d-%H%M%S)"
RESULT="${OUT:+$OUT/gpu.json}"
RESULT="${RESULT:-benchmarks/results/gpu-$STAMP.json}"
mkdir -p "$(dirname "$RESULT")"
LOG="$(mktemp -d)"

if ! "$PY" -c "import keras" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        echo "keras is not installed: installing .whl/*.whl into $LOG/site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$LOG/site" .whl/*.whl || exit 1
        export PYTHONPATH="$PYTHONPATH:$LOG/site"
    else
        echo "keras is not installed and .whl/ holds no wheels (bash benchmarks/gpu_wheels.sh)"
    fi
fi
[ "$CPU_CHECK" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# Peak dense bf16 FLOP/s for the MFU; override with PEAK_TFLOPS.
peak_tflops() {
    if [ -n "${PEAK_TFLOPS:-}" ]; then echo "$PEAK_TFLOPS"; return; fi
    local name
    name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
    case "$name" in
        *H200* | *H100*SXM* | *"H100 80GB HBM3"*) echo 989 ;;
        *H100*) echo 756 ;;
        *A100*) echo 312 ;;
        *L40S*) echo 362 ;;
        *L4*) echo 121 ;;
        *A10*) echo 125 ;;
        *V100*) echo 125 ;;
        *) echo 0 ;;
    esac
}
PEAK="$(peak_tflops)"
[ "$CPU_CHECK" = 1 ] && PEAK=0
export BATCH STEPS WARMUP IMAGE LAYERS PEAK PART_TIMEOUT

# Forward FLOPs of ViT-B/16 per image (2 per multiply-add), bench.py's count
# (all twelve blocks: the MFU is left out when LAYERS is not 12).
FLOPS="$("$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from bench import model_flops
print(model_flops('B16', $IMAGE))")" || exit 1
export FLOPS

echo "== keras_vit (KERAS_BACKEND=${KERAS_BACKEND:-jax}), mixed_bfloat16, batch $BATCH"
KERAS_BACKEND="${KERAS_BACKEND:-jax}" timeout "$PART_TIMEOUT" "$PY" - >"$LOG/keras_vit.json" 2>"$LOG/keras_vit.err" <<'EOF'
import functools, json, os, re, sys, time, traceback
import numpy as np
import keras
import keras_vit

batch, steps, warmup, size, layers = (
    int(os.environ[k]) for k in ("BATCH", "STEPS", "WARMUP", "IMAGE", "LAYERS"))
cpu_check = os.environ["CPU_CHECK"] == "1"
backend = keras.backend.backend()
if backend == "jax":
    import jax
    device = str(jax.devices()[0])
    gpu = jax.devices()[0].platform == "gpu"
else:
    import tensorflow as tf
    gpu = bool(tf.config.list_physical_devices("GPU"))
    device = "GPU" if gpu else "CPU"
if not gpu and not cpu_check:
    sys.exit(f"keras ({backend}) sees no GPU, only {device}")

keras.config.set_dtype_policy("mixed_bfloat16")
architecture = dict(keras_vit.models.VARIANTS["ViT_B16"], num_layers=layers)
model = keras_vit.VisionTransformer(image_size=size, num_classes=1000, **architecture)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
rng = np.random.default_rng(0)
images = keras.ops.convert_to_tensor(rng.uniform(-1, 1, (batch, size, size, 3)).astype("float32"))
labels = keras.ops.convert_to_tensor(rng.integers(0, 1000, (batch,)).astype("int32"))


def timed(step):
    """images/s over `steps` calls after `warmup`, waiting for the last result."""
    for _ in range(warmup):
        loss = step()
    float(np.asarray(loss))
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss = float(np.asarray(loss))
    return steps * batch / (time.perf_counter() - start), loss


CORE = "keras_vit's hand-written core"


def attention_path():
    """Which attention the model runs: keras.ops.dot_product_attention on JAX with a GPU
    (and whether Keras can hand these shapes to cuDNN's flash attention), else keras_vit's
    hand-written core."""
    from keras_vit.layers import attention
    if not attention._fuses_attention():
        return CORE
    try:  # Keras' own check (private): GPU, cuDNN, dtype and layout
        from keras.src.backend.jax.nn import _can_use_flash_attention
        heads = architecture["num_heads"]
        probe = jax.numpy.zeros(
            (batch, (size // 16) ** 2 + 1, heads, architecture["hidden_dim"] // heads), "bfloat16")
        flash = bool(_can_use_flash_attention(probe, probe, probe, None))
    except Exception as error:  # noqa: BLE001 - a report, not a decision
        flash = f"unknown ({type(error).__name__})"
    return f"keras.ops.dot_product_attention (cuDNN flash attention: {flash})"


ATTENTION = attention_path()


def report(variant, run, attention=ATTENTION):
    """Times `run` and prints its row; an error becomes a failed row (the other rows go on:
    a GPU lease is short)."""
    row = {"contender": f"keras_vit ({variant})", "backend": backend, "device": device,
           "keras": keras.__version__, "attention": attention}
    try:
        images_per_s, loss = run()
        row.update(images_per_s=images_per_s, loss=loss)
    except Exception as error:  # noqa: BLE001 - reported, and the traceback goes to stderr
        traceback.print_exc()
        message = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(error)).split())  # one line
        row.update(images_per_s=None, error=[f"{type(error).__name__}: {message}"[:500]])
    print(json.dumps(row), flush=True)


if backend == "jax":
    optimizer = keras.optimizers.AdamW(1e-4, weight_decay=0.05)
    optimizer.build(model.trainable_variables)

    def compute_loss(trainable, non_trainable, x, y):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, logits), non_trainable

    def timed_jit_step():
        """Times one jax.jit program of the whole step, traced now, from the model's and the
        optimizer's current values; hands the last values back to them (the step donates
        its state)."""
        gradients = jax.value_and_grad(compute_loss, has_aux=True)

        @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
        def train_step(trainable, non_trainable, slots, x, y):
            (loss, non_trainable), grads = gradients(trainable, non_trainable, x, y)
            trainable, slots = optimizer.stateless_apply(slots, grads, trainable)
            return trainable, non_trainable, slots, loss

        variables = [model.trainable_variables, model.non_trainable_variables, optimizer.variables]
        state = [[v.value for v in group] for group in variables]

        def jit_step():
            *state[:], loss = train_step(*state, images, labels)  # the donated state replaced
            return loss

        result = timed(jit_step)
        for group, values in zip(variables, state):
            for variable, value in zip(group, values):
                variable.assign(value)
        return result

    if cpu_check or ATTENTION != CORE:
        # First, the step with keras_vit's hand-written attention core (what it runs on
        # CPUs): keras.config.disable_flash_attention() keeps it on GPUs, for what is
        # traced while it holds. Then the default, traced again.
        keras.config.disable_flash_attention()
        report("jit step, hand-written attention", timed_jit_step, attention=CORE)
        keras.config.enable_flash_attention()  # Keras' default: it decides
    report("jit step", timed_jit_step)

model.compile(optimizer=keras.optimizers.AdamW(1e-4, weight_decay=0.05), loss=loss_fn,
              jit_compile=True)
report("train_on_batch", lambda: timed(lambda: model.train_on_batch(images, labels)))
EOF
echo "rc=$?"; cat "$LOG/keras_vit.json"; tail -3 "$LOG/keras_vit.err"

echo "== timm, torch.compile, SDPA, bf16 autocast, batch $BATCH"
timeout "$PART_TIMEOUT" "$PY" - >"$LOG/timm.json" 2>"$LOG/timm.err" <<'EOF'
import json, os, sys, time
import torch
import timm

batch, steps, warmup, size, layers = (
    int(os.environ[k]) for k in ("BATCH", "STEPS", "WARMUP", "IMAGE", "LAYERS"))
device = "cpu" if os.environ["CPU_CHECK"] == "1" else "cuda"
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
model = timm.create_model("vit_base_patch16_224", pretrained=False, img_size=size,
                          depth=layers).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05,
                              fused=device == "cuda")
loss_fn = torch.nn.CrossEntropyLoss()
compiled = torch.compile(model)
images = torch.rand(batch, 3, size, size, device=device) * 2 - 1
labels = torch.randint(0, 1000, (batch,), device=device)


def step():
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = loss_fn(compiled(images), labels)
    loss.backward()
    optimizer.step()
    return loss


def synchronize():
    if device == "cuda":
        torch.cuda.synchronize()


for _ in range(warmup):
    step()
synchronize()
start = time.perf_counter()
for _ in range(steps):
    loss = step()
synchronize()
elapsed = time.perf_counter() - start
print(json.dumps({"contender": "timm (torch.compile)", "device": device, "torch": torch.__version__,
                  "timm": timm.__version__, "images_per_s": steps * batch / elapsed,
                  "loss": float(loss.detach())}))
EOF
echo "rc=$?"; cat "$LOG/timm.json"; tail -3 "$LOG/timm.err"

"$PY" - "$LOG" "$RESULT" <<'EOF'
import json, os, sys
log, result = sys.argv[1], sys.argv[2]
flops, peak = float(os.environ["FLOPS"]), float(os.environ["PEAK"])
rows = []
for name in ("keras_vit", "timm"):
    try:
        with open(os.path.join(log, name + ".json")) as handle:
            found = [json.loads(line) for line in handle if line.startswith("{")]
    except OSError:
        found = []
    if not found:
        with open(os.path.join(log, name + ".err")) as handle:
            error = handle.read().strip().splitlines()[-3:] or [
                f"no output: killed, or over PART_TIMEOUT ({os.environ['PART_TIMEOUT']} s)"
            ]
        found = [{"contender": name, "images_per_s": None, "error": error}]
    rows += found
for row in rows:
    if row.get("images_per_s") and peak and int(os.environ["LAYERS"]) == 12:
        row["mfu"] = row["images_per_s"] * 3 * flops / (peak * 1e12)
report = {"model": "ViT-B/16", "layers": int(os.environ["LAYERS"]),
          "image_size": int(os.environ["IMAGE"]),
          "batch": int(os.environ["BATCH"]), "steps": int(os.environ["STEPS"]),
          "dtype": "bfloat16 mixed", "cpu_check": os.environ["CPU_CHECK"] == "1",
          "forward_gflops_per_image": flops / 1e9, "peak_bf16_tflops": peak, "results": rows}
print("| contender | images/s | MFU |\n|---|---:|---:|")
for row in rows:
    ips, mfu = row.get("images_per_s"), row.get("mfu")
    print(f"| {row['contender']} | {ips:.1f} | " + (f"{mfu:.1%} |" if mfu is not None else "- |")
          if ips else f"| {row['contender']} | failed: {' / '.join(row.get('error', []))} | - |")
with open(result, "w") as handle:
    json.dump(report, handle, indent=2)
print("wrote", result)
EOF
