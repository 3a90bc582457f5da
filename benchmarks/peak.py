"""The CPU's float32 multiply-add peak: benchmarks/peak.c, built with the C compiler and run.

No matrix product can beat this figure, so it puts the GEMM limit that bench.py
measures, and every contender's speed, in proportion to the silicon. Its
compiler helpers also build benchmarks/xla_blas.cc.
"""

import os
import re
import shutil
import subprocess
import tempfile

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak.c")


def cores():
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def find_compiler(variable, *names):
    """The compiler $`variable` names, else the first of `names` on the PATH, or None."""
    return os.environ.get(variable) or next(filter(None, map(shutil.which, names)), None)


def build(command):
    """Runs a compiler `command`: None where it succeeds, else why it failed
    (the command and the last 2000 characters of what the compiler said)."""
    try:
        built = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:  # the compiler's variable names no program
        built = subprocess.CompletedProcess(command, 127, "", str(error))
    if built.returncode == 0:
        return None
    return f"{' '.join(command)} failed:\n{built.stderr.strip()[-2000:]}"


def measure(first=1, last=None, iterations=200_000_000):
    """Builds and runs peak.c on `first` to `last` threads (default: all cores).

    Returns (output lines, {threads: GFLOP/s}), or (None, why) when no C compiler
    (cc, gcc or $CC) builds it. A build that succeeds but a run that fails raises.
    """
    last = cores() if last is None else last
    compiler = find_compiler("CC", "cc", "gcc")
    if compiler is None:
        return None, "no C compiler (cc or gcc, or $CC) to build benchmarks/peak.c"
    with tempfile.TemporaryDirectory() as folder:
        binary = os.path.join(folder, "peak")
        failed = build([compiler, "-O2", "-march=native", "-fopenmp", SOURCE, "-o", binary])
        if failed:
            return None, failed
        command = [binary, str(last), str(iterations), "0", str(first)]
        ran = subprocess.run(command, capture_output=True, text=True)
    if ran.returncode != 0:
        raise RuntimeError(f"benchmarks/peak.c failed ({ran.returncode}): {ran.stderr.strip()}")
    lines = ran.stdout.splitlines()
    figures = {
        int(threads): float(gflops)
        for threads, gflops in re.findall(r"threads (\d+): ([\d.]+) GFLOP/s", ran.stdout)
    }
    return lines, figures
