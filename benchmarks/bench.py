"""keras_vit against its peers, side by side on this machine.

    python benchmarks/bench.py                      # the full table (about 40 minutes)
    python benchmarks/bench.py --quick              # ViT-S/16 at 224, 3 short rounds
    python benchmarks/bench.py --models S16-224,B16-224 --rounds 5

Each contender runs in its own process (benchmarks/runner.py): keras_vit on
TensorFlow (and on JAX when jax is installed), keras-hub's ViTBackbone + a
Dense head, vit-keras, timm on PyTorch CPU, plus a GEMM probe that gives the
machine's limit. Everything runs in float32; `--dtype mixed_bfloat16` runs
every contender in bfloat16 mixed precision instead (Keras' dtype policy,
PyTorch's CPU autocast) against a bfloat16 GEMM limit. A contender that is
not installed, or cannot run here, is reported as skipped with the reason.

All live contenders of a group build and warm up first; then rounds are
interleaved (A B C A B C ...): in each round every contender runs inference
for --infer-seconds and training steps (AdamW, softmax cross-entropy) for
--train-seconds, at least one call each. Figures are medians over rounds. On
a shared machine the load changes by the second, so interleaving matters
more than the length of a round.

Memory decides the groups: processes stay alive for the whole group, so the
contenders are split into groups that fit in the free memory (at most
--memory-budget GB). keras_vit (TensorFlow) is in every group, and each
peer's ratio is taken against keras_vit measured in the same rounds.

The limit: the GEMM probe measures float32 (or bfloat16) matmul GFLOP/s (the
fastest of NumPy, TensorFlow and PyTorch, where installed, on 2048x2048 matrices) in
every round; divided by the model's FLOPs per image (forward; training
counts 3x forward) it gives the images/s no implementation can beat, and
each figure is shown as a fraction of it. Before the rounds, benchmarks/peak.c
(built with the C compiler, where there is one) measures the CPU's float32
multiply-add peak on all its cores, which no product can beat; the report
gives the GEMM limit, and what each speed target asks, as shares of it.

Results: a table on stdout, benchmarks/results/bench-<UTC time>.json and .md,
and benchmarks/results/latest.{json,md}.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, HERE)

import peak  # noqa: E402
from runner import ARCHITECTURES, NUM_CLASSES  # noqa: E402

# Display name -> (runner contender, extra environment, runner options).
CONTENDERS = {
    # As keras_vit.training.compile_model compiles by default: XLA for the train
    # step; on a machine without GPU/TPU, predict in graph mode on Intel CPUs
    # with AVX-512 and with XLA elsewhere, each batch then run as XLA programs
    # on its parts, two at once (plan_xla has the long-sequence exceptions).
    "keras_vit": ("keras_vit", {"KERAS_BACKEND": "tensorflow"}, {"jit": "auto"}),
    "keras_vit[xla]": ("keras_vit", {"KERAS_BACKEND": "tensorflow"}, {"jit": "1"}),
    "keras_vit[jax]": ("keras_vit", {"KERAS_BACKEND": "jax"}, {"jit": "1"}),
    # On JAX with gradient checkpointing of every block: the least memory.
    "keras_vit[jax-remat]": ("keras_vit", {"KERAS_BACKEND": "jax"}, {"jit": "1", "remat": "1"}),
    # keras_vit.streams: each batch in two parts run side by side, one per core group
    # (what `keras-vit train --cpu-streams auto` picks on a 2-core CPU with oneDNN's
    # AVX-512 kernels: keras_vit.streams.recommended_cpu_streams).
    "keras_vit[streams]": (
        "keras_vit",
        {"KERAS_BACKEND": "tensorflow"},
        {"jit": "auto", "streams": "2"},
    ),
    # The default with every batch whole (streams=1): XLA inference as one
    # program instead of parts run two at once.
    "keras_vit[whole]": (
        "keras_vit",
        {"KERAS_BACKEND": "tensorflow"},
        {"jit": "auto", "streams": "1"},
    ),
    # Streams whose predict and evaluate parts are XLA programs (training parts
    # run in graph mode either way).
    "keras_vit[streams-xla]": (
        "keras_vit",
        {"KERAS_BACKEND": "tensorflow"},
        {"jit": "1", "streams": "2"},
    ),
    # TensorFlow's default CPU allocator (malloc) instead of the pool that
    # importing keras_vit turns on (keras_vit/_memory.py).
    "keras_vit[malloc]": (
        "keras_vit",
        {"KERAS_BACKEND": "tensorflow", "TF_CPU_ALLOCATOR_USE_BFC": "false"},
        {"jit": "auto"},
    ),
    "keras_vit[no-xla]": ("keras_vit", {"KERAS_BACKEND": "tensorflow"}, {"jit": "0"}),
    # Gradient checkpointing of every block (VisionTransformer(remat=True)).
    "keras_vit[remat]": (
        "keras_vit",
        {"KERAS_BACKEND": "tensorflow"},
        {"jit": "auto", "remat": "1"},
    ),
    "keras_vit[remat-no-xla]": (
        "keras_vit",
        {"KERAS_BACKEND": "tensorflow"},
        {"jit": "0", "remat": "1"},
    ),
    "keras_hub": ("keras_hub", {"KERAS_BACKEND": "tensorflow"}, {}),
    "vit_keras": ("vit_keras", {"KERAS_BACKEND": "tensorflow"}, {}),
    "timm": ("timm", {}, {}),
}
# The default, what `keras-vit train` runs by default on a 2-core CPU whose oneDNN
# runs AVX-512 (streams), the memory option (remat), and the JAX backend (with
# and without remat).
DEFAULT_CONTENDERS = [
    "keras_vit",
    "keras_vit[streams]",
    "keras_vit[remat]",
    "keras_vit[jax]",
    "keras_vit[jax-remat]",
    "keras_hub",
    "vit_keras",
    "timm",
]
REFERENCE = "keras_vit"
PEERS = ("keras_hub", "vit_keras", "timm")
MODELS = {"S16-224": ("S16", 224), "B16-224": ("B16", 224), "S16-384": ("S16", 384)}
# Rough peak RSS (GB) of one training process, to size the groups before measuring.
RSS_ESTIMATE_GB = {"S16-224": 2.8, "B16-224": 4.5, "S16-384": 5.0}
GEMM_RSS_GB = 1.0


def model_flops(model_name, image_size):
    """Forward FLOPs per image (2 per multiply-add) of a ViT with a 1000-class head."""
    patch, dim, mlp, _heads, layers = ARCHITECTURES[model_name]
    patches = (image_size // patch) ** 2
    tokens = patches + 1
    embedding = 2 * patches * (patch * patch * 3) * dim
    per_block = (
        2 * tokens * dim * 3 * dim  # qkv
        + 2 * 2 * tokens * tokens * dim  # q k^T and weights v, all heads
        + 2 * tokens * dim * dim  # output projection
        + 2 * 2 * tokens * dim * mlp  # fc1, fc2
    )
    head = 2 * dim * NUM_CLASSES
    return embedding + layers * per_block + head


class Contender:
    """A runner process speaking the line protocol of runner.py."""

    def __init__(self, name, model_name, image_size, batch_size, warmup, dtype="float32"):
        self.name = name
        runner_name, extra_env, options = CONTENDERS[name] if name != "gemm" else ("gemm", {}, {})
        if dtype != "float32":
            options = {**options, "dtype": dtype}
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **extra_env)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        command = [
            sys.executable,
            os.path.join(HERE, "runner.py"),
            "--contender",
            runner_name,
            "--model",
            model_name,
            "--image-size",
            str(image_size),
            "--batch-size",
            str(batch_size),
            "--warmup",
            str(warmup),
        ]
        for key, value in options.items():
            command += ["--option", f"{key}={value}"]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.info = self._read()
        self.skipped = self.info.get("skipped")
        self.records = {"infer": [], "train": [], "gemm": []}
        self.peak_rss_mb = self.info.get("peak_rss_mb", 0.0)

    def _read(self):
        line = self.process.stdout.readline()
        if not line:
            error = self.process.stderr.read().strip().splitlines()
            reason = error[-1] if error else f"exit code {self.process.wait()}"
            return {"skipped": f"runner died: {reason}"}
        return json.loads(line)

    def ask(self, kind, seconds):
        self.process.stdin.write(f"{kind} {seconds}\n")
        self.process.stdin.flush()
        answer = self._read()
        if "skipped" in answer:
            self.skipped = answer["skipped"]
            return None
        self.peak_rss_mb = max(self.peak_rss_mb, answer.get("peak_rss_mb", 0.0))
        self.records[kind].append(answer)
        return answer

    def close(self):
        if self.process.poll() is None and not self.skipped:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                answer = self._read()
                self.peak_rss_mb = max(self.peak_rss_mb, answer.get("peak_rss_mb", 0.0))
            except (BrokenPipeError, ValueError):
                pass
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def available_memory_gb():
    try:
        import psutil

        return psutil.virtual_memory().available / 2**30
    except ImportError:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    return 8.0


def make_groups(names, config, budget_gb):
    """Split contenders into groups that fit in memory, keras_vit in each one."""
    per_process = RSS_ESTIMATE_GB.get(config, 5.0)
    free = min(budget_gb, available_memory_gb() - 2.0)
    capacity = max(2, int((free - GEMM_RSS_GB) // per_process))
    others = [name for name in names if name != REFERENCE]
    if REFERENCE not in names:
        capacity = max(1, capacity)
        return [others[i : i + capacity] for i in range(0, len(others), capacity)] or [[]]
    size = capacity - 1
    groups = [[REFERENCE] + others[i : i + size] for i in range(0, len(others), size)]
    return groups or [[REFERENCE]]


def log(message):
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[{stamp}] {message}", file=sys.stderr, flush=True)


def run_group(group, model_name, image_size, args):
    contenders = []
    try:
        gemm = Contender("gemm", model_name, image_size, args.batch_size, args.warmup, args.dtype)
        for name in group:
            log(f"  starting {name}")
            contender = Contender(
                name, model_name, image_size, args.batch_size, args.warmup, args.dtype
            )
            if contender.skipped:
                log(f"  {name} skipped: {contender.skipped}")
                contender.close()
            else:
                info = contender.info
                log(
                    f"  {name} ready in {info['setup_s']:.0f} s: {info['description']}, "
                    f"{info['parameters']:,} parameters"
                )
            contenders.append(contender)
        live = [c for c in contenders if not c.skipped]
        for round_index in range(args.rounds):
            gemm.ask("gemm", 1.0)
            summary = []
            for contender in live:
                if contender.skipped:
                    continue
                infer = contender.ask("infer", args.infer_seconds)
                train = contender.ask("train", args.train_seconds) if infer else None
                if train:
                    summary.append(
                        f"{contender.name} {infer['images_per_s']:.1f}/{train['images_per_s']:.2f}"
                    )
            log(f"  round {round_index + 1}/{args.rounds}: " + ", ".join(summary))
        return gemm, contenders
    finally:
        for contender in contenders:
            contender.close()
        if "gemm" in locals():
            gemm.close()


def median(values):
    return statistics.median(values) if values else None


def summarise(config, groups_results, flops):
    """Medians per contender and per-group ratios to keras_vit."""
    gflops = []
    rows = {}
    reference_rounds = {"infer": [], "train": []}
    for gemm, contenders in groups_results:
        for answer in gemm.records["gemm"]:
            gflops.append(max(answer["gflops"].values()))
        by_name = {c.name: c for c in contenders}
        reference = by_name.get(REFERENCE)
        for contender in contenders:
            row = rows.setdefault(
                contender.name,
                {"infer": [], "train": [], "peak_rss_mb": 0.0, "ratio": {}, "skipped": None},
            )
            if contender.skipped and not contender.records["infer"]:
                row["skipped"] = contender.skipped
                continue
            row["description"] = contender.info.get("description")
            row["parameters"] = contender.info.get("parameters")
            for kind in ("infer", "train"):
                values = [a["images_per_s"] for a in contender.records[kind]]
                row[kind] += values
                if contender.name == REFERENCE:
                    reference_rounds[kind] += values
                elif reference is not None and not reference.skipped:
                    mine = median(values)
                    theirs = median([a["images_per_s"] for a in reference.records[kind]])
                    if mine and theirs:
                        row["ratio"][kind] = theirs / mine
            row["peak_rss_mb"] = max(row["peak_rss_mb"], contender.peak_rss_mb)
    limit = median(gflops)
    table = {}
    for name, row in rows.items():
        entry = {"skipped": row["skipped"]}
        if not row["skipped"]:
            entry.update(
                description=row.get("description"),
                parameters=row.get("parameters"),
                rounds=len(row["train"]),
                infer_images_per_s=median(row["infer"]),
                train_images_per_s=median(row["train"]),
                infer_rounds=row["infer"],
                train_rounds=row["train"],
                peak_rss_gb=row["peak_rss_mb"] / 1024.0,
                keras_vit_lead=row["ratio"],
            )
            if limit:
                entry["infer_fraction_of_limit"] = (
                    entry["infer_images_per_s"] * flops / (limit * 1e9)
                )
                entry["train_fraction_of_limit"] = (
                    entry["train_images_per_s"] * 3 * flops / (limit * 1e9)
                )
        table[name] = entry
    return {
        "config": config,
        "gflops_per_image_forward": flops / 1e9,
        "gemm_gflops_per_s": limit,
        "gemm_rounds": gflops,
        "limit_infer_images_per_s": limit * 1e9 / flops if limit else None,
        "limit_train_images_per_s": limit * 1e9 / (3 * flops) if limit else None,
        "contenders": table,
    }


def targets(result):
    """The issue's targets: leads over the fastest peer, memory under the lowest."""
    table = result["contenders"]
    reference = table.get(REFERENCE, {})
    peers = {n: e for n, e in table.items() if n in PEERS and not e.get("skipped")}
    if reference.get("skipped") or not reference or not peers:
        return {}
    out = {}
    variants = [
        n for n, e in table.items() if n.startswith(REFERENCE + "[") and not e.get("skipped")
    ]
    for kind, wanted in (("infer", 1.10), ("train", 1.20)):
        leads = {n: e["keras_vit_lead"].get(kind) for n, e in peers.items()}
        leads = {n: v for n, v in leads.items() if v}
        if not leads:
            continue
        fastest = min(leads, key=leads.get)
        # What the target asks of the hardware: the fastest peer's share of the
        # machine's limit, times the lead wanted. Above 1, no implementation that
        # does the model's FLOPs can meet the target on this machine.
        peer_share = peers[fastest].get(f"{kind}_fraction_of_limit")
        needs = wanted * peer_share if peer_share else None
        out[kind] = {
            "lead_over_fastest_peer": leads[fastest],
            "fastest_peer": fastest,
            "target": wanted,
            "target_fraction_of_limit": needs,
            "holds": leads[fastest] >= wanted,
        }
        # A variant's lead over the fastest peer, through the reference that ran
        # in every group: (ref / peer) / (ref / variant) = variant / peer.
        for name in variants:
            own = table[name]["keras_vit_lead"].get(kind)
            if own:
                lead = leads[fastest] / own
                out[f"{kind} {name}"] = {
                    "lead_over_fastest_peer": lead,
                    "fastest_peer": fastest,
                    "target": wanted,
                    "target_fraction_of_limit": needs,
                    "holds": lead >= wanted,
                }
    lowest = min(peers, key=lambda n: peers[n]["peak_rss_gb"])
    ours = {
        n: e["peak_rss_gb"]
        for n, e in table.items()
        if n.startswith(REFERENCE) and not e.get("skipped")
    }
    for name, value in ours.items():
        out[f"memory {name}"] = {
            "keras_vit_gb": value,
            "lowest_peer": lowest,
            "lowest_peer_gb": peers[lowest]["peak_rss_gb"],
            "holds": value <= peers[lowest]["peak_rss_gb"],
        }
    return out


def fmt(value, spec):
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _share_of_peak(report, gflops):
    """'84% of the CPU's multiply-add peak' for a float32 rate; '' when either is unknown."""
    peak_gflops = report.get("multiply_add_peak", {}).get("gflops_per_s")
    if not peak_gflops or not isinstance(gflops, (int, float)) or report["gemm_dtype"] != "float32":
        return ""
    return f"{gflops / peak_gflops:.0%} of the CPU's multiply-add peak"


def measure_peak(dtype):
    """The CPU's float32 multiply-add peak on all cores, for the report."""
    if dtype != "float32":
        return {"skipped": "measured for float32 runs only"}
    threads = peak.cores()
    try:
        lines, figures = peak.measure(first=threads, last=threads)
    except RuntimeError as error:  # built but failed to run: the bench goes on without it
        lines, figures = None, str(error)
    if lines is None:
        return {"skipped": " ".join(figures.split())[:300]}  # one line for the report
    return {"gflops_per_s": figures[threads], "threads": threads}


def markdown(report):
    lines = []
    for result in report["results"]:
        gemm = result["gemm_gflops_per_s"]
        limit_share = _share_of_peak(report, gemm)
        lines += [
            f"### {result['config']} (batch {report['batch_size']}, {report['dtype']})",
            "",
            f"Machine limit: {fmt(gemm, '.0f')} GFLOP/s "
            f"{report['gemm_dtype']} GEMM{limit_share and f' ({limit_share})'} x "
            f"{result['gflops_per_image_forward']:.1f} GFLOPs/image = "
            f"{fmt(result['limit_infer_images_per_s'], '.1f')} images/s inference, "
            f"{fmt(result['limit_train_images_per_s'], '.2f')} training.",
            "",
            "| contender | inference img/s | keras_vit lead | of limit | training img/s "
            "| keras_vit lead | of limit | peak train RSS GB | rounds |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, entry in result["contenders"].items():
            if entry.get("skipped"):
                lines.append(f"| {name} | skipped: {entry['skipped']} | | | | | | | |")
                continue
            lead = entry["keras_vit_lead"]
            lines.append(
                f"| {name} | {fmt(entry['infer_images_per_s'], '.2f')} "
                f"| {fmt(lead.get('infer'), '.2f') + 'x' if lead.get('infer') else '-'} "
                f"| {fmt(entry.get('infer_fraction_of_limit'), '.0%')} "
                f"| {fmt(entry['train_images_per_s'], '.2f')} "
                f"| {fmt(lead.get('train'), '.2f') + 'x' if lead.get('train') else '-'} "
                f"| {fmt(entry.get('train_fraction_of_limit'), '.0%')} "
                f"| {entry['peak_rss_gb']:.2f} | {entry['rounds']} |"
            )
        checks = result.get("targets", {})
        if checks:
            lines.append("")
            for key, check in checks.items():
                if key.startswith("memory"):
                    continue
                kind, _, name = key.partition(" ")
                needs = check.get("target_fraction_of_limit")
                lines.append(
                    f"- {kind}: {name or REFERENCE} {check['lead_over_fastest_peer']:.2f}x the "
                    f"fastest peer ({check['fastest_peer']}); target {check['target']:.2f}x"
                    + (
                        f" ({needs:.0%} of the machine's limit"
                        # needs is known only where the GEMM limit is
                        + (f", {share}" if (share := _share_of_peak(report, needs * gemm)) else "")
                        + ")"
                        if needs
                        else ""
                    )
                    + f": {'holds' if check['holds'] else 'MISSED'}"
                )
            for key, memory in checks.items():
                if not key.startswith("memory"):
                    continue
                lines.append(
                    f"- peak training RSS: {key.split(' ', 1)[1]} {memory['keras_vit_gb']:.2f} GB, "
                    f"lowest peer {memory['lowest_peer']} {memory['lowest_peer_gb']:.2f} GB: "
                    f"{'holds' if memory['holds'] else 'MISSED'}"
                )
        lines.append("")
    measured = report.get("multiply_add_peak", {})
    lines += [
        "keras_vit lead = keras_vit's median / the contender's median, both measured in the "
        "same interleaved rounds (above 1: keras_vit is faster).",
        "",
        (
            f"CPU multiply-add peak: {measured['gflops_per_s']:.0f} GFLOP/s float32 on "
            f"{measured['threads']} cores (benchmarks/peak.c, multiply-adds in registers; "
            "no product can beat it)."
            if measured.get("gflops_per_s")
            else f"CPU multiply-add peak: not measured ({measured.get('skipped', 'not run')})."
        ),
        "",
        f"Run {report['date']} on {report['machine']}; command: `{report['command']}`.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="keras_vit against its peers, side by side.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}"
    )
    parser.add_argument(
        "--contenders",
        default=",".join(DEFAULT_CONTENDERS),
        help=f"comma-separated, from {', '.join(CONTENDERS)}",
    )
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--infer-seconds", type=float, default=None)
    parser.add_argument("--train-seconds", type=float, default=None)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up calls of each kind")
    parser.add_argument("--memory-budget", type=float, default=12.0, help="GB for live processes")
    parser.add_argument(
        "--dtype",
        choices=("float32", "mixed_bfloat16"),
        default="float32",
        help="mixed_bfloat16: every contender computes in bfloat16 (Keras' policy, "
        "PyTorch's autocast), and the limit is the bfloat16 GEMM; results go to "
        "bench-<time>-mixed_bfloat16.* and latest-mixed_bfloat16.* (default float32)",
    )
    parser.add_argument("--quick", action="store_true", help="S16-224, 3 short rounds")
    parser.add_argument("--output", default=RESULTS, help="directory of the JSON/Markdown")
    args = parser.parse_args(argv)
    if args.quick:
        args.models = "S16-224" if args.models == ",".join(MODELS) else args.models
        args.rounds = args.rounds or 3
        args.infer_seconds = args.infer_seconds or 1.0
        args.train_seconds = args.train_seconds or 1.0
        args.warmup = min(args.warmup, 1) or 1
    args.rounds = args.rounds or 5
    args.infer_seconds = args.infer_seconds or 2.0
    args.train_seconds = args.train_seconds or 3.0
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    for model in args.models:
        if model not in MODELS:
            parser.error(f"--models: expected names from {sorted(MODELS)}. Received: {model!r}")
    for name in args.contenders:
        if name not in CONTENDERS:
            parser.error(
                f"--contenders: expected names from {sorted(CONTENDERS)}. Received: {name!r}"
            )
    if args.rounds < 1:
        parser.error(f"--rounds: expected a positive integer. Received: {args.rounds}")
    return args


def machine():
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    report = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": " ".join(
            ["python benchmarks/bench.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "batch_size": args.batch_size,
        "dtype": args.dtype,
        "gemm_dtype": "float32" if args.dtype == "float32" else "bfloat16",
        "rounds": args.rounds,
        "infer_seconds": args.infer_seconds,
        "train_seconds": args.train_seconds,
        "results": [],
    }
    report["multiply_add_peak"] = measure_peak(args.dtype)
    measured = report["multiply_add_peak"]
    log(
        f"CPU multiply-add peak: {measured['gflops_per_s']:.0f} GFLOP/s on {measured['threads']} cores"
        if "gflops_per_s" in measured
        else f"CPU multiply-add peak not measured: {measured['skipped']}"
    )
    for config in args.models:
        model_name, image_size = MODELS[config]
        flops = model_flops(model_name, image_size)
        groups = make_groups(args.contenders, config, args.memory_budget)
        log(f"{config}: groups {groups}")
        groups_results = []
        for group in groups:
            groups_results.append(run_group(group, model_name, image_size, args))
        result = summarise(config, groups_results, flops)
        result["groups"] = groups
        result["targets"] = targets(result)
        report["results"].append(result)
    report["seconds"] = (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()
    text = markdown(report)
    print(text)
    os.makedirs(args.output, exist_ok=True)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
    for name in (f"bench-{stamp}{suffix}", f"latest{suffix}"):
        with open(os.path.join(args.output, name + ".json"), "w") as handle:
            json.dump(report, handle, indent=2)
        with open(os.path.join(args.output, name + ".md"), "w") as handle:
            handle.write(text)
    written = os.path.join(args.output, f"bench-{stamp}{suffix}")
    log(f"wrote {written}.json/.md ({report['seconds']:.0f} s)")
    log(f"a chart of it: python benchmarks/plot.py {written}.json --output {written}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
