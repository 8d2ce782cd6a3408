"""Turn the bench suite's pytest-benchmark JSON into the README performance table and a PNG chart.

    .venv/bin/python bench/report.py [--run] [--json bench/results/benchmarks.json]

``--run`` first runs the quick suite (bench/gate.py's runner). Writes the table between the markers
``<!-- perf-table:start -->`` / ``<!-- perf-table:end -->`` of README.md and the chart to
``bench/results/performance.png``: online-training samples/s (recboost, Model.train, the bare loop)
and hash-cache throughput against the alternatives. Needs matplotlib (``pip install -e '.[bench]'``,
a bench-only extra). ``make report`` does all of it.
"""
import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import gate  # noqa: E402

README = os.path.join(ROOT, "README.md")
PNG = os.path.join(gate.RESULTS, "performance.png")
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"


def markdown(extra):
    """The README table: one row per floor of bench/floors.py, values from ``extra`` (gate.load)."""
    lines = ["| what | against | ratio (this run) | README target | gate floor | gate |",
             "|---|---|---|---|---|---|"]
    for f, v, status in gate.check(extra):
        lines.append("| %s | %s | %s | %s | %s | %s |" % (
            f.what, f.against, gate._fmt(v), gate.bound(f, f.target) + (" (%s)" % f.note if f.note else ""),
            gate.bound(f, f.floor), status))
    info = extra.get("online", {})
    backend = extra.get("hash_lookup_uniform_200k", {}).get("backend", "?")
    lines.append("")
    lines.append("Quick suite (`RECBOOST_BENCH_QUICK=1`), %s backend, one run on the shared 2-core machine; "
                 "ratios are recboost over the alternative in the same process (for step times, "
                 "\"max\" rows, lower is better). Online training: %s steps of batch 2048." % (
                     backend, info.get("steps", "?")))
    return "\n".join(lines)


def write_readme(table, path=README):
    """Replace the text between the perf-table markers of ``path`` with ``table``."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if START not in text or END not in text:
        raise SystemExit("report: %s has no %s / %s markers" % (path, START, END))
    new = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda m: START + "\n" + table + "\n" + END,
                 text, count=1, flags=re.S)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(new)


def chart(extra, path=PNG):
    """Two panels: online-training samples/s, and hash-cache lookup ids/s (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.2]})
    online = extra.get("online", {}).get("samples_per_second", {})
    bars = [("recboost\nonline_train", "recboost", "#1f77b4"),
            ("recboost\nfrom text", "recboost_text", "#6baed6"),
            ("Model.train\nGenerator", "model_generator", "#ff7f0e"),
            ("Model.train\nNumpySlices", "model_numpy_slices", "#fdae6b"),
            ("bare\nTrainOneStepCell", "bare", "#7f7f7f")]
    bars = [b for b in bars if b[1] in online]
    xs = range(len(bars))
    values = [online[key] / 1e3 for _, key, _ in bars]
    left.bar(xs, values, color=[c for _, _, c in bars])
    for x, v in zip(xs, values):
        left.text(x, v, "%.1fK" % v, ha="center", va="bottom", fontsize=9)
    left.set_xticks(list(xs))
    left.set_xticklabels([label for label, _, _ in bars], fontsize=8)
    left.set_ylabel("samples/s (thousands)")
    left.set_title("Online training, Wide&Deep, batch 2048")

    kinds = [("recboost HashCache", "recboost", "#1f77b4"), ("plain-C loop", "c", "#2ca02c"),
             ("numpy twin", "numpy_twin", "#9467bd"), ("Python dict", "dict", "#d62728")]
    dists = [name for name in ("hash_lookup_uniform_200k", "hash_lookup_zipf_200k") if name in extra]
    width = 0.8 / len(kinds)
    for i, (label, key, color) in enumerate(kinds):
        vals = [extra[d]["ids_per_second"].get(key, 0) / 1e6 for d in dists]
        pos = [j + (i - (len(kinds) - 1) / 2) * width for j in range(len(dists))]
        right.bar(pos, vals, width, label=label, color=color)
        for p, v in zip(pos, vals):
            right.text(p, v, "%.3g" % v, ha="center", va="bottom", fontsize=8)
    right.set_yscale("log")
    right.set_xticks(range(len(dists)))
    right.set_xticklabels(["uniform ids" if "uniform" in d else "Zipf ids" for d in dists])
    right.set_ylabel("M ids/s (log scale)")
    right.set_title("Hash-cache lookup, 200k resident ids, 26x4096 batches")
    right.legend(fontsize=8, loc="upper left")
    right.set_ylim(top=right.get_ylim()[1] * 3)
    fig.suptitle("recboost quick bench suite (one run, same process per panel; higher is better)", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run the quick suite first")
    parser.add_argument("--json", default=gate.JSON)
    parser.add_argument("--readme", default=README)
    args = parser.parse_args(argv)
    if args.run:
        code, _ = gate.run_suite(args.json)
        if code:
            print("report: the bench suite failed (exit %d); reporting what it wrote" % code)
    extra = gate.load(args.json)
    table = markdown(extra)
    write_readme(table, args.readme)
    print(table)
    print("report: table written to %s, chart to %s" % (args.readme, chart(extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
