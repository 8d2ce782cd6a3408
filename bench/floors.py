"""What the benchmark gate checks (read by bench/gate.py and bench/report.py): timed rows with their
tolerances, and targets.

**Timed rows: an A/B test on one machine.** Each ``TimedRow`` is one recboost path a bench times (the
contender of ``_harness.compare``, or a row added with ``_harness.ab_row``). The gate times it in
processes that alternate between the baseline commit named in ``bench/BASELINE`` and HEAD (ABBA...),
both on the same work, and takes the median of the paired ratios HEAD / baseline. A row fails when
that median exceeds ``1 + tolerance`` in the first measurement *and* in one confirming re-run. The
tolerance is 10% or 15%, and each row says why:

- 10%: a host kernel or a pure-Python path timed over many calls in one process; its own time
  varies by a few percent from one process to the next, so 10% is well clear of noise and catches
  any real regression of that kernel.
- 15%: a path whose time is mostly MindSpore's compiled graph (or a fresh process, or file I/O);
  its time moves by up to ~8-10% between processes of the same code (the graph's thread pool and
  memory placement), so 15% keeps the gate quiet on the same code.

No timed row has a floor measured on some machine: CPU kind changes the absolute numbers and the
compiled-vs-Python ratios, but not HEAD against its baseline on the same machine.

**Targets.** ``Target`` rows are the figures against the anchors (the dense limit with and without
the rows' gradient, EmbeddingLookup + LazyAdam, the C reference, the copy rate, MindSpore's boost, a
Python dict...) from one report-mode run of the quick suite, and the quality, memory and size rows.
A ``Target`` with ``checked=True`` (AUC losses, memory growth, bundle sizes: quantities that do not
depend on the CPU) fails the gate when it misses its absolute target (after one confirming re-run);
the others are reported against their targets in the gate's table, the table of docs/performance.md and the chart,
and never fail it. A metric is ``"<bench>:<key>"``: ``<bench>`` is the name a bench passes to
``_harness.record``, ``<key>`` a dotted path into its ``extra_info``; ``direction`` is ``"min"`` when
higher is better and ``"max"`` when lower is better.
"""
from collections import namedtuple

KERNEL, GRAPH = 0.10, 0.15
KERNEL_WHY = "a host kernel timed over many calls: a few % between processes"
LARGE_TABLE_WHY = ("a host kernel on a large table: the same code's pairs 0.87-1.38 (both sides' processes "
                   "without huge pages, which otherwise make HEAD run at two speeds from one process to the next on "
                   "a VM that backs fresh huge pages slowly); 15%, with the median of the pairs and the confirming run "
                   "absorbing the rest")
GRAPH_WHY = "mostly MindSpore's compiled graph: up to ~8-10% between processes of the same code"

TimedRow = namedtuple("TimedRow", "row what tolerance reason")
Target = namedtuple("Target", "metric direction target what against note checked")
Target.__new__.__defaults__ = ("", False)

TIMED = [
    TimedRow("tables", "RecModel.online_train, Wide&Deep, 1M-row HashEmbedding", GRAPH, GRAPH_WHY),
    TimedRow("plain_overhead", "RecModel.online_train, plain nn.Embedding Wide&Deep", GRAPH, GRAPH_WHY),
    TimedRow("boost_tables", "RecModel.online_train at boost O1, hash tables", GRAPH, GRAPH_WHY),
    TimedRow("multihot_tables", "RecModel.online_train, 3 tables (one pooled)", GRAPH, GRAPH_WHY),
    TimedRow("online", "RecModel.online_train, hash ids, ready batches", GRAPH, GRAPH_WHY),
    TimedRow("hash_e2e", "HashEmbedding + SparseAdam step by hand, 1M rows", GRAPH, GRAPH_WHY),
    TimedRow("loss_scale", "TrainOneStepWithLossScaleCell, 20 steps", GRAPH, GRAPH_WHY),
    TimedRow("boost_step_time_isolated", "boost O1 step cell, plain network, 10 steps", GRAPH, GRAPH_WHY),
    TimedRow("export", "RecModel.export of a 1M-row table", GRAPH,
             "file writes and fsync: the filesystem's time varies by ~10% between processes"),
    TimedRow("boost_pca_load_8_ranks", "load_pca_rows, rank 3 of 8 (fresh process)", GRAPH,
             "a few ms of memory-mapped reads in a fresh process: page-cache and mmap costs vary ~10%"),
    TimedRow("boost_pca_load_4_ranks", "load_pca_rows, rank 3 of 4 (fresh process)", GRAPH,
             "a few ms of memory-mapped reads in a fresh process: page-cache and mmap costs vary ~10%"),
    TimedRow("fused_adam_dim16", "fused sparse_adam_update kernel, dim 16", GRAPH, LARGE_TABLE_WHY),
    TimedRow("fused_adam_dim64", "fused sparse_adam_update kernel, dim 64", GRAPH, LARGE_TABLE_WHY),
    TimedRow("multihot", "pooled multi-hot lookup + fused update by hand", GRAPH, LARGE_TABLE_WHY),
    TimedRow("hash_lookup_uniform_200k", "HashCache.lookup, 200k ids, uniform", GRAPH, LARGE_TABLE_WHY),
    TimedRow("hash_lookup_zipf_200k", "HashCache.lookup, 200k ids, Zipf", GRAPH, LARGE_TABLE_WHY),
    TimedRow("data", "parse_criteo kernel", KERNEL, KERNEL_WHY),
    TimedRow("freeze_sequence", "GradientFreeze.generate_freeze_index_sequence", KERNEL, KERNEL_WHY),
]

TARGETS = [
    # -- host tables and the one train step (bench_tables.py)
    Target("tables:fraction_of_dense_limit", "min", 0.90, "RecModel.online_train, 1M-row HashEmbedding",
           "the dense limit (rows handed in, no table; the faster of two step cells)",
           "the rows' gradient alone costs ~20% of the step: see docs/performance.md"),
    Target("tables:fraction_of_dense_limit_row_grad", "min", None, "RecModel.online_train, 1M-row HashEmbedding",
           "the dense limit with the rows' gradient"),
    Target("tables:speed_vs_lookup_lazyadam", "min", 1.5, "RecModel.online_train, 1M-row HashEmbedding",
           "EmbeddingLookup(sparse) + LazyAdam, unique ids"),
    Target("plain_overhead:speed_vs_bare", "min", 0.97, "RecModel.online_train, plain nn.Embedding network",
           "the faster of two bare loops (TrainOneStepCell, recboost's guarded step cell)"),
    Target("fused_adam:fraction_of_copy_rate_dim16", "min", 0.5, "fused SparseAdam kernel, dim 16, bytes/s",
           "np.copyto bytes/s"),
    Target("fused_adam:fraction_of_copy_rate_dim64", "min", 0.5, "fused SparseAdam kernel, dim 64, bytes/s",
           "np.copyto bytes/s"),
    Target("fused_adam:speed_vs_numpy_twin_dim16", "min", None, "fused SparseAdam kernel, dim 16", "its numpy twin"),
    Target("boost_tables:speed_O1_vs_O0", "min", 1.15, "boost O1 with hash tables, samples/s", "boost O0",
           "issue #23's >= 1.0 gate is not checked (blocked): O1 measures 0.98-1.05x O0 here, 1.02x for the train "
           "cell alone (freezing +6%, the FN heads' kernels -3 to -5%), inside one model's +-4% speed spread; see "
           "docs/boost.md"),
    Target("boost_tables:speed_O2_vs_O0", "min", 1.0, "boost O2 with hash tables, samples/s", "boost O0",
           "one process: AdaSum needs >= 2 servers"),
    Target("boost_quality:auc_loss_O1", "max", 0.003, "boost O1 with hash tables, held-out AUC loss",
           "boost O0 after the same 500 steps of 2048", checked=True),
    Target("boost_quality:auc_loss_O2_relative", "max", 0.03, "boost O2 with hash tables, held-out AUC loss "
           "(relative)", "boost O0 after the same 500 steps of 2048", checked=True),
    # -- export to serving (bench_export.py)
    Target("export:size_over_raw_rows", "max", 1.2, "RecModel.export bundle bytes, 1M-row dim-16 table",
           "the rows' raw bytes (1M x 16 x 4)", "the ids add 8 bytes a row: 1.125 + the dense part", checked=True),
    Target("export:write_rate_vs_np_save", "min", None, "RecModel.export, raw row bytes/s, 1M-row dim-16 table",
           "np.save + fsync of the same rows, same filesystem",
           "the export also sorts the cache's ids (state_dict), gathers the rows and hashes every byte"),
    # -- multi-hot features and many tables (bench_multihot.py)
    Target("multihot:speed_vs_mindspore", "min", 2.0,
           "pooled multi-hot step by hand (L=20, mean, padding 0), 1M-row table, SparseAdam, rows/s",
           "EmbeddingLookup(sparse) + mask + ReduceSum + LazyAdam (the faster of unique ids / [B, L] ids)"),
    Target("multihot:speed_vs_numpy_twin", "min", None, "pooled multi-hot step by hand, rows/s",
           "its numpy twin (every kernel and the hash cache)"),
    Target("multihot_tables:three_over_one", "max", 1.15,
           "RecModel.online_train step time, 3 tables (13 + 13 one-hot, 1 pooled history)",
           "1 table, the same ids as 2 features ([B, 26, 1] and [B, 20])"),
    # -- loss scaling (bench_loss_scale.py): step time of recboost's cell over nn.TrainOneStepCell's
    Target("loss_scale:ratio_recboost_over_mindspore", "max", 1.10, "TrainOneStepWithLossScaleCell step time",
           "nn.TrainOneStepCell"),
    # -- online training pipeline (bench_online.py)
    Target("online:ratio_recboost_over_model_generator", "min", 1.0, "RecModel.online_train samples/s (hash ids)",
           "Model.train + GeneratorDataset (nn.Embedding + Adam)"),
    Target("online:ratio_text_over_ready", "min", 0.8, "online_train from Criteo text, samples/s",
           "online_train on ready batches"),
    # -- hash cache lookup (bench_hash.py): 200k resident ids, admission and timestamps on
    Target("hash_lookup_uniform_200k:speed_vs_c", "min", 0.8, "HashCache lookup, 200k ids, uniform",
           "C reference (packed slots, prefetch; the extension's flags)"),
    Target("hash_lookup_zipf_200k:speed_vs_c", "min", 0.8, "HashCache lookup, 200k ids, Zipf",
           "C reference (packed slots, prefetch; the extension's flags)"),
    Target("hash_lookup_uniform_200k:speed_vs_dict", "min", 10.0, "HashCache lookup, 200k ids, uniform",
           "pure-Python dict"),
    Target("hash_lookup_zipf_200k:speed_vs_dict", "min", 10.0, "HashCache lookup, 200k ids, Zipf", "pure-Python dict"),
    # -- hash table step (bench_hash.py), quick sizes 1M vs 100k rows
    Target("hash_e2e:large_over_small", "max", 1.05, "HashEmbedding step, 1M-row table", "the same at 100k rows"),
    Target("hash_e2e:speed_vs_embedding", "min", None, "HashEmbedding + SparseAdam step, 1M rows",
           "nn.Embedding + Adam, 1M rows", "the alternative's step is about 42 or about 65 ms from one process "
           "to the next"),
    Target("hash_e2e:speed_vs_embedding_lookup", "min", None, "HashEmbedding + SparseAdam step, 1M rows",
           "EmbeddingLookup(sparse) + LazyAdam, unique ids"),
    # -- Criteo parsing (bench_data.py)
    Target("data:speed_vs_numpy_twin", "min", None, "recboost.parse_criteo, rows/s", "its numpy twin"),
    Target("data:speed_vs_naive", "min", None, "recboost.parse_criteo, rows/s", "naive Python split parser"),
    # -- memory (bench_soak.py): growth after warm-up, a fraction near 0
    Target("soak_host:rss_growth", "max", 0.05, "HashCache soak, memory growth after warm-up",
           "its size after warm-up", checked=True),
    Target("soak_online:rss_growth", "max", 0.02, "online_train soak (GRAPH), memory growth after warm-up",
           "its size after warm-up", checked=True),
    Target("soak_online_pynative:rss_growth", "max", 0.02, "online_train soak (PyNative), memory growth",
           "its size after warm-up", checked=True),
    # -- boost (bench_boost.py, bench_boost_pca.py)
    Target("freeze_sequence:speedup", "min", 1000.0, "freeze index sequence (65536 steps)",
           "mindspore.boost GradientFreeze"),
    Target("boost_step_time_isolated:recboost_O1_vs_O0", "min", 1.2, "boost_level O1 step speed (plain network)",
           "boost_level O0"),
    Target("boost_pca_load_8_ranks:speedup", "min", 10.0, "PCA rows load, rank 3 of 8",
           "mindspore.boost split-save-then-load"),
    Target("boost_pca_load_8_ranks:recboost_peak_over_allowance", "max", 1.0, "PCA rows load peak memory, 8 ranks",
           "1.10 x the rank's share + 4 MB",
           "a transient ~4 MB beyond the share at every size (bench/bench_boost_pca.py)",
           checked=True),
    Target("boost_pca_load_4_ranks:speedup", "min", 10.0, "PCA rows load, rank 3 of 4",
           "mindspore.boost split-save-then-load"),
    Target("boost_pca_load_4_ranks:recboost_peak_over_allowance", "max", 1.0, "PCA rows load peak memory, 4 ranks",
           "1.10 x the rank's share + 4 MB",
           "a transient ~4 MB beyond the share at every size (bench/bench_boost_pca.py)",
           checked=True),
]


def tolerance(row):
    """The TimedRow named ``row``, or None when no tolerance is stated for it."""
    return next((t for t in TIMED if t.row == row), None)


# The bench tests that record the checked targets (by the bench name a metric starts with): all that the
# targets part can fail on. ``gate.py --checked-only`` (what CI runs) runs only these in its report run;
# the reported rows' benches are timed in the A/B part all the same, and ``make gate`` reports them all.
CHECKED_BENCHES = {
    "boost_quality": "bench/bench_tables.py::test_boost_quality_with_tables",
    "export": "bench/bench_export.py::test_export",
    "soak_host": "bench/bench_soak.py::test_soak_host_cache",
    "soak_online": "bench/bench_soak.py::test_soak_online_training",
    "soak_online_pynative": "bench/bench_soak.py::test_soak_online_training",
    "boost_pca_load_8_ranks": "bench/bench_boost_pca.py::test_pca_rank_load",
    "boost_pca_load_4_ranks": "bench/bench_boost_pca.py::test_pca_rank_load",
}


def meets(target, value):
    """True when ``value`` meets ``target`` (a Target with a target), None when either is missing."""
    if target.target is None or value is None or value != value:
        return None
    return value >= target.target if target.direction == "min" else value <= target.target
