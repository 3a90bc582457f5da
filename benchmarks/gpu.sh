#!/usr/bin/env bash
# ViT-B/16 training throughput on one NVIDIA GPU, bfloat16 mixed precision:
# keras_vit on the JAX backend (jit train step) against timm with torch.compile
# and fused attention (scaled_dot_product_attention). Prints images/s and
# model-FLOPs utilisation (MFU = images/s x 3 x forward FLOPs / peak bf16 FLOP/s).
#
#   bash benchmarks/gpu.sh                 # batch 128, 224x224, 30 timed steps
#   BATCH=256 STEPS=50 PEAK_TFLOPS=989 bash benchmarks/gpu.sh
#
# Needs: jax with CUDA (or TensorFlow with a GPU: KERAS_BACKEND=tensorflow) and
# keras; torch with CUDA + timm for the comparison (skipped when absent).
# Writes benchmarks/results/gpu-<UTC time>.json (or $OUT/gpu.json when OUT is set).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=3 XLA_PYTHON_CLIENT_PREALLOCATE=false
BATCH="${BATCH:-128}" STEPS="${STEPS:-30}" WARMUP="${WARMUP:-5}" IMAGE="${IMAGE:-224}"
STAMP="$(date -u +%Y%m%d-%H%M%S)"
RESULT="${OUT:+$OUT/gpu.json}"
RESULT="${RESULT:-benchmarks/results/gpu-$STAMP.json}"
mkdir -p "$(dirname "$RESULT")"
LOG="$(mktemp -d)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

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
export BATCH STEPS WARMUP IMAGE PEAK

# Forward FLOPs of ViT-B/16 (2 per multiply-add), the same count as bench.py.
FLOPS="$(python - <<'EOF'
import os
p, d, m, L, s = 16, 768, 3072, 12, int(os.environ["IMAGE"])
n = (s // p) ** 2; t = n + 1
print(2 * n * p * p * 3 * d + L * (2 * t * d * 3 * d + 4 * t * t * d + 2 * t * d * d + 4 * t * d * m) + 2 * d * 1000)
EOF
)"
export FLOPS

echo "== keras_vit (KERAS_BACKEND=${KERAS_BACKEND:-jax}), mixed_bfloat16, batch $BATCH"
KERAS_BACKEND="${KERAS_BACKEND:-jax}" timeout 900 python - >"$LOG/keras_vit.json" <<'EOF'
import json, os, time
import numpy as np
import keras
import keras_vit

batch, steps, warmup, size = (int(os.environ[k]) for k in ("BATCH", "STEPS", "WARMUP", "IMAGE"))
keras.config.set_dtype_policy("mixed_bfloat16")
model = keras_vit.ViT_B16(image_size=size, num_classes=1000)
model.compile(
    optimizer=keras.optimizers.AdamW(1e-4, weight_decay=0.05),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    jit_compile=True,
)
rng = np.random.default_rng(0)
images = rng.uniform(-1, 1, (batch, size, size, 3)).astype("float32")
labels = rng.integers(0, 1000, (batch,))
for _ in range(warmup):
    model.train_on_batch(images, labels)
start = time.perf_counter()
for _ in range(steps):
    loss = model.train_on_batch(images, labels)
float(np.asarray(loss))
elapsed = time.perf_counter() - start
print(json.dumps({"contender": "keras_vit", "backend": keras.backend.backend(),
                  "images_per_s": steps * batch / elapsed, "loss": float(np.asarray(loss))}))
EOF
echo "rc=$? $(cat "$LOG/keras_vit.json")"

echo "== timm, torch.compile, SDPA, bf16 autocast, batch $BATCH"
timeout 900 python - >"$LOG/timm.json" <<'EOF'
import json, os, time
import torch
import timm

batch, steps, warmup, size = (int(os.environ[k]) for k in ("BATCH", "STEPS", "WARMUP", "IMAGE"))
assert torch.cuda.is_available(), "no CUDA device for torch"
torch.backends.cuda.matmul.allow_tf32 = True
model = timm.create_model("vit_base_patch16_224", pretrained=False, img_size=size).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True)
loss_fn = torch.nn.CrossEntropyLoss()
compiled = torch.compile(model)
images = torch.rand(batch, 3, size, size, device="cuda") * 2 - 1
labels = torch.randint(0, 1000, (batch,), device="cuda")

def step():
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_fn(compiled(images), labels)
    loss.backward()
    optimizer.step()
    return loss

for _ in range(warmup):
    step()
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(steps):
    loss = step()
torch.cuda.synchronize()
elapsed = time.perf_counter() - start
print(json.dumps({"contender": "timm", "torch": torch.__version__,
                  "images_per_s": steps * batch / elapsed, "loss": float(loss)}))
EOF
echo "rc=$? $(cat "$LOG/timm.json")"

python - "$LOG" "$RESULT" <<'EOF'
import json, os, sys
log, result = sys.argv[1], sys.argv[2]
flops, peak = float(os.environ["FLOPS"]), float(os.environ["PEAK"])
rows = []
for name in ("keras_vit", "timm"):
    try:
        with open(os.path.join(log, name + ".json")) as handle:
            row = json.loads(handle.read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        row = {"contender": name, "images_per_s": None, "skipped": "failed or not installed"}
    if row.get("images_per_s") and peak:
        row["mfu"] = row["images_per_s"] * 3 * flops / (peak * 1e12)
    rows.append(row)
report = {"model": "ViT-B/16", "image_size": int(os.environ["IMAGE"]),
          "batch": int(os.environ["BATCH"]), "dtype": "bfloat16 mixed",
          "forward_gflops_per_image": flops / 1e9, "peak_bf16_tflops": peak, "results": rows}
print("| contender | images/s | MFU |\n|---|---:|---:|")
for row in rows:
    ips, mfu = row.get("images_per_s"), row.get("mfu")
    print(f"| {row['contender']} | {ips:.0f} | {mfu:.1%} |" if ips and mfu is not None
          else f"| {row['contender']} | {ips or '-'} | - |")
with open(result, "w") as handle:
    json.dump(report, handle, indent=2)
print("wrote", result)
EOF
