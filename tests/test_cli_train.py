"""`keras-vit train / evaluate / predict` end to end, in subprocesses."""

import json
import os
import re
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

pytestmark = pytest.mark.tensorflow_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "vit-test", "--image-size", "16", "--batch-size", "16", "--quiet"]


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    env.update(TF_DETERMINISTIC_OPS="1", TF_ENABLE_ONEDNN_OPTS="0", PYTHONPATH=ROOT)
    env.pop("KERAS_VIT_KILL_AT_STEP", None)
    env.update(extra)
    return env


def _python(*args, timeout=240, **env):
    """`python ARGS` in a fresh process, from the repository root."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(**env),
        cwd=ROOT,
    )


def _cli(*args, timeout=240, **env):
    return _python("-m", "keras_vit", *args, timeout=timeout, **env)


BAD_ARGUMENTS = [
    (["--epochs", "0"], "--epochs"),
    (["--strategy", "horovod"], "--strategy"),
    (["--model", "ViT_Q99"], "--model"),
    (["--data", "/no/such/folder"], "data="),
    (["--weights", "/no/such.npz"], "--weights"),
    (["--resume"], "--resume"),
    (["--cpu-streams", "0"], "--cpu-streams"),
    (["--cpu-streams", "999"], "--cpu-streams"),
    (["--cpu-streams", "many"], "--cpu-streams"),
]

# Runs each command line through keras_vit.cli.main (what the `keras-vit`
# entry point calls), capturing its exit code and stderr; an exception that
# escapes main is printed with its traceback.
_BAD_ARGUMENTS_DRIVER = """
import contextlib, io, json, sys, traceback
from keras_vit.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
        except BaseException:
            traceback.print_exc()
            code = "raised"
    results.append([code, stderr.getvalue()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def bad_argument_runs(tmp_path_factory):
    """(exit code, stderr) of every BAD_ARGUMENTS case, in one fresh process.

    One process for all cases: each would otherwise start TensorFlow anew
    (~10 s). Each case has its own output folder.
    """
    folder = tmp_path_factory.mktemp("bad-arguments")
    argvs = [
        ["train", "--output", str(folder / f"out{i}"), *args]
        for i, (args, _) in enumerate(BAD_ARGUMENTS)
    ]
    result = _python("-c", _BAD_ARGUMENTS_DRIVER, json.dumps(argvs))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(BAD_ARGUMENTS)))
def test_bad_arguments_exit_2_without_traceback(bad_argument_runs, case):
    code, stderr = bad_argument_runs[case]
    message = BAD_ARGUMENTS[case][1]
    assert code == 2, stderr
    assert "usage:" in stderr and message in stderr
    assert "Traceback" not in stderr


def test_refuses_non_empty_output(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    result = _cli("train", "--output", str(tmp_path), timeout=120)
    assert result.returncode == 2 and "--overwrite" in result.stderr
    assert (tmp_path / "keep.txt").read_text() == "precious"


def _weights(folder):
    import keras

    import keras_vit  # noqa: F401

    model = keras.models.load_model(os.path.join(folder, "model.keras"))
    return [w.numpy() for w in model.weights]


def _straight_and_killed(tmp_path, command, kill_at):
    """The folders of `command` run to its end and run until SIGKILL after step `kill_at`."""
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    result = _cli(*command, "--output", straight)
    assert result.returncode == 0, result.stderr[-2000:]
    result = _cli(*command, "--output", killed, KERAS_VIT_KILL_AT_STEP=str(kill_at))
    assert result.returncode == -9, result.stderr[-2000:]
    return straight, killed


def _assert_same_weights(folder, other):
    for a, b in zip(_weights(folder), _weights(other), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(npz, tmp_path):
    """6 steps per epoch, 3 epochs; backups every 5 steps; killed after step 11 (epoch 2).

    The resumed run finishes epoch 2 from the step-10 backup (2 steps, too few for
    a step backup), then trains epoch 3: that second part must start from the end
    of epoch 2, not from the step-10 backup again.
    """
    common = ["train", "--data", npz, *TINY, "--epochs", "3", "--backup-steps", "5"]
    straight, killed = _straight_and_killed(tmp_path, common, kill_at=11)
    with open(os.path.join(killed, "backup", "training_metadata.json")) as file:
        assert json.load(file)["epoch"] == 1  # the backup is mid-epoch 2
    assert not os.path.exists(os.path.join(killed, "model.keras"))
    assert os.path.exists(os.path.join(killed, ".keras-vit-train.lock"))  # unlocked by the kill
    refused = _cli(*common, "--output", killed)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    result = _cli("train", "--output", killed, "--resume", "--quiet")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resuming at step 10" in result.stdout
    assert not os.path.exists(os.path.join(killed, ".keras-vit-train.lock"))
    _assert_same_weights(straight, killed)
    with open(os.path.join(killed, "history.json")) as file:
        assert len(json.load(file)["loss"]) == 3


def test_sigkill_after_an_epochs_last_step_then_resume_keeps_every_epochs_row(npz, tmp_path):
    """6 steps per epoch, 2 epochs; backups every 3 steps; killed after step 6, the
    last of epoch 1, before its validation and its row in history.csv.

    A step backup taken there would have resumed at epoch 2: epoch 1 never
    validated, logged or weighed for best.keras. The backup of that step waits for
    the epoch's end, after the row; so the run resumes from the step-3 backup and
    ends epoch 1 again.
    """
    common = ["train", "--data", npz, *TINY, "--epochs", "2", "--backup-steps", "3"]
    straight, killed = _straight_and_killed(tmp_path, common, kill_at=6)
    result = _cli("train", "--output", killed, "--resume", "--quiet")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resuming at step 3" in result.stdout
    _assert_same_weights(straight, killed)
    histories = []
    for folder in (straight, killed):
        with open(os.path.join(folder, "history.json")) as file:
            histories.append(json.load(file))
    assert histories[1]["epoch"] == [0, 1]
    np.testing.assert_allclose(histories[1]["val_loss"], histories[0]["val_loss"], rtol=1e-4)


def test_train_writes_outputs_then_evaluate_and_predict(npz, tmp_path):
    from PIL import Image

    out = str(tmp_path / "run")
    # --remat: the checkpointed blocks also save, export and reload; --cpu-streams:
    # training and evaluation with batches cut in parts (keras_vit.streams).
    streams = str(min(2, len(os.sched_getaffinity(0))))
    result = _cli(
        "train", "--data", npz, *TINY, "--epochs", "1", "--output", out, "--remat",
        "--cpu-streams", streams,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("model.keras", "saved_model", "history.csv", "history.json", "curves.png"):
        assert os.path.exists(os.path.join(out, name)), name
    with open(os.path.join(out, "run.json")) as file:
        stored = json.load(file)["args"]
        assert stored["remat"] is True and stored["cpu_streams"] == int(streams)
    with zipfile.ZipFile(os.path.join(out, "model.keras")) as archive:
        assert '"remat": true' in archive.read("config.json").decode()
    with open(os.path.join(out, "classes.json")) as file:
        assert json.load(file) == ["0", "1", "2"]
    final = re.search(
        r"Final validation accuracy: ([\d.]+) \(loss [\d.]+, with label smoothing 0.1\)",
        result.stdout,
    )
    assert final, result.stdout[-2000:]
    result = _cli("evaluate", "--model", out, "--data", npz)
    assert result.returncode == 0, result.stderr[-2000:]
    # The same held-out images: the same accuracy; the loss is named for what it is.
    scored = re.search(
        r"24 images: loss [\d.]+ \(cross-entropy without label smoothing\), accuracy ([\d.]+)",
        result.stdout,
    )
    assert scored and scored.group(1) == final.group(1), result.stdout[-2000:]
    image = tmp_path / "x.png"
    Image.fromarray(np.full((16, 16, 3), 200, np.uint8)).save(image)
    result = _cli("predict", str(image), "--model", out, "--top-k", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1. " in result.stdout and "2. " in result.stdout and "3. " not in result.stdout


def test_train_cpu_streams_auto_configures_the_recommended_streams(npz, tmp_path):
    """The default --cpu-streams auto trains with the streams recommended_cpu_streams
    gives in the same environment (2 on a 2-core CPU-only machine with oneDNN's
    AVX-512 kernels, 1 elsewhere), and run.json keeps "auto" for --resume."""
    onednn = {"TF_ENABLE_ONEDNN_OPTS": "1"}  # TensorFlow's default where AVX-512 has VNNI
    code = "from keras_vit import streams; print(streams.recommended_cpu_streams())"
    probe = _python("-c", code, **onednn)
    assert probe.returncode == 0, probe.stderr[-2000:]
    expected = int(probe.stdout.split()[-1])
    out = str(tmp_path / "run")
    result = _cli("train", "--data", npz, *TINY, "--epochs", "1", "--output", out, **onednn)
    assert result.returncode == 0, result.stderr[-2000:]
    training_line = next(line for line in result.stdout.splitlines() if line.startswith("Training"))
    assert ("2 CPU streams" in training_line) == (expected == 2), (expected, training_line)
    with open(os.path.join(out, "run.json")) as file:
        assert json.load(file)["args"]["cpu_streams"] == "auto"


def test_evaluate_and_predict_a_model_of_any_image_size(npz, tmp_path, capsys):
    """A model built with dynamic_image_size=True gets data at the size it was built for."""
    from PIL import Image

    import keras_vit
    from keras_vit.cli import main
    from keras_vit.commands.predict import predict_files

    model = keras_vit.VisionTransformer(
        image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
        num_classes=3, dynamic_image_size=True,
    )  # fmt: skip
    assert keras_vit.models.model_image_size(model) == (16, 16)
    path = str(tmp_path / "dynamic.keras")
    model.save(path)
    assert main(["evaluate", "--model", path, "--data", npz]) == 0
    assert "24 images: loss" in capsys.readouterr().out
    image = tmp_path / "wide.png"
    Image.fromarray(np.full((24, 40, 3), 200, np.uint8)).save(image)
    assert main(["predict", str(image), "--model", path, "--top-k", "2"]) == 0
    assert "2. " in capsys.readouterr().out
    # The image was resized to 16 x 16, the size the model was built for.
    expected = np.asarray(model(np.full((1, 16, 16, 3), 200 / 127.5 - 1, "float32")))
    ((_, best),) = predict_files(model, [str(image)], top_k=3)
    probabilities = np.exp(expected[0] - expected[0].max())
    probabilities /= probabilities.sum()
    np.testing.assert_allclose([p for _, p in sorted(best)], probabilities, rtol=1e-4)


@pytest.mark.slow
def test_main_job_digits_reaches_95_percent(tmp_path):
    out = str(tmp_path / "digits")
    start = time.time()
    result = _cli("train", "--output", out, "--quiet", timeout=900)
    elapsed = time.time() - start
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(out, "run.json")) as file:
        accuracy = json.load(file)["val_accuracy"]
    print(f"digits main job: val_accuracy {accuracy:.4f} in {elapsed:.0f} s")
    assert accuracy >= 0.95


def test_only_keras_vit_value_errors_are_usage_errors():
    from keras_vit import cli, training

    with pytest.raises(ValueError) as ours:
        training.build_optimizer("adam", 0.1)
    assert cli.is_user_error(ours.value)
    with pytest.raises(ValueError) as foreign:  # raised inside NumPy: a bug, not a usage error
        np.zeros(2).reshape(3)
    assert not cli.is_user_error(foreign.value)
    assert cli.is_user_error(cli.UsageError("bad"))
    assert not cli.is_user_error(RuntimeError("bad"))
