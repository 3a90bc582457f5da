"""A chart of a bench.py run: speed as a share of the machine's limit, and memory.

    python benchmarks/plot.py                        # the last run -> docs/images/performance.png
    python benchmarks/plot.py benchmarks/results/bench-20261206-211906.json --output /tmp/run.png

Three panels, one group of bars per model (ViT-S/16 224, ViT-B/16 224,
ViT-S/16 384), one bar per contender: inference and training-step speed,
each as a share of what the machine allows (images/s times the model's
FLOPs per image, over the float32 GEMM rate bench.py measured in the same
run; the dashed line is that limit; where bench.py measured the CPU's
float32 multiply-add peak, a dotted segment over each model's bars marks it,
on the same scale), and the peak resident memory of the training process.
A run whose GEMM probe measured nothing is drawn in images/s instead. The
bars are bench.py's medians; its Markdown file has the ratios, taken from
the same interleaved rounds, that the targets are judged on.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_INPUT = os.path.join(HERE, "results", "latest.json")
DEFAULT_OUTPUT = os.path.join(ROOT, "docs", "images", "performance.png")

# Contender -> (label, colour): keras_vit in blues, the peers in other hues.
STYLE = {
    "keras_vit": ("keras_vit", "#08519c"),
    "keras_vit[streams]": ("keras_vit, two CPU streams", "#3182bd"),
    "keras_vit[remat]": ("keras_vit, remat", "#6baed6"),
    "keras_vit[jax]": ("keras_vit, JAX", "#9ecae1"),
    "keras_vit[jax-remat]": ("keras_vit, JAX, remat", "#c6dbef"),
    "keras_hub": ("keras-hub", "#e6550d"),
    "vit_keras": ("vit-keras", "#fdae6b"),
    "timm": ("timm", "#31a354"),
}
MODEL_LABELS = {"S16-224": "ViT-S/16 224", "B16-224": "ViT-B/16 224", "S16-384": "ViT-S/16 384"}
OTHER_COLOURS = ("#756bb1", "#bcbddc", "#636363", "#bdbdbd")


def load(path):
    """The report bench.py wrote to `path`; SystemExit with the reason if it is not one."""
    try:
        with open(path) as file:
            report = json.load(file)
    except FileNotFoundError:
        sys.exit(f"plot.py: no such file: {path} (run python benchmarks/bench.py first)")
    except (OSError, ValueError) as error:
        sys.exit(f"plot.py: cannot read {path} as JSON: {error}")
    results = report.get("results") if isinstance(report, dict) else None
    if not results or not all(isinstance(r, dict) and "contenders" in r for r in results):
        sys.exit(f"plot.py: {path} is not a bench.py report (no 'results' with 'contenders')")
    return report


def contenders_in(results):
    """Contender names that ran (not skipped) in any model, in bench.py's order."""
    names = []
    for result in results:
        for name, entry in result["contenders"].items():
            if not entry.get("skipped") and name not in names:
                names.append(name)
    return names


def style_of(name, index):
    return STYLE.get(name, (name, OTHER_COLOURS[index % len(OTHER_COLOURS)]))


def panels(results):
    """(title, y label, key, scale) for the three panels; a scale of 100 draws
    shares of the machine's limit in %, with the limit as a dashed line."""
    shares = all(
        entry.get("infer_fraction_of_limit") is not None
        for result in results
        for entry in result["contenders"].values()
        if not entry.get("skipped")
    )
    if shares:
        return [
            ("inference", "% of the machine's limit", "infer_fraction_of_limit", 100),
            ("training step", "% of the machine's limit", "train_fraction_of_limit", 100),
            ("peak training memory", "GB resident", "peak_rss_gb", 1),
        ]
    return [
        ("inference", "images/s", "infer_images_per_s", 1),
        ("training step", "images/s", "train_images_per_s", 1),
        ("peak training memory", "GB resident", "peak_rss_gb", 1),
    ]


def peak_segments(axis, report, results):
    """A dotted segment over each model's bars at the CPU's multiply-add peak, as a
    share of that model's GEMM limit; nothing where either was not measured."""
    peak = (report.get("multiply_add_peak") or {}).get("gflops_per_s")
    if not peak or report.get("gemm_dtype", "float32") != "float32":
        return
    drawn = None
    for position, result in enumerate(results):
        gemm = result.get("gemm_gflops_per_s")
        if gemm:
            drawn = (position, 100 * peak / gemm)
            axis.hlines(drawn[1], position - 0.45, position + 0.45, colors="black", linestyles=":")
    if drawn:
        axis.annotate(
            "CPU multiply-add peak",
            (drawn[0] + 0.45, drawn[1]),
            xytext=(0, 3),
            textcoords="offset points",
            ha="right",
            fontsize=8,
        )


def figure_of(report):
    """The chart of `report` (bench.py's JSON) as a matplotlib Figure."""
    import matplotlib.figure
    import matplotlib.patches

    results = report["results"]
    names = contenders_in(results)
    if not names:
        sys.exit("plot.py: every contender was skipped in this run; nothing to draw")
    models = [r["config"] for r in results]
    width = 0.8 / len(names)
    figure = matplotlib.figure.Figure(figsize=(15, 4.8), layout="constrained")
    axes = figure.subplots(1, 3)
    for axis, (title, ylabel, key, scale) in zip(axes, panels(results)):
        for index, name in enumerate(names):
            colour = style_of(name, index)[1]
            for position, result in enumerate(results):
                entry = result["contenders"].get(name, {})
                value = entry.get(key)
                if entry.get("skipped") or value is None:
                    continue
                x = position - 0.4 + width * (index + 0.5)
                axis.bar(x, value * scale, width, color=colour)
                if name == "keras_vit":
                    text = f"{value * scale:.0f}%" if scale == 100 else f"{value:.2f}"
                    axis.annotate(
                        text,
                        (x, value * scale),
                        xytext=(0, 2),
                        textcoords="offset points",
                        ha="center",
                        fontsize=7,
                    )
        if scale == 100:  # shares: the limit is 100%
            axis.axhline(100, color="black", linestyle="--", linewidth=1)
            axis.annotate(
                "float32 GEMM limit",
                (1.0, 100),
                xycoords=("axes fraction", "data"),
                xytext=(-4, 3),
                textcoords="offset points",
                ha="right",
                fontsize=8,
            )
            peak_segments(axis, report, results)
        axis.set_title(title)
        axis.set_ylabel(ylabel)
        axis.set_xticks(range(len(models)))
        axis.set_xticklabels([MODEL_LABELS.get(m, m) for m in models])
        axis.set_ylim(0, axis.get_ylim()[1] * 1.08)
        axis.grid(axis="y", alpha=0.3)
    # One legend for all panels, in bench.py's order.
    handles, labels = [], []
    for index, name in enumerate(names):
        label, colour = style_of(name, index)
        handles.append(matplotlib.patches.Rectangle((0, 0), 1, 1, color=colour))
        labels.append(label)
    figure.legend(handles, labels, loc="outside lower center", ncol=len(names), fontsize=9)
    figure.suptitle(
        f"bench.py, batch {report.get('batch_size', '?')}, {report.get('dtype', '?')}: "
        f"{report.get('date', '?')}, {report.get('machine', '?')}",
        fontsize=10,
    )
    return figure


def draw(report, output):
    """Draws `report` and saves it as `output` (PNG, SVG or PDF)."""
    figure = figure_of(report)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    figure.savefig(output, dpi=100)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", nargs="?", default=DEFAULT_INPUT, help="bench.py's JSON file")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="the chart (.png, .svg, .pdf)")
    args = parser.parse_args(argv)
    if os.path.splitext(args.output)[1].lower() not in (".png", ".svg", ".pdf"):
        parser.error(f"--output must end in .png, .svg or .pdf. Received: {args.output}")
    report = load(args.report)
    draw(report, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
