"""Turn the bench suite's pytest-benchmark JSON into the performance table of docs/performance.md and a PNG chart.

    .venv/bin/python bench/report.py [--run] [--json bench/results/benchmarks.json]

``--run`` first runs the quick suite in report mode (bench/gate.py's runner). Writes the table between the markers
``<!-- perf-table:start -->`` / ``<!-- perf-table:end -->`` of docs/performance.md and the chart to
``docs/performance.png`` (committed, shown there): training samples/s of recboost's
online_train against the dense limit, the dense limit with the rows' gradient and MindSpore's best
table, and hash-cache throughput against the C reference, the naive C loop, the numpy twin and a
Python dict. Needs matplotlib (``pip install -e '.[bench]'``, a bench-only extra). ``make report``
does all of it.
"""
import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import gate  # noqa: E402

PERF_DOC = os.path.join(ROOT, "docs", "performance.md")
PNG = os.path.join(ROOT, "docs", "performance.png")
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"


def markdown(extra):
    """The performance table: one row per target of bench/floors.py, values from ``extra`` (gate.load)."""
    lines = ["| what | against | this run | target | kind |", "|---|---|---|---|---|"]
    for r in gate.check_targets(extra):
        t = r["target"]
        met = {True: " (met)", False: " (missed)", None: ""}[r["met"]]
        lines.append("| %s | %s | %s | %s%s%s | %s |" % (
            t.what, t.against, gate.fmt(r["value"]), gate.bound(t), met, (" - %s" % t.note if t.note else ""),
            "checked: fails the gate when missed" if t.checked else "reported"))
    backend = extra.get("hash_lookup_uniform_200k", {}).get("fast_backend")
    lines.append("")
    lines.append("Quick suite (`RECBOOST_BENCH_QUICK=1`), %s backend, one report-mode run on the 2-core machine; every "
                 "ratio is recboost over the alternative timed in the same process, interleaved ABBA (\"<=\" rows: "
                 "lower is better). Ratios against anchors are reported against their targets, never used as floors; "
                 "\"checked\" rows (AUC losses, memory, sizes) fail the gate when they miss their absolute target. "
                 "Speed regressions are the A/B part of the gate (HEAD against `bench/BASELINE`)."
                 % ("compiled" if backend else "numpy" if backend is not None else "?"))
    return "\n".join(lines)


def write_table(table, path=PERF_DOC, markers=(START, END)):
    """Replace the text between the ``markers`` (the perf-table's by default) of ``path`` with ``table``
    (tools/layout.py writes docs/development.md's layout table with it too)."""
    start, end = markers
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if start not in text or end not in text:
        raise SystemExit("report: %s has no %s / %s markers" % (path, start, end))
    new = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda m: start + "\n" + table + "\n" + end,
                 text, count=1, flags=re.S)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(new)


def chart(extra, path=PNG):
    """Two panels: training samples/s against the limits and MindSpore's best table, and hash-cache
    lookup ids/s (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.2]})
    rates = extra.get("tables", {}).get("samples_per_second", {})
    bars = [("dense limit,\nTrainOneStepCell", "dense_limit_plain", "#7f7f7f"),
            ("dense limit,\nguarded step", "dense_limit_guarded", "#969696"),
            ("dense limit +\nrows' gradient", "dense_limit_row_grad", "#bdbdbd"),
            ("recboost\nonline_train", "recboost", "#1f77b4"),
            ("EmbeddingLookup\n+ LazyAdam", "lookup_lazyadam", "#ff7f0e")]
    bars = [b for b in bars if b[1] in rates]
    xs = range(len(bars))
    values = [rates[key] / 1e3 for _, key, _ in bars]
    left.bar(xs, values, color=[c for _, _, c in bars])
    for x, v in zip(xs, values):
        left.text(x, v, "%.1fK" % v, ha="center", va="bottom", fontsize=9)
    left.set_xticks(list(xs))
    left.set_xticklabels([label for label, _, _ in bars], fontsize=8)
    left.set_ylabel("samples/s (thousands)")
    left.set_title("Training, Wide&Deep, 1M-row table, batch 2048")

    kinds = [("recboost HashCache", "recboost", "#1f77b4"), ("C reference", "c", "#2ca02c"),
             ("naive C loop", "c_naive", "#98df8a"), ("numpy twin", "numpy_twin", "#9467bd"),
             ("Python dict", "dict", "#d62728")]
    dists = [name for name in ("hash_lookup_uniform_200k", "hash_lookup_zipf_200k") if name in extra]
    width = 0.8 / len(kinds)
    for i, (label, key, color) in enumerate(kinds):
        vals = [extra[d]["ids_per_second"].get(key, 0) / 1e6 for d in dists]
        pos = [j + (i - (len(kinds) - 1) / 2) * width for j in range(len(dists))]
        right.bar(pos, vals, width, label=label, color=color)
        for p, v in zip(pos, vals):
            right.text(p, v, "%.3g" % v, ha="center", va="bottom", fontsize=7)
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run the quick suite first")
    parser.add_argument("--json", default=gate.JSON)
    parser.add_argument("--doc", default=PERF_DOC)
    args = parser.parse_args(argv)
    if args.run:
        code, _ = gate.run_suite(args.json, mode="report")
        if code:
            print("report: the bench suite failed (exit %d); reporting what it wrote" % code)
    extra = gate.load(args.json)
    table = markdown(extra)
    write_table(table, args.doc)
    print(table)
    print("report: table written to %s, chart to %s" % (args.doc, chart(extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
