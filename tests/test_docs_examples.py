"""What the README, docs/ and examples/ show runs as they say, on tiny models."""

import importlib.util
import os

import pytest

import keras_vit

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")
TINY = dict(patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=3)


def example(name):
    """The module examples/NAME.py, imported without running its main()."""
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", os.path.join(EXAMPLES, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "size, dynamic, shown",
    [
        ((32, 48), False, "patch-token grid of the last block: (2, 4, 6, 16)"),
        (32, True, "tokens of the last block: (2, 17, 16)"),
    ],
)
def test_attention_maps_example_takes_non_square_and_dynamic_models(
    tmp_path, capsys, monkeypatch, size, dynamic, shown
):
    # It made square images from the input's height and read the grid as a square:
    # a non-square model was refused, and a dynamic one (input size None) failed.
    model = keras_vit.VisionTransformer(image_size=size, dynamic_image_size=dynamic, **TINY)
    path = str(tmp_path / "model.keras")
    model.save(path)
    output = str(tmp_path / "plots")
    monkeypatch.setattr("sys.argv", ["attention_maps.py", "--model", path, "--output", output])
    example("attention_maps").main()
    assert shown in capsys.readouterr().out
    assert sorted(os.listdir(output)) == [
        "attention_distance.png",
        "position_similarity.png",
        "rollout_0.png",
        "rollout_1.png",
    ]


def test_convert_of_a_preset_offline_says_to_pass_the_file_as_src(tmp_path, monkeypatch, capsys):
    # docs/weights.md: a failed download names the preset and its URL, exit status 2. The
    # advice named the `weights` argument of the Python API, which the command has not.
    import keras

    from keras_vit import cli

    def offline(*args, **kwargs):
        raise Exception("URL fetch failure: [Errno -2] Name or service not known")

    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(keras.utils, "get_file", offline)
    status = cli.main(["convert", "augreg_in21k_ft_in1k_Ti_16", str(tmp_path / "out.keras")])
    error = capsys.readouterr().err
    assert status == 2
    assert "Could not download the preset 'augreg_in21k_ft_in1k_Ti_16' from https://" in error
    assert "give its path instead of the preset name" in error and "`weights`" not in error
    assert not os.path.exists(tmp_path / "out.keras")


def test_multi_worker_example_stops_the_other_worker_when_one_fails():
    # A chief that refuses its --output (an earlier run of the example there) exits with
    # status 2 while the other worker waits for it forever: the example hung.
    import subprocess
    import sys
    import time

    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(2)"])
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.monotonic()
    assert example("multi_worker").wait_all([failing, waiting], poll_seconds=0.05) == 2
    assert waiting.poll() is not None and time.monotonic() - start < 30
