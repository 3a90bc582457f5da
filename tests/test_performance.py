"""The fast paths compute the same numbers: rematerialization, and the benchmark's FLOPs.

Also: the benchmark scripts run (profile_step.py, gpu.sh's CPU check).
"""

import importlib.util
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_vit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark_script(name):
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"keras_vit_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def json_of_script(script, *args, **env):
    """The last line `python -c script *args` prints, as JSON; `env` added to os.environ."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_sgd_step(model, images, labels, jit_compile):
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    loss = model.train_on_batch(images, labels)
    return loss, [np.array(w) for w in model.weights]


@pytest.mark.parametrize("how", ["argument", "scope"])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_remat_blocks_train_like_plain_blocks(tiny_config, images, jit_compile, how):
    labels = np.array([1, 7])
    plain = keras_vit.VisionTransformer(**tiny_config)
    if how == "argument":
        remat = keras_vit.VisionTransformer(**tiny_config, remat=True)
    else:
        names = [f"transformer_block_{i}" for i in range(tiny_config["num_layers"])]
        with keras.RematScope(mode="list_of_layers", layer_names=names):
            remat = keras_vit.VisionTransformer(**tiny_config)
    # The head starts at zero (the original init), which would stop every gradient
    # below it on the first step; give it random values.
    head = plain.get_layer("head")
    head.kernel.assign(np.random.default_rng(1).normal(0, 0.5, head.kernel.shape))
    remat.set_weights(plain.get_weights())
    np.testing.assert_allclose(
        remat.predict_on_batch(images), plain.predict_on_batch(images), rtol=1e-5, atol=1e-6
    )
    initial = plain.get_weights()
    plain_loss, plain_weights = one_sgd_step(plain, images, labels, jit_compile)
    remat_loss, remat_weights = one_sgd_step(remat, images, labels, jit_compile)
    np.testing.assert_allclose(remat_loss, plain_loss, rtol=1e-5)
    for after_plain, after_remat in zip(plain_weights, remat_weights):
        np.testing.assert_allclose(after_remat, after_plain, rtol=1e-4, atol=1e-6)
    # The step moved the weights, so equal results mean equal gradients.
    moved = [not np.allclose(a, b) for a, b in zip(initial, plain_weights)]
    assert all(moved)


def test_remat_mode_is_only_on_the_named_blocks(tiny_config):
    with keras.RematScope(mode="list_of_layers", layer_names=["transformer_block_1"]):
        model = keras_vit.VisionTransformer(**tiny_config)
    block = model.get_layer("transformer_block_1")
    assert block.rematerialized_call(block.call) is not block.call
    other = model.get_layer("transformer_block_0")
    assert other.rematerialized_call(other.call) == other.call


def test_remat_argument_recomputes_in_training_only_and_is_saved(tiny_config, monkeypatch):
    model = keras_vit.VisionTransformer(**tiny_config, remat=True)
    block = model.get_layer("transformer_block_0")
    assert block.get_config()["remat"] is True
    assert keras_vit.layers.TransformerBlock.from_config(block.get_config()).remat is True
    calls = []
    original = keras_vit.layers.transformer.remat

    def counting(layer, function):
        calls.append(function)
        return original(layer, function)

    monkeypatch.setattr(keras_vit.layers.transformer, "remat", counting)
    inputs = np.zeros((1, 5, tiny_config["hidden_dim"]), "float32")
    block(inputs, training=False)
    assert not calls
    block(inputs, training=True)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="remat"):
        keras_vit.VisionTransformer(**tiny_config, remat="yes")


@pytest.mark.parametrize(
    "model_name, image_size, timm_gmacs",
    # timm's model cards: vit_small_patch16_224 4.6, vit_base_patch16_224 17.6,
    # vit_small_patch16_384 15.5 GMACs per image.
    [("S16", 224, 4.6), ("B16", 224, 17.6), ("S16", 384, 15.5)],
)
def test_bench_flops_match_timm_model_cards(model_name, image_size, timm_gmacs):
    bench = load_benchmark_script("bench")
    gmacs = bench.model_flops(model_name, image_size) / 2 / 1e9
    assert gmacs == pytest.approx(timm_gmacs, rel=0.02)


def test_profile_step_groups_operations_by_kind():
    profile = load_benchmark_script("profile_step")
    kind = profile.operation_kind
    assert kind("vision_transformer/block_0/mlp/fc1/MatMul:_MklNativeFusedMatMul") == (
        "_MklNativeFusedMatMul"
    )
    assert kind("MatMul.406") == "MatMul"
    assert kind("add_multiply_fusion.12") == "add_multiply_fusion"
    assert kind("wrapped_reduce-window") == "wrapped_reduce-window"
    assert kind("ThunkExecutor::Execute") == "ThunkExecutor::Execute"
    assert profile.is_product("_MklNativeFusedMatMul") and profile.is_product("dot")
    assert profile.is_product("_MklBatchMatMulV2") and not profile.is_product("ynn_fusion")
    assert profile.is_product("_FusedMatMul")  # graph mode without oneDNN (Eigen)
    assert profile.category("ynn_fusion").startswith("YNNPACK")
    assert not profile.is_product("add_multiply_fusion") and not profile.is_product("_MklSoftmax")
    events = [
        ("tf_Compute/1", "a/MatMul:_MklMatMul", 4e9),  # 4 ms
        ("tf_Compute/2", "b/MatMul:_MklMatMul", 2e9),
        ("tf_Compute/2", "c/Mul:Mul", 1e9),
        ("tf_Compute/2", "Process", 9e9),  # wraps the others
        ("tf_Eigen/1", "ThunkExecutor::Execute", 9e9),
        ("tf_Eigen/1", "end: MatMul.3", 1e9),
        ("python", "__inference_step", 9e9),
        # The Python tracer's events, on any thread (JAX's profiler traces Python by default)
        ("Thread-2 (_return_loop)", "$_memory.py:147 _sleep_a_period", 9e9),
        ("tf_Compute/1", "$time sleep", 9e9),
    ]
    milliseconds, counts = profile.aggregate(events, steps=2)
    assert dict(milliseconds) == {"_MklMatMul": 3.0, "Mul": 0.5}
    assert dict(counts) == {"_MklMatMul": 1.0, "Mul": 0.5}
    text = profile.report(milliseconds, counts, top=5)
    assert text.splitlines()[-1] == (
        "matrix products: 3.0 ms/step (86%); everything else: 0.5 ms/step (14%)"
    )


def test_profile_step_runs_and_finds_the_matrix_products(capsys):
    profile = load_benchmark_script("profile_step")
    args = ["--model", "Ti16", "--image-size", "32", "--batch-size", "2", "--mode", "infer"]
    assert profile.main(args + ["--jit", "0", "--steps", "2", "--top", "40"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("operation"))
    kinds = [line.split()[0] for line in lines[header + 1 : -1]]
    assert kinds and any(profile.is_product(kind) for kind in kinds), lines
    products_ms = float(lines[-1].split("matrix products: ")[1].split(" ms/step")[0])
    assert products_ms > 0
    with pytest.raises(SystemExit):
        profile.main(["--image-size", "30"])
    with pytest.raises(SystemExit):
        profile.main(["--steps", "0"])


def test_bench_targets_rate_every_keras_vit_variant_against_the_fastest_peer():
    bench = load_benchmark_script("bench")

    def entry(infer_lead, train_lead, rss):
        return {"keras_vit_lead": {"infer": infer_lead, "train": train_lead}, "peak_rss_gb": rss}

    # keras_vit / timm = 0.95 (inference); keras_vit / streams = 0.8, so
    # streams / timm = 0.95 / 0.8 = 1.1875; keras_hub is slower than timm.
    table = {
        "keras_vit": {"keras_vit_lead": {}, "peak_rss_gb": 2.0},
        "keras_vit[streams]": entry(0.8, 1.0, 2.1),
        "keras_hub": entry(1.3, 1.2, 2.5),
        "timm": dict(entry(0.95, 0.9, 1.5), infer_fraction_of_limit=0.8),
        "vit_keras": {"skipped": "not installed"},
    }
    checks = bench.targets({"contenders": table})
    # What 1.10x timm asks of the hardware: 1.10 x timm's 80% of the limit.
    assert checks["infer"]["target_fraction_of_limit"] == pytest.approx(0.88)
    assert checks["train"]["target_fraction_of_limit"] is None  # timm's share unknown
    assert checks["infer"]["fastest_peer"] == "timm" and not checks["infer"]["holds"]
    assert checks["infer keras_vit[streams]"]["lead_over_fastest_peer"] == pytest.approx(1.1875)
    assert checks["infer keras_vit[streams]"]["holds"]
    assert checks["train keras_vit[streams]"]["lead_over_fastest_peer"] == pytest.approx(0.9)
    assert not checks["train keras_vit[streams]"]["holds"]
    assert checks["memory keras_vit"]["holds"] is False

    # The Markdown report says what each speed target asks of the hardware.
    for row in table.values():
        if not row.get("skipped"):
            row.update(infer_images_per_s=10.0, train_images_per_s=3.0, rounds=3)
    result = {
        "config": "S16-224",
        "gemm_gflops_per_s": 180.0,
        "gflops_per_image_forward": 9.2,
        "limit_infer_images_per_s": 19.6,
        "limit_train_images_per_s": 6.5,
        "contenders": table,
        "targets": checks,
    }
    report = {
        "results": [result],
        "batch_size": 8,
        "dtype": "float32",
        "gemm_dtype": "float32",
        "date": "today",
        "machine": "here",
        "command": "bench",
    }
    lines = bench.markdown(report).splitlines()
    infer_line = next(line for line in lines if line.startswith("- infer: keras_vit "))
    assert "target 1.10x (88% of the machine's limit): MISSED" in infer_line
    train_line = next(line for line in lines if line.startswith("- train: keras_vit "))
    assert "target 1.20x: MISSED" in train_line
    assert "CPU multiply-add peak: not measured (not run)." in lines

    # With the CPU's multiply-add peak measured, the limit and each target are also
    # given as shares of it: 180 / 240 = 75%, 0.88 x 180 / 240 = 66%.
    report["multiply_add_peak"] = {"gflops_per_s": 240.0, "threads": 2}
    lines = bench.markdown(report).splitlines()
    assert any(
        line.startswith(
            "Machine limit: 180 GFLOP/s float32 GEMM (75% of the CPU's multiply-add peak) x 9.2"
        )
        for line in lines
    ), lines
    infer_line = next(line for line in lines if line.startswith("- infer: keras_vit "))
    assert "(88% of the machine's limit, 66% of the CPU's multiply-add peak): MISSED" in infer_line
    assert any(
        line.startswith("CPU multiply-add peak: 240 GFLOP/s float32 on 2 cores") for line in lines
    )
    # A bfloat16 run's limit is not compared with the float32 peak.
    report["gemm_dtype"] = "bfloat16"
    assert "multiply-add peak)" not in bench.markdown(report)


def test_bench_measures_the_multiply_add_peak_on_all_cores_or_says_why_not(monkeypatch):
    import shutil

    bench = load_benchmark_script("bench")
    assert bench.measure_peak("mixed_bfloat16") == {"skipped": "measured for float32 runs only"}
    if shutil.which("cc") or shutil.which("gcc"):
        measured = bench.measure_peak("float32")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        assert measured["threads"] == cores and measured["gflops_per_s"] > 0, measured
    monkeypatch.setenv("CC", os.path.join(ROOT, "no-such-compiler"))
    skipped = bench.measure_peak("float32")["skipped"]
    assert "no-such-compiler" in skipped and "\n" not in skipped, skipped

    # A binary that builds but fails to run is reported, not raised: the bench goes on.
    def fails(**_):
        raise RuntimeError("benchmarks/peak.c failed (132): Illegal instruction")

    monkeypatch.setattr(bench.peak, "measure", fails)
    assert bench.measure_peak("float32") == {
        "skipped": "benchmarks/peak.c failed (132): Illegal instruction"
    }


def test_plot_draws_each_contenders_medians_and_refuses_what_is_not_a_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = load_benchmark_script("plot")

    def entry(infer, train, rss):
        return {
            "skipped": None,
            "infer_images_per_s": 20 * infer,
            "train_images_per_s": 6 * train,
            "infer_fraction_of_limit": infer,
            "train_fraction_of_limit": train,
            "peak_rss_gb": rss,
        }

    report = {
        "results": [
            {
                "config": "S16-224",
                "contenders": {
                    "keras_vit": entry(0.9, 0.8, 2.0),
                    "timm": entry(0.7, 0.6, 1.5),
                    "vit_keras": {"skipped": "not installed"},
                },
            },
            {
                "config": "B16-224",
                "contenders": {
                    "keras_vit": entry(1.0, 0.95, 3.2),
                    "timm": entry(0.8, 0.7, 2.8),
                    "vit_keras": entry(0.75, 0.65, 4.25),
                },
            },
        ],
        "batch_size": 8,
        "dtype": "float32",
        "date": "today",
        "machine": "here",
    }

    def bars(axis):  # (model, contender's slot) -> height; 3 slots in a model's 0.8
        found = {}
        for patch in axis.patches:
            centre = patch.get_x() + patch.get_width() / 2
            model = round(centre)
            slot = round((centre - model + 0.4) / (0.8 / 3) - 0.5)
            found[model, slot] = round(float(patch.get_height()), 6)
        return found

    figure = plot.figure_of(report)
    inference, training, memory = figure.axes
    # Slots in bench.py's order (vit_keras, skipped at S/16, still gets the third);
    # speed as a percentage of the machine's limit, memory in GB.
    assert bars(inference) == {(0, 0): 90, (0, 1): 70, (1, 0): 100, (1, 1): 80, (1, 2): 75}
    assert bars(training) == {(0, 0): 80, (0, 1): 60, (1, 0): 95, (1, 1): 70, (1, 2): 65}
    assert bars(memory) == {(0, 0): 2.0, (0, 1): 1.5, (1, 0): 3.2, (1, 1): 2.8, (1, 2): 4.25}
    assert inference.get_ylabel() == "% of the machine's limit"
    assert [t.get_text() for t in inference.get_xticklabels()] == ["ViT-S/16 224", "ViT-B/16 224"]
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend == ["keras_vit", "timm", "vit-keras"]
    assert not inference.collections  # no multiply-add peak in the report: no segments

    # With the CPU's multiply-add peak (240 GFLOP/s) and each model's GEMM limit (200,
    # 180 GFLOP/s), a dotted segment over each model's bars at 120% and 133%.
    report["multiply_add_peak"] = {"gflops_per_s": 240.0, "threads": 2}
    report["results"][0]["gemm_gflops_per_s"] = 200.0
    report["results"][1]["gemm_gflops_per_s"] = 180.0
    for axis in plot.figure_of(report).axes[:2]:
        segments = [segment for lines in axis.collections for segment in lines.get_segments()]
        assert [
            [tuple(round(float(v), 2) for v in point) for point in segment] for segment in segments
        ] == [[(-0.45, 120.0), (0.45, 120.0)], [(0.55, 133.33), (1.45, 133.33)]]
        assert "CPU multiply-add peak" in [text.get_text() for text in axis.texts]
        assert axis.get_ylim()[1] > 133.33
    del report["multiply_add_peak"]

    # A run without the GEMM probe has no shares: images/s instead.
    del report["results"][1]["contenders"]["timm"]["train_fraction_of_limit"]
    del report["results"][1]["contenders"]["timm"]["infer_fraction_of_limit"]
    inference, training, _ = plot.figure_of(report).axes
    assert training.get_ylabel() == "images/s"
    assert bars(training)[(1, 1)] == pytest.approx(6 * 0.7)

    source = tmp_path / "run.json"
    source.write_text(json.dumps(report))
    output = tmp_path / "charts" / "run.png"
    plot.main([str(source), "--output", str(output)])
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with pytest.raises(SystemExit, match="no such file"):
        plot.main([str(tmp_path / "missing.json")])
    (tmp_path / "other.json").write_text(json.dumps({"rounds": 5}))
    with pytest.raises(SystemExit, match="not a bench.py report"):
        plot.main([str(tmp_path / "other.json")])
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SystemExit, match="cannot read .* as JSON"):
        plot.main([str(tmp_path / "broken.json")])
    with pytest.raises(SystemExit) as exit_info:
        plot.main([str(source), "--output", str(tmp_path / "run.txt")])
    assert exit_info.value.code == 2
    assert "--output must end in .png, .svg or .pdf" in capsys.readouterr().err


JAX_DATA_PARALLEL_SCRIPT = """
import contextlib, json
import jax, keras, numpy as np
import keras_vit
from keras_vit.layers import attention

calls = []
per_head = attention._attention_core_per_head
attention._attention_core_per_head = lambda *a: calls.append(1) or per_head(*a)
attention.PER_HEAD_MIN_TOKENS = 2
keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
rng = np.random.default_rng(0)
x = rng.uniform(-1, 1, (16, 32, 32, 3)).astype("float32")
y = rng.integers(0, 10, 16)
out = {"devices": len(jax.devices())}
for name in ("batched", "per_head"):
    keras.utils.set_random_seed(1)
    model = keras_vit.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=10,
    )
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    before = len(calls)
    with attention.batched_core_only() if name == "batched" else contextlib.nullcontext():
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        logits = model.predict(x, batch_size=8, verbose=0)
    out[name] = {
        "loss": history.history["loss"], "logits": logits.tolist(), "calls": len(calls) - before,
    }
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_jax_per_head_core_trains_data_parallel_over_two_cpu_devices():
    # The per-pair core under keras.distribution.DataParallel: its lax.map runs
    # over a batch sharded across 2 CPU devices, and fit must train as the
    # batched core does. A process of its own: the device count is set before
    # JAX starts.
    out = json_of_script(
        JAX_DATA_PARALLEL_SCRIPT,
        KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    assert out["devices"] == 2
    assert out["batched"]["calls"] == 0 and out["per_head"]["calls"] > 0
    np.testing.assert_allclose(out["per_head"]["loss"], out["batched"]["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        out["per_head"]["logits"], out["batched"]["logits"], rtol=1e-4, atol=1e-5
    )


SEED_WITHOUT_TENSORFLOW_SCRIPT = """
import json, sys
import keras, numpy as np
sys.path.insert(0, sys.argv[1])
import runner
runner.seed_keras(7)
first = (keras.ops.convert_to_numpy(keras.random.normal((4,))).tolist(), np.random.rand())
runner.seed_keras(7)
again = (keras.ops.convert_to_numpy(keras.random.normal((4,))).tolist(), np.random.rand())
runner.seed_keras(8)
other = keras.ops.convert_to_numpy(keras.random.normal((4,))).tolist()
print(json.dumps(dict(first=first, again=again, other=other, tf="tensorflow" in sys.modules)))
"""


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_bench_runner_seeds_jax_without_loading_tensorflow():
    # keras.utils.set_random_seed imports TensorFlow on any backend where it is
    # installed; the runner's JAX contender must seed Keras and NumPy all the
    # same, and hold no TensorFlow, up to its measured training step.
    bench = os.path.join(ROOT, "benchmarks")
    out = json_of_script(SEED_WITHOUT_TENSORFLOW_SCRIPT, bench, KERAS_BACKEND="jax")
    assert out["tf"] is False
    assert out["first"] == out["again"] and out["other"] != out["first"][0]
    run = subprocess.run(
        [sys.executable, os.path.join(bench, "runner.py"), "--contender", "keras_vit"]
        + ["--model", "Ti16", "--image-size", "32", "--warmup", "1", "--option", "jit=1"],
        input="train 0\nquit\n",
        env=dict(os.environ, KERAS_BACKEND="jax"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert lines[0]["ready"] and "(jax)" in lines[0]["description"]
    assert lines[0]["tensorflow_loaded"] is False
    assert lines[1]["kind"] == "train" and lines[-1]["done"]


def _gpu_script(tmp_path, **env):
    env = dict(os.environ, CPU_CHECK="1", OUT=str(tmp_path), PYTHON=sys.executable, **env)
    env.pop("KERAS_BACKEND", None)  # the script's default, JAX
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmarks", "gpu.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "gpu.json") as handle:
        return done, json.load(handle)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_gpu_script_runs_end_to_end_in_its_cpu_check(tmp_path):
    """benchmarks/gpu.sh with CPU_CHECK=1: tiny sizes on the CPU, every stage of the script.

    No GPU is needed; this keeps the script working for the sessions that get one.
    timm is timed where torch and timm are installed and reported as failed otherwise.
    """
    done, report = _gpu_script(tmp_path)
    assert report["cpu_check"] and report["model"] == "ViT-B/16" and report["layers"] == 2
    rows = {row["contender"]: row for row in report["results"]}
    names = ("jit step", "train_on_batch", "jit step, hand-written attention")
    for name in (f"keras_vit ({variant})" for variant in names):
        assert rows[name]["backend"] == "jax" and rows[name]["images_per_s"] > 0, rows
        # Random labels over 1000 classes: about ln(1000) = 6.9 after a few steps.
        assert 1.0 < rows[name]["loss"] < 12.0, rows[name]
        # On a CPU the hand-written core runs; on JAX with a GPU, dot_product_attention.
        assert rows[name]["attention"] == "keras_vit's hand-written core", rows[name]
    timm_rows = [row for name, row in rows.items() if name.startswith("timm")]
    assert len(timm_rows) == 1
    assert timm_rows[0]["images_per_s"] or timm_rows[0]["error"], timm_rows
    assert "| keras_vit (jit step) |" in done.stdout


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_gpu_script_keeps_the_other_rows_when_the_fused_attention_fails(tmp_path):
    # As on a GPU, the default path is the fused attention, and here it raises: its rows
    # fail, and the hand-written attention's row, timed first, keeps its figure.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('KERAS_BACKEND') == 'jax':\n"
        "    import keras\n"
        "    from keras_vit.layers import attention\n"
        "    def broken(*args):\n"
        "        raise RuntimeError('fused attention broke')\n"
        "    attention._fuses_attention = lambda: (\n"
        "        keras.config.is_flash_attention_enabled() is not False)\n"
        "    attention._fused_attention = broken\n"
    )
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    done, report = _gpu_script(tmp_path, PYTHONPATH=path)
    rows = {row["contender"]: row for row in report["results"]}
    kept = rows["keras_vit (jit step, hand-written attention)"]
    assert kept["images_per_s"] > 0 and kept["attention"] == "keras_vit's hand-written core"
    for name in ("keras_vit (jit step)", "keras_vit (train_on_batch)"):
        assert rows[name]["images_per_s"] is None, rows[name]
        (error,) = rows[name]["error"]
        assert error.startswith("RuntimeError: ") and "fused attention broke" in error, error
        assert "\n" not in error and "\x1b" not in error  # one plain line, for the table
        assert rows[name]["attention"].startswith("keras.ops.dot_product_attention")
    assert "| keras_vit (jit step) | failed: RuntimeError: " in done.stdout


def test_gpu_script_reports_a_contender_over_its_time_limit(tmp_path):
    done, report = _gpu_script(tmp_path, PART_TIMEOUT="1")
    assert [row["contender"] for row in report["results"]] == ["keras_vit", "timm"]
    for row in report["results"]:
        assert row["images_per_s"] is None
        assert row["error"] == ["no output: killed, or over PART_TIMEOUT (1 s)"], row
    assert "| keras_vit | failed: no output" in done.stdout


def test_bench_refuses_an_unknown_contender_and_knows_the_malloc_one(capsys):
    bench = load_benchmark_script("bench")
    with pytest.raises(SystemExit):
        bench.parse_args(["--contenders", "keras_vit,nope"])
    error = capsys.readouterr().err
    assert "--contenders" in error and "Received: 'nope'" in error
    assert "keras_vit[malloc]" in error  # listed among the names it takes
    assert bench.parse_args(["--contenders", "keras_vit,keras_vit[malloc]"])
    _, env, _ = bench.CONTENDERS["keras_vit[malloc]"]
    assert env["TF_CPU_ALLOCATOR_USE_BFC"] == "false"


def test_bench_dtype_reaches_the_contenders_and_the_limit(capsys):
    bench = load_benchmark_script("bench")
    assert bench.parse_args([]).dtype == "float32"
    assert bench.parse_args(["--dtype", "mixed_bfloat16"]).dtype == "mixed_bfloat16"
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtype", "float16"])
    assert "--dtype" in capsys.readouterr().err
    runner = load_benchmark_script("runner")
    # A small product: bfloat16 is emulated, and slow, on CPUs without bfloat16 instructions.
    gemm = runner.GemmContender(None, 224, 8, {"dtype": "mixed_bfloat16", "gemm_size": "256"})
    names = [name for name, _ in gemm.candidates]
    assert "bfloat16" in gemm.description and "tensorflow" in names and "numpy" not in names
    assert gemm.description.startswith("256x256 ")
    with pytest.raises(ValueError, match="gemm_size"):
        runner.GemmContender(None, 224, 8, {"gemm_size": "0"})
    assert all(gflops > 0 for gflops in gemm.gemm(0.2).values())


@pytest.mark.tensorflow_only
@pytest.mark.parametrize("graph_predicts", [True, False])
def test_runner_compiles_keras_vit_with_compile_models_plan(monkeypatch, graph_predicts):
    """The bench's keras_vit contender runs as keras_vit.training.compile_fast plans it."""
    from keras_vit import _cpu

    monkeypatch.setattr(_cpu, "graph_mode_predicts_faster", lambda: graph_predicts)
    runner = load_benchmark_script("runner")
    arch = (16, 32, 64, 2, 2)  # patch, width, MLP width, heads, blocks
    contender = runner.KerasContender(runner.build_keras_vit, arch, 32, 2, {})
    model = contender.model
    # XLA inference runs each batch as XLA programs on its parts (halves, or
    # more for batches of more than 3200 tokens), two at once.
    inference = (
        "graph-mode inference"
        if graph_predicts
        else "XLA inference, inference in 2 parts or more, of at most 1600 tokens"
    )
    assert f"float32, XLA training, {inference}, pooled CPU memory" in contender.description
    assert model.jit_compile is True and model.optimizer.built
    # Both replace the model's predict-function maker (a graph-mode function
    # that calls the halves' XLA programs), and keep the train step's.
    assert "make_predict_function" in vars(model)
    assert ("predict_step" in vars(model)) is not graph_predicts
    assert "make_train_function" not in vars(model) and "train_step" not in vars(model)
    slots = [id(v) for v in model.optimizer.variables]
    assert contender.infer().shape == (2, runner.NUM_CLASSES)
    assert np.isfinite(contender.train())
    assert [id(v) for v in model.optimizer.variables] == slots  # built once, not twice
    plain = runner.KerasContender(runner.build_keras_vit, arch, 32, 2, {"jit": "0", "remat": "1"})
    assert "graph-mode training, graph-mode inference" in plain.description
    assert plain.description.endswith("remat of every block")
    assert plain.model.jit_compile is False
    whole = runner.KerasContender(runner.build_keras_vit, arch, 32, 2, {"streams": "1"})
    assert "inference in 2 parts" not in whole.description
    assert "predict_step" not in vars(whole.model)


def test_dynamic_size_benchmark_refuses_bad_arguments(capsys):
    script = load_benchmark_script("dynamic_size")
    for argv in (["--rounds", "0"], ["--image-size", "64"]):
        with pytest.raises(SystemExit):
            script.main(argv)
        assert "--rounds must be positive and --image-size at least 80" in capsys.readouterr().err


def test_peak_benchmark_reports_each_thread_count_or_says_why_it_cannot(capsys, monkeypatch):
    """micro.py peak builds benchmarks/peak.c and prints its multiply-add peak on 1 to
    all cores; with no working compiler it says so instead of failing."""
    import re
    import shutil

    micro = load_benchmark_script("micro")
    if shutil.which("cc") or shutil.which("gcc"):
        assert micro.main(["peak"]) == 0
        out = capsys.readouterr().out
        rows = re.findall(r"threads (\d+): ([\d.]+) GFLOP/s", out)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        assert [int(threads) for threads, _ in rows] == list(range(1, cores + 1)), out
        assert all(float(gflops) > 0 for _, gflops in rows), out
    monkeypatch.setenv("CC", os.path.join(ROOT, "no-such-compiler"))
    assert micro.main(["peak"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("peak: skipped") and "no-such-compiler" in out, out


def test_grads_benchmark_times_each_dense_product_of_a_training_step(capsys, monkeypatch):
    """micro.py grads prints, for each of a block's four Dense layers, the forward,
    input-gradient and weight-gradient products under XLA, in OpenBLAS called from
    XLA (where a C++ compiler builds it) and in NumPy, and their sums."""
    import re
    import shutil

    micro = load_benchmark_script("micro")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert micro.main(["grads", "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "XLA_FLAGS=--xla_cpu_enable_fast_math=false" in out, out
    built = bool(shutil.which("c++") or shutil.which("g++"))
    libraries = ["XLA", "OpenBLAS in XLA", "NumPy"] if built else ["XLA", "NumPy"]
    assert out.startswith(
        f"grads: GFLOP/s of each Dense layer's training products, 40 rows, "
        f"{' / '.join(libraries)}\n"
    ), out
    rows = re.findall(r"(\w+) \(m, k, n\) = \((\d+), (\d+), (\d+)\): (.*)", out)
    assert [(layer, int(m), int(k), int(n)) for layer, m, k, n, _ in rows] == [
        ("qkv", 40, 384, 1152),
        ("proj", 40, 384, 384),
        ("fc1", 40, 384, 1536),
        ("fc2", 40, 1536, 384),
    ], out
    rate = " / ".join([r"(\d+)"] * len(libraries))
    for *_, figures in rows:
        found = re.findall(rf"(forward|input gradient|weight gradient) {rate}(?:,|$)", figures)
        assert [name for name, *_ in found] == ["forward", "input gradient", "weight gradient"]
        assert all(int(value) > 0 for _, *values in found for value in values), figures
    for line in ("all twelve, one call each", "all twelve in one XLA program"):
        totals = re.search(rf"{line}: (.*)", out).group(1)
        sums = re.findall(r"([A-Za-z ]+?) ([\d.]+) ms", totals)
        expected = libraries if "one call" in line else libraries[:-1]
        assert [name.strip(", ") for name, _ in sums] == expected, totals
        assert all(float(ms) > 0 for _, ms in sums), totals
    if built:  # the custom call computes NumPy's products (the same OpenBLAS)
        error = re.search(r"OpenBLAS in XLA against NumPy: largest difference (\S+)", out)
        assert error and float(error.group(1)) < 1e-3, out


def test_openblas_custom_call_says_why_it_cannot_be_built(monkeypatch):
    """benchmarks/xla_blas.py returns the reason instead of failing without a compiler."""
    xla_blas = load_benchmark_script("xla_blas")
    monkeypatch.setenv("CXX", os.path.join(ROOT, "no-such-compiler"))
    matmul, why = xla_blas.build(2)
    assert matmul is None and "no-such-compiler" in why and "failed" in why, why
