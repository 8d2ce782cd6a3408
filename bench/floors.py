"""Every gated metric of the benchmark gate, in one place (read by bench/gate.py and bench/report.py).

A metric is ``"<bench>:<key>"``: ``<bench>`` is the name a bench passes to ``_harness.record`` (it
lands in the pytest-benchmark JSON as ``extra_info["bench"]``), ``<key>`` a dotted path into that
bench's ``extra_info``. ``direction`` is ``"min"`` when higher is better and ``"max"`` when lower is
better. ``target`` is the issue's or README's target: reported next to the result, never a floor.

The rule (``floor_from_median``): each floor sits a fixed margin beyond the MEDIAN of what was
measured (``bench/gate.py --calibrate N`` runs the quick suite N times and writes the medians to
``floors_measured.json`` beside this file):

- ratios (``kind="ratio"``): ``median / (1 + MARGIN)`` for "min" metrics, ``median * (1 + MARGIN)``
  for "max" metrics, with MARGIN = 0.25. A 30% regression (the ratio 1.3x worse) always fails,
  whatever the target; noise within 25% of the median passes.
- differences that sit near zero (``kind="delta"``, e.g. an AUC loss or a memory growth): the median
  plus (or minus) the metric's own absolute margin ``delta``.
- a ratio whose alternative runs in two speeds from one process to the next (measured, and said in
  the metric's note) takes its own wider ``margin`` instead of MARGIN, so that the alternative's fast
  speed alone does not fail the gate.

A row beyond its floor is measured again, up to twice (only its bench runs again), before the gate
fails; the gate prints every attempt. Adding a gated metric is one ``Metric(...)`` entry below and a
re-calibration.
"""
import json
import os
import statistics
from collections import namedtuple

HERE = os.path.dirname(os.path.abspath(__file__))
MEASURED = os.path.join(HERE, "floors_measured.json")
MARGIN = 0.25

Metric = namedtuple("Metric", "metric direction target what against note kind delta margin")
Metric.__new__.__defaults__ = ("", "ratio", None, None)
Floor = namedtuple("Floor", "metric direction target floor what against note median")

METRICS = [
    # -- host tables and the one train step (issue 15; bench_tables.py)
    Metric("tables:fraction_of_dense_limit", "min", 0.90, "RecModel.online_train, 1M-row HashEmbedding",
           "the dense limit (rows handed in, no table; the faster of two step cells)",
           "the rows' gradient alone costs ~20% of the step: see the README"),
    Metric("tables:fraction_of_dense_limit_row_grad", "min", None, "RecModel.online_train, 1M-row HashEmbedding",
           "the dense limit with the rows' gradient"),
    Metric("tables:speed_vs_lookup_lazyadam", "min", 1.5, "RecModel.online_train, 1M-row HashEmbedding",
           "EmbeddingLookup(sparse) + LazyAdam, unique ids"),
    Metric("plain_overhead:speed_vs_bare", "min", 0.97, "RecModel.online_train, plain nn.Embedding network",
           "bare TrainOneStepCell loop"),
    Metric("fused_adam:fraction_of_copy_rate_dim16", "min", 0.5, "fused SparseAdam kernel, dim 16, bytes/s",
           "np.copyto bytes/s"),
    Metric("fused_adam:fraction_of_copy_rate_dim64", "min", 0.5, "fused SparseAdam kernel, dim 64, bytes/s",
           "np.copyto bytes/s"),
    Metric("fused_adam:speed_vs_numpy_twin_dim16", "min", None, "fused SparseAdam kernel, dim 16", "its numpy twin"),
    Metric("boost_tables:speed_O1_vs_O0", "min", 1.15, "boost O1 with hash tables, samples/s", "boost O0"),
    Metric("boost_tables:auc_loss_O1", "max", 0.003, "boost O1 with hash tables, held-out AUC loss",
           "boost O0 after the same samples", kind="delta", delta=0.01),
    Metric("boost_tables:speed_O2_vs_O0", "min", None, "boost O2 with hash tables, samples/s", "boost O0",
           "one process: AdaSum needs >= 2 servers"),
    Metric("boost_tables:auc_loss_O2", "max", None, "boost O2 with hash tables, held-out AUC loss",
           "boost O0 after the same samples", kind="delta", delta=0.01),
    # -- export to serving (bench_export.py). Provisional floors (floors_measured.json marks them): picked
    #    conservatively from one quick run on a shared machine, not calibrated; `--calibrate` replaces them.
    Metric("export:size_over_raw_rows", "max", 1.2, "RecModel.export bundle bytes, 1M-row dim-16 table",
           "the rows' raw bytes (1M x 16 x 4)", "the ids add 8 bytes a row: 1.125 + the dense part"),
    Metric("export:write_rate_vs_np_save", "min", None, "RecModel.export, raw row bytes/s, 1M-row dim-16 table",
           "np.save + fsync of the same rows, same filesystem",
           "the export also sorts the cache's ids (state_dict), gathers the rows and hashes every byte"),
    # -- multi-hot features and many tables (issue 11; bench_multihot.py)
    Metric("multihot:speed_vs_mindspore", "min", 2.0,
           "pooled multi-hot step by hand (L=20, mean, padding 0), 1M-row table, SparseAdam, rows/s",
           "EmbeddingLookup(sparse) + mask + ReduceSum + LazyAdam (the faster of unique ids / [B, L] ids)"),
    Metric("multihot:speed_vs_numpy_twin", "min", None, "pooled multi-hot step by hand, rows/s",
           "its numpy twin (every kernel and the hash cache)"),
    Metric("multihot_tables:three_over_one", "max", 1.15,
           "RecModel.online_train step time, 3 tables (13 + 13 one-hot, 1 pooled history)",
           "1 table, the same ids as 2 features ([B, 26, 1] and [B, 20])"),
    # -- loss scaling (bench_loss_scale.py): step time of recboost's cell over nn.TrainOneStepCell's
    Metric("loss_scale:ratio_recboost_over_mindspore", "max", 1.10, "TrainOneStepWithLossScaleCell step time",
           "nn.TrainOneStepCell"),
    # -- online training pipeline (bench_online.py)
    Metric("online:ratio_recboost_over_model_generator", "min", 1.0, "RecModel.online_train samples/s (hash ids)",
           "Model.train + GeneratorDataset (nn.Embedding + Adam)"),
    Metric("online:ratio_text_over_ready", "min", 0.8, "online_train from Criteo text, samples/s",
           "online_train on ready batches"),
    # -- hash cache lookup (bench_hash.py): 200k resident ids, admission and timestamps on
    Metric("hash_lookup_uniform_200k:speed_vs_c", "min", 0.8, "HashCache lookup, 200k ids, uniform",
           "C reference (packed slots, prefetch, -O3)"),
    Metric("hash_lookup_zipf_200k:speed_vs_c", "min", 0.8, "HashCache lookup, 200k ids, Zipf",
           "C reference (packed slots, prefetch, -O3)"),
    Metric("hash_lookup_uniform_200k:speed_vs_dict", "min", 10.0, "HashCache lookup, 200k ids, uniform",
           "pure-Python dict"),
    Metric("hash_lookup_zipf_200k:speed_vs_dict", "min", 10.0, "HashCache lookup, 200k ids, Zipf", "pure-Python dict"),
    # -- hash table step (bench_hash.py), quick sizes 1M vs 100k rows
    Metric("hash_e2e:large_over_small", "max", 1.05, "HashEmbedding step, 1M-row table", "the same at 100k rows"),
    Metric("hash_e2e:speed_vs_embedding", "min", None, "HashEmbedding + SparseAdam step, 1M rows",
           "nn.Embedding + Adam, 1M rows", "the alternative's step is about 42 or about 65 ms from one process "
           "to the next (recboost's 30-37 ms): ratios 1.26-1.31 or 1.8-2.0", margin=0.6),
    Metric("hash_e2e:speed_vs_embedding_lookup", "min", None, "HashEmbedding + SparseAdam step, 1M rows",
           "EmbeddingLookup(sparse) + LazyAdam, unique ids", "the alternative's step is 55 to 83 ms from one "
           "process to the next: ratios 1.66-2.29", margin=0.4),
    # -- Criteo parsing (bench_data.py)
    Metric("data:speed_vs_numpy_twin", "min", None, "recboost.parse_criteo, rows/s", "its numpy twin"),
    Metric("data:speed_vs_naive", "min", None, "recboost.parse_criteo, rows/s", "naive Python split parser"),
    # -- memory (bench_soak.py): growth after warm-up, a fraction near 0
    Metric("soak_host:rss_growth", "max", 0.05, "HashCache soak, memory growth after warm-up",
           "its size after warm-up", kind="delta", delta=0.02),
    Metric("soak_online:rss_growth", "max", 0.02, "online_train soak (GRAPH), memory growth after warm-up",
           "its size after warm-up", kind="delta", delta=0.02),
    Metric("soak_online_pynative:rss_growth", "max", 0.02, "online_train soak (PyNative), memory growth",
           "its size after warm-up", kind="delta", delta=0.02),
    # -- boost (bench_boost.py, bench_boost_pca.py)
    Metric("freeze_sequence:speedup", "min", 1000.0, "freeze index sequence (65536 steps)",
           "mindspore.boost GradientFreeze"),
    Metric("boost_step_time_isolated:recboost_O1_vs_O0", "min", 1.2, "boost_level O1 step speed (plain network)",
           "boost_level O0"),
    Metric("boost_pca_load_8_ranks:speedup", "min", 10.0, "PCA rows load, rank 3 of 8",
           "mindspore.boost split-save-then-load"),
    Metric("boost_pca_load_8_ranks:recboost_peak_over_share", "max", 1.10, "PCA rows load peak memory, 8 ranks",
           "the rank's share", "quick size: a constant ~4 MB over an 8 MB share"),
    Metric("boost_pca_load_4_ranks:speedup", "min", 10.0, "PCA rows load, rank 3 of 4",
           "mindspore.boost split-save-then-load"),
    Metric("boost_pca_load_4_ranks:recboost_peak_over_share", "max", 1.10, "PCA rows load peak memory, 4 ranks",
           "the rank's share", "quick size: a constant ~4 MB over the share"),
]


def floor_from_median(metric, median):
    """The rule above: the floor of ``metric`` (a Metric) for a measured ``median``."""
    if metric.kind == "delta":
        return median + metric.delta if metric.direction == "max" else median - metric.delta
    margin = MARGIN if metric.margin is None else metric.margin
    return median / (1 + margin) if metric.direction == "min" else median * (1 + margin)


def load_measured(path=MEASURED):
    """``{metric: {"values": [...], "median": m}}`` from a calibration file ({} if there is none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        return json.load(fh).get("metrics", {})


def write_measured(values, runs, seconds, path=MEASURED):
    """Write a calibration: per metric its values over ``runs`` quick-suite runs and their median."""
    out = {"runs": runs, "seconds_per_run": [round(s) for s in seconds], "margin": MARGIN,
           "metrics": {name: {"values": v, "median": statistics.median(v)} for name, v in sorted(values.items()) if v}}
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1, sort_keys=True)
        fh.write("\n")
    return out


def floors(measured=None):
    """The gate's floors: every Metric with the floor its measured median gives (None: not calibrated)."""
    measured = load_measured() if measured is None else measured
    out = []
    for m in METRICS:
        median = measured.get(m.metric, {}).get("median")
        floor = None if median is None else floor_from_median(m, median)
        out.append(Floor(m.metric, m.direction, m.target, floor, m.what, m.against, m.note, median))
    return out


FLOORS = floors()
