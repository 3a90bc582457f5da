"""Two `keras-vit train` processes on one --output: the second is refused while the
first lives (its run folder is locked), and is let in once the first has died."""

import argparse
import contextlib
import io
import os
import signal
import subprocess
import sys
import time

import pytest

from keras_vit.cli import UsageError, main
from keras_vit.commands import train as train_command

pytestmark = pytest.mark.tensorflow_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "vit-test", "--image-size", "16", "--batch-size", "16", "--quiet"]


def _main(*argv):
    """(exit code, stderr) of `keras-vit ARGV` run in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


def test_run_being_written_by_a_live_process_is_refused_until_it_dies(npz, tmp_path):
    out = str(tmp_path / "run")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT)
    env.pop("KERAS_VIT_KILL_AT_STEP", None)
    first = subprocess.Popen(
        [sys.executable, "-m", "keras_vit", "train", "--data", npz, *TINY, "--epochs", "500",
         "--output", out],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not os.path.exists(os.path.join(out, "backup")):  # training has begun
            assert first.poll() is None, first.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the first run did not start training"
            time.sleep(0.5)
        with open(os.path.join(out, "run.json"), encoding="utf-8") as file:
            record = file.read()
        for flag in ("--resume", "--overwrite"):
            code, err = _main("train", "--data", npz, *TINY, "--epochs", "500", "--output", out,
                              flag)  # fmt: skip
            assert code == 2, err
            assert f"another keras-vit train (process {first.pid} on " in err, err
            assert "is writing" in err and "--output" in err
        with open(os.path.join(out, "run.json"), encoding="utf-8") as file:
            assert file.read() == record  # the first run's record, not overwritten
        assert first.poll() is None  # and the first run trains on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # Killed, it holds nothing: the run resumes (and here is cut short by a usage check
    # that comes after the lock, so the test need not train 500 epochs).
    assert os.path.exists(os.path.join(out, train_command.LOCK_FILE))  # left by the kill
    code, err = _main("train", "--output", out, "--resume", "--epochs", "7")
    assert code == 2 and "options that differ" in err, err
    assert not os.path.exists(os.path.join(out, train_command.LOCK_FILE))


def _args(output, default=False):
    args = argparse.Namespace(output=output)
    if default:
        args._default_output = True
    return args


def test_folder_made_and_written_by_another_process_meanwhile_is_refused(tmp_path):
    out = str(tmp_path / "run")
    os.mkdir(out)  # planned as new; another run made it since, and holds it
    other = train_command.OutputLock()
    other.acquire(out)
    try:
        with pytest.raises(UsageError, match=r"another keras-vit train \(process \d+ on "):
            train_command._make_output(_args(out), train_command.OutputLock())
    finally:
        other.release()
    (tmp_path / "run" / "worker-1").mkdir()  # this run's second worker writes there
    lock = train_command.OutputLock()
    train_command._make_output(_args(out), lock)
    lock.release()
    (tmp_path / "run" / "run.json").write_text("{}")  # ended, and left its files
    lock = train_command.OutputLock()
    with pytest.raises(UsageError, match="made and written by another process"):
        train_command._make_output(_args(out), lock)
    lock.release()
    assert sorted(os.listdir(out)) == ["run.json", "worker-1"]


def test_default_output_moves_on_to_a_free_name(tmp_path, monkeypatch):
    """Runs started in the same second without --output each get a folder of their own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_command.time, "strftime", lambda _: "vit-20261206-120000")
    os.makedirs("runs/vit-20261206-120000")
    assert train_command._default_output() == os.path.join("runs", "vit-20261206-120000-2")
    args = _args(train_command._default_output(), default=True)
    os.makedirs(args.output)  # taken by another run between the plan and the commit
    lock = train_command.OutputLock()
    try:
        train_command._make_output(args, lock)
        assert args.output == os.path.join("runs", "vit-20261206-120000-3")
        assert lock.held and os.listdir(args.output) == [train_command.LOCK_FILE]
    finally:
        lock.release()
    assert os.listdir(args.output) == []
    given = _args(os.path.join("runs", "vit-20261206-120000"))  # given: used, being empty
    train_command._make_output(given, lock)
    assert given.output == os.path.join("runs", "vit-20261206-120000")
    lock.release()


def test_two_runs_without_output_started_in_one_second_get_a_folder_each(tmp_path, monkeypatch):
    """Both planned runs/vit-<second>; the second to get ready moves on to -2."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_command.time, "strftime", lambda _: "vit-20261206-120000")
    first, second = (
        argparse.Namespace(output=None, resume=False, overwrite=False,
                           **{name: None for name in train_command.STORED})
        for _ in range(2)
    )  # fmt: skip
    plans = [train_command._plan_output(args, set()) for args in (first, second)]
    assert plans == ["new", "new"] and first.output == second.output
    locks = [train_command.OutputLock(), train_command.OutputLock()]
    try:
        for args, plan, lock in zip((first, second), plans, locks):
            train_command._commit_output(args, plan, lock, existed=False)
        assert first.output == os.path.join("runs", "vit-20261206-120000")
        assert second.output == os.path.join("runs", "vit-20261206-120000-2")
        assert all(lock.held for lock in locks)
        assert all(os.path.isfile(os.path.join(a.output, "run.json")) for a in (first, second))
    finally:
        for lock in locks:
            lock.release()


def test_refused_plan_leaves_a_folder_as_it_was(npz, tmp_path):
    """The lock is taken before the plan, in a folder that may not be a run's."""
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    for flag in ((), ("--overwrite",), ("--resume",)):
        code, err = _main("train", "--data", npz, *TINY, "--output", str(folder), *flag)
        assert code == 2 and "--" in err, err
        assert os.listdir(folder) == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / train_command.LOCK_FILE).write_text("process 1 on a killed run\n")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an npz file")  # refused once the lock is taken, by the data loader
    code, err = _main("train", "--data", str(bad), *TINY, "--output", str(empty))
    assert code == 2 and "bad.npz" in err, err
    assert os.listdir(empty) == []  # a stale lock file is not a file of the user's
