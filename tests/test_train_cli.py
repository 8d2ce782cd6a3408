"""python -m recboost train / serve-check: files, .gz, directories and pipes; holdout; resume; export.

Every count is checked against the lines the test wrote (the table's lookups are 26 per trained row);
models are compared bit for bit with a model trained on the same rows another way."""
import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import recboost as rb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 64
QUIET = dict(progress_seconds=1e9, printer=lambda line: None)


def _lines(n, seed=1):
    """``n`` Criteo-format lines (newline-terminated) of the synthetic stream."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "x.txt")
        rb.SyntheticClickStream(seed=seed).write_criteo(path, n)
        with open(path) as fh:
            return fh.read().splitlines(keepends=True)


def _probe(lines):
    """(dense, ids) of the rows of ``lines``, parsed by CriteoReader."""
    import io
    batch = next(iter(rb.CriteoReader(io.BytesIO("".join(lines).encode()), batch_size=len(lines))))
    return batch[0], batch[1]


def _predict(result, probe):
    return result["model"].predict(*probe).asnumpy()


def test_a_directory_with_a_gz_file_and_stdin_train_on_exactly_the_lines_given(tmp_path, graph_mode, monkeypatch):
    """A directory (a plain file and a .gz, read in name order as one stream: batches span the
    files; a hidden file left out; a malformed line counted and skipped) trains on every row once,
    and gives bit for bit the model of the same lines in one file, and of them on standard input."""
    lines = _lines(250)
    folder = tmp_path / "days"
    folder.mkdir()
    with open(folder / "day-1.txt", "w") as fh:
        fh.write("".join(lines[:100]) + "not a criteo line\n")
    with gzip.open(folder / "day-2.txt.gz", "wt") as fh:
        fh.write("".join(lines[100:]))
    with open(folder / ".partial.txt", "w") as fh:
        fh.write("".join(lines[:50]))
    single = tmp_path / "all.txt"
    single.write_text("".join(lines))

    by_dir = rb.train_job(str(folder), batch_size=BS, **QUIET)
    assert by_dir["steps"] == 4 and by_dir["rows"] == 250             # 64+64+64+58: one stream, not 2+3 batches
    assert by_dir["table"]["looked_up"] == 250 * 26
    assert by_dir["reader"]["files"] == 2 and by_dir["reader"]["lines"] == 251
    assert by_dir["reader"]["malformed"]["field_count"] == 1
    assert by_dir["progressive"]["rows"] == 250 and by_dir["held_out"] is None

    by_file = rb.train_job(str(single), batch_size=BS, **QUIET)

    class Stdin:
        buffer = open(single, "rb")
    monkeypatch.setattr(sys, "stdin", Stdin)
    try:
        by_pipe = rb.train_job("-", batch_size=BS, **QUIET)
    finally:
        Stdin.buffer.close()
    probe = _probe(lines[:40])
    expected = _predict(by_file, probe)
    for result in (by_dir, by_pipe):
        assert result["rows"] == 250 and result["table"]["looked_up"] == 250 * 26
        np.testing.assert_array_equal(_predict(result, probe).view(np.uint32), expected.view(np.uint32))


def test_steps_stop_training_there(tmp_path, graph_mode):
    path = tmp_path / "day.txt"
    path.write_text("".join(_lines(64 * 6)))
    result = rb.train_job(str(path), batch_size=BS, steps=2, **QUIET)
    assert result["steps"] == 2 and result["rows"] == 2 * BS and result["progressive"]["rows"] == 2 * BS


def _held_lines(n, salt):
    """Lines whose every id is new (hex values no generated line has)."""
    rng = np.random.default_rng(salt)
    return ["%d\t%s\t%s\n" % (k % 2, "\t".join(str(v) for v in rng.integers(0, 50, 13)),
                              "\t".join("%08x" % (0xabc00000 + salt * 100000 + 26 * k + f) for f in range(26)))
            for k in range(n)]


def _owned(result, lines):
    """How many of the ids of ``lines`` own a row of the trained table."""
    ids = _probe(lines)[1]
    return int((result["model"].tables[0].cache.find(ids) != rb.HASH_DEFAULT_ROW).sum())


def test_holdout_rows_are_split_off_before_training_and_never_trained_on(tmp_path, graph_mode):
    trained = _lines(64 * 5)
    held = _held_lines(2 * BS, 1)
    path = tmp_path / "day.txt"
    path.write_text("".join(trained + held))
    result = rb.train_job(str(path), batch_size=BS, holdout=2, **QUIET)
    assert result["rows"] == 64 * 5 and result["table"]["looked_up"] == 64 * 5 * 26
    assert result["held_out"]["rows"] == 2 * BS and 0.0 <= result["held_out"]["auc"] <= 1.0
    assert _owned(result, held) == 0 and _owned(result, trained[:BS]) > 0
    # the held-out figures are the model's own scores of those rows
    logits = np.concatenate([_predict(result, _probe(held[k:k + BS])).ravel() for k in (0, BS)])   # as batched
    probs = 1 / (1 + np.exp(-logits.astype(np.float64)))
    labels = np.array([int(l[0]) for l in held])
    assert result["held_out"]["auc"] == pytest.approx(rb.roc_auc(labels, probs), abs=1e-12)
    assert result["held_out"]["log_loss"] == pytest.approx(rb.log_loss(labels, probs), rel=1e-12)

    folder = tmp_path / "days"                                # a directory: its last file held out whole
    folder.mkdir()
    (folder / "a.txt").write_text("".join(trained))
    (folder / "b.txt").write_text("".join(held))
    result = rb.train_job(str(folder), batch_size=BS, holdout="file", **QUIET)
    assert result["rows"] == 64 * 5 and result["held_out"]["rows"] == 2 * BS and _owned(result, held) == 0
    with pytest.raises(ValueError, match="'holdout' must be 0 with standard input"):
        rb.train_job("-", batch_size=BS, holdout=2, **QUIET)
    with pytest.raises(ValueError, match="'file' only with a directory"):
        rb.train_job(str(path), batch_size=BS, holdout="file", **QUIET)


def _train_cmd(data, ckpt, export, *extra):
    return [sys.executable, "-m", "recboost", "train", "--data", str(data), "--batch-size", str(BS),
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10", "--export", str(export),
            "--export-every", "10", "--eviction-threshold", "8", "--progress-seconds", "1000"] + list(extra)


def _checkpoint_arrays(path):
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    manifest = json.loads(arrays.pop("manifest").tobytes().decode())
    manifest.pop("run")
    manifest.pop("sha256")                # the manifest's own checksum covers the run id
    return manifest, arrays


def test_a_killed_run_resumes_to_the_same_model_bit_for_bit(tmp_path):
    """``kill -9`` in the middle of a file, then the same command again: the final checkpoint and the
    served export chain are those of an uninterrupted run, bit for bit. The file is first a named
    pipe fed half its lines (so the kill lands mid-file for sure), then the whole file at that path."""
    lines = _lines(64 * 50)
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "day.txt").write_text("".join(lines))
    out = subprocess.run(_train_cmd(whole / "day.txt", whole / "ckpt", whole / "export"),
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]

    cut = tmp_path / "cut"
    cut.mkdir()
    data = cut / "day.txt"
    os.mkfifo(data)
    proc = subprocess.Popen(_train_cmd(data, cut / "ckpt", cut / "export"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with open(data, "w") as pipe:
            pipe.write("".join(lines[:64 * 25 + 10]))
            pipe.flush()
            deadline = time.time() + 300
            while not os.path.exists(cut / "ckpt" / "recboost-20.input.json") and time.time() < deadline:
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                time.sleep(0.2)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert rb.latest_checkpoint(str(cut / "ckpt")).endswith("recboost-20.npz")
    with open(rb._input_position_path(str(cut / "ckpt" / "recboost-20.npz"))) as fh:
        position = json.load(fh)                       # written right after the checkpoint (it waits for it)
    os.unlink(data)
    data.write_text("".join(lines))
    out = subprocess.run(_train_cmd(data, cut / "ckpt", cut / "export"), cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from %s" % (cut / "ckpt" / "recboost-20.npz") in out.stderr
    assert "skipping the first 2" in out.stderr                     # 20 trained + prefetched ones replayed
    # ... and not parsed: the run seeks to where the killed run's checkpoint had consumed the file
    batches = position["batches"]
    assert 20 <= batches <= 25 and position["lines"] == 64 * batches
    assert "seeking to file 1 of 1 (%s), byte %d (line %d): the %d batches already trained are not read again" % (
        data, len("".join(lines[:64 * batches]).encode()), 64 * batches, batches) in out.stderr
    assert "skipping the first %d batches" % batches in out.stderr
    assert "read %d lines" % (64 * (50 - batches)) in out.stderr      # the lines after the position only

    want_manifest, want = _checkpoint_arrays(rb.latest_checkpoint(str(whole / "ckpt")))
    got_manifest, got = _checkpoint_arrays(rb.latest_checkpoint(str(cut / "ckpt")))
    assert want_manifest["step"] == got_manifest["step"] == 50
    assert want_manifest["evict_hooks"][0]["evictions"] > 0        # evictions ran, before and after the kill
    assert got_manifest == want_manifest and sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert sorted(os.listdir(cut / "export")) == sorted(os.listdir(whole / "export"))
    scores = [rb.serve_check(str(d / "export"), str(whole / "day.txt"), batch_size=BS, printer=lambda l: None)
              for d in (whole, cut)]
    assert scores[0]["step"] == scores[1]["step"] == 50
    assert (scores[0]["auc"], scores[0]["log_loss"]) == (scores[1]["auc"], scores[1]["log_loss"])

    # the same directory with another setting: refused, naming it, before anything is trained
    out = subprocess.run(_train_cmd(data, cut / "ckpt", cut / "export", "--lr", "0.01"), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "learning_rate: 0.001 recorded, 0.01 now" in out.stderr
    assert rb.latest_checkpoint(str(cut / "ckpt")).endswith("recboost-50.npz")


def test_serve_check_scores_with_the_export_chain_as_the_model_does(tmp_path, graph_mode):
    lines = _lines(64 * 7 + 5)
    path = tmp_path / "day.txt"
    path.write_text("".join(lines))
    result = rb.train_job(str(path), batch_size=BS, export=str(tmp_path / "export"), export_every=3, **QUIET)
    names = sorted(os.listdir(tmp_path / "export"))
    assert names == ["bundle-000000003", "bundle-000000006", "bundle-000000008", "train-config.json"]
    kinds = [json.load(open(tmp_path / "export" / n / "manifest.json"))["kind"] for n in names[:3]]
    assert kinds == ["full", "delta", "delta"]
    served = rb.serve_check(str(tmp_path / "export"), str(path), batch_size=BS, printer=lambda l: None)
    model = result["model"]
    own = rb._score_input(lambda d, i: model.predict(d, i).asnumpy(), rb.CriteoReader(str(path), batch_size=BS))
    assert served["rows"] == own["rows"] == len(lines) and served["step"] == 8
    assert (served["auc"], served["log_loss"]) == (own["auc"], own["log_loss"])
    with pytest.raises(ValueError, match="'export' must be a new or empty directory when the run starts afresh"):
        rb.train_job(str(path), batch_size=BS, export=str(tmp_path / "export"), **QUIET)     # not resuming


def test_bad_input_ends_with_exit_2_and_a_message_naming_it(tmp_path):
    def run(*args, stdin=None):
        return subprocess.run([sys.executable, "-m", "recboost"] + list(args), cwd=ROOT, capture_output=True,
                              text=True, timeout=600, input=stdin)
    out = run("train", "--data", str(tmp_path / "missing.txt"))
    assert out.returncode == 2 and "Traceback" not in out.stderr and "missing.txt" in out.stderr
    (tmp_path / "empty").mkdir()
    out = run("train", "--data", str(tmp_path / "empty"))
    assert out.returncode == 2 and "holds none" in out.stderr
    out = run("train", "--data", "-", "--holdout", "2", stdin="")
    assert out.returncode == 2 and "standard input" in out.stderr and "Traceback" not in out.stderr
    cut = tmp_path / "cut.txt.gz"                              # a .gz cut short: named, with where it stops
    with gzip.open(cut, "wt") as fh:
        fh.write("".join(_lines(600)))
    cut.write_bytes(cut.read_bytes()[:-2000])
    out = run("train", "--data", str(cut), "--batch-size", "64")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "cut.txt.gz" in out.stderr and "cut short" in out.stderr
    out = run("serve-check", str(tmp_path / "empty"), "--data", str(cut))
    assert out.returncode == 2 and "'model' must be given" in out.stderr


def _with_time(lines, times, column=1):
    """``lines`` with the integer ``times`` inserted as tab-separated column ``column``."""
    out = []
    for line, t in zip(lines, times):
        fields = line.rstrip("\n").split("\t")
        out.append("\t".join(fields[:column] + [str(t)] + fields[column:]) + "\n")
    return out


def test_a_timestamp_column_is_the_tables_clock(tmp_path, graph_mode):
    """``timestamp_column``: the extra column is taken out of the features (the model is bit for bit
    the one of the lines without it) and is the tables' clock: ids unseen for ``eviction_threshold``
    seconds of data time are evicted, whatever the step count."""
    old, new = _lines(64 * 4, seed=1), _held_lines(64 * 2, 2) * 2   # two phases with disjoint ids (new: seen twice)
    plain = tmp_path / "plain.txt"
    plain.write_text("".join(old + new))
    timed = tmp_path / "timed.txt"
    timed.write_text("".join(_with_time(old, range(0, 64 * 4)) + _with_time(new, range(10 ** 6, 10 ** 6 + 64 * 4))))
    probe = _probe(old[:32])
    without = rb.train_job(str(plain), batch_size=BS, **QUIET)
    kept = rb.train_job(str(timed), batch_size=BS, timestamp_column=1, **QUIET)
    np.testing.assert_array_equal(_predict(kept, probe).view(np.uint32), _predict(without, probe).view(np.uint32))
    assert _owned(kept, old) > 0 and kept["table"]["evicted"] == 0
    evicting = rb.train_job(str(timed), batch_size=BS, timestamp_column=1, eviction_threshold=1000, **QUIET)
    assert _owned(evicting, old) == 0 and _owned(evicting, new) == len(new) * 26
    by_steps = rb.train_job(str(plain), batch_size=BS, eviction_threshold=1000, **QUIET)   # 8 steps: none stale
    assert _owned(by_steps, old) == _owned(kept, old)
    with pytest.raises(ValueError, match="timestamp_column"):
        rb.train_job(str(timed), batch_size=BS, timestamp_column=15, **QUIET)
    # the column must hold integers: a line whose time is not one is a counted, skipped malformed line
    bad = tmp_path / "bad.txt"
    bad.write_text("".join(_with_time(old[:64], range(64)) + _with_time(old[64:65], ["noon"])))
    result = rb.train_job(str(bad), batch_size=BS, timestamp_column=1, **QUIET)
    assert result["rows"] == 64 and result["reader"]["malformed"]["dense"] == 1


def test_progressive_validation_figures_are_those_of_the_scores_before_each_step(tmp_path, graph_mode):
    """ProgressMonitor(eval_every=1): the window and all-rows AUC and log loss are those of every
    batch's scores taken just before it trained (recorded by another callback at the same point)."""
    import mindspore as ms
    from mindspore import nn

    class Recorder(ms.train.Callback):
        scores, labels = [], []

        def on_train_step_begin(self, run_context):
            params = run_context.original_args()
            self.scores.append(params.recboost.predict_step_inputs(params.train_dataset_element).asnumpy().ravel())
            self.labels.append(params.train_dataset_element[-1].asnumpy().ravel())

    path = tmp_path / "day.txt"
    path.write_text("".join(_lines(64 * 6)))
    net, _ = rb._job_network("widedeep", 0, 1 << 16, 1, -1, None, 1e-3)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3))
    monitor = rb.ProgressMonitor(every_seconds=1e9, eval_every=1, window=150, printer=lambda line: None)
    recorder = Recorder()
    model.online_train(rb._CriteoInput([str(path)], BS), callbacks=[recorder, monitor], dataset_sink_mode=False)
    probs = 1 / (1 + np.exp(-np.concatenate(recorder.scores).astype(np.float64)))
    labels = np.concatenate(recorder.labels)
    assert monitor.scored_rows() == labels.size == 64 * 6
    assert monitor.total_log_loss() == pytest.approx(rb.log_loss(labels, probs), rel=1e-12)
    assert monitor.total_auc() == pytest.approx(rb.roc_auc(labels, np.round(probs * 65536) / 65536), abs=1e-12)
    window = slice(-128, None)                     # the last whole batches within 150 rows: 2 of 64
    assert monitor.running_auc() == pytest.approx(rb.roc_auc(labels[window], probs[window]), abs=1e-12)
    assert monitor.window_log_loss() == pytest.approx(rb.log_loss(labels[window], probs[window]), rel=1e-12)


def test_a_file_that_fails_to_read_is_named_with_its_last_line(tmp_path):
    """An OSError while reading (a lost mount, a bad disk) names the file and the lines read before."""
    import io
    good = tmp_path / "a.txt"
    good.write_text("".join(_lines(100)))

    class Failing(io.RawIOBase):
        name = "day-2.txt"

        def __init__(self):
            self.left = io.BytesIO("".join(_lines(30)).encode())

        def readable(self):
            return True

        def read1(self, n):
            data = self.left.read(min(n, 1500))
            if not data:
                raise OSError(5, "Input/output error")
            return data
    batches = rb._CriteoInput([str(good), Failing()], BS)
    with pytest.raises(OSError, match=r"the file 'day-2.txt' must be readable, but reading it failed after line "
                                      r"(\d+): \[Errno 5\] Input/output error") as info:
        list(batches)
    line = int(info.value.args[0].split("after line ")[1].split(":")[0])
    assert 0 < line <= 30 and batches.stats()["rows_yielded"] <= 130


def test_resuming_on_standard_input_takes_it_as_the_rows_that_follow(tmp_path, graph_mode, monkeypatch):
    """On standard input a resumed run cannot re-read what was trained: the caller feeds the rest, and
    the model is then bit for bit that of one run over all the lines."""
    lines = _lines(64 * 8)
    whole = tmp_path / "all.txt"
    whole.write_text("".join(lines))
    first, rest = tmp_path / "first.txt", tmp_path / "rest.txt"
    first.write_text("".join(lines[:64 * 5]))
    rest.write_text("".join(lines[64 * 5:]))
    said = []

    def feed(path, **kwargs):
        class Stdin:
            buffer = open(path, "rb")
        monkeypatch.setattr(sys, "stdin", Stdin)
        try:
            return rb.train_job("-", batch_size=BS, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2,
                                eviction_threshold=3, progress_seconds=1e9, printer=said.append, **kwargs)
        finally:
            Stdin.buffer.close()
    assert feed(first)["steps"] == 5
    resumed = feed(rest)
    assert any("standard input is taken as the rows that follow the ones trained" in line for line in said)
    assert any("320 rows had been trained before it" in line for line in said)
    assert resumed["steps"] == 8 and resumed["rows"] == 64 * 3
    once = rb.train_job(str(whole), batch_size=BS, eviction_threshold=3, **QUIET)
    probe = _probe(lines[:40])
    np.testing.assert_array_equal(_predict(resumed, probe).view(np.uint32), _predict(once, probe).view(np.uint32))


# ---- resume seeks: the position recorded with each checkpoint --------------------------------------------
def _run(data, ckpt, said=None, **kwargs):
    """``train_job`` with checkpoints every 2 steps in ``ckpt`` (eviction on: its schedule is state too)."""
    return rb.train_job(str(data), batch_size=BS, checkpoint_dir=str(ckpt), checkpoint_every=2,
                        eviction_threshold=3, progress_seconds=1e9,
                        printer=(said.append if said is not None else lambda line: None), **kwargs)


def _position(ckpt):
    """The input position recorded with the latest checkpoint of ``ckpt``."""
    with open(rb._input_position_path(rb.latest_checkpoint(str(ckpt)))) as fh:
        return json.load(fh)


def _same_final_checkpoint(*dirs):
    """The latest checkpoints of ``dirs`` hold the same manifest (but the run id) and arrays, bit for bit."""
    want_manifest, want = _checkpoint_arrays(rb.latest_checkpoint(str(dirs[0])))
    for d in dirs[1:]:
        got_manifest, got = _checkpoint_arrays(rb.latest_checkpoint(str(d)))
        assert got_manifest == want_manifest and sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _positions_match_checkpoints(ckpt):
    """Every checkpoint has its position file and no position file outlives its checkpoint."""
    names = os.listdir(ckpt)
    stems = sorted(n[:-4] for n in names if n.endswith(".npz"))
    assert stems and stems == sorted(n[:-len(".input.json")] for n in names if n.endswith(".input.json"))


def test_a_resumed_run_seeks_in_its_file_and_ends_as_a_rereading_resume_and_an_uninterrupted_run(tmp_path,
                                                                                               graph_mode):
    """A file (with one batch held out): the resumed run parses only the lines after the recorded
    position; its final checkpoint is bit for bit that of a resume that re-reads the file (today's, the
    position file removed) and of an uninterrupted run."""
    import shutil
    lines = _lines(64 * 21)
    path = tmp_path / "day.txt"
    path.write_text("".join(lines))
    once = _run(path, tmp_path / "once", holdout=1)
    assert once["steps"] == 20 and once["reader"]["lines"] == 64 * 20
    first = _run(path, tmp_path / "seek", holdout=1, steps=7)
    assert first["steps"] == 7
    position = _position(tmp_path / "seek")
    batches = position["batches"]                     # 7 trained + the ones the prefetcher had prepared
    assert 7 <= batches < 20 and position["source"] == 0 and position["step"] == 7
    assert position["lines"] == position["rows"] == 64 * batches
    assert position["offset"] == len("".join(lines[:64 * batches]).encode())
    shutil.copytree(tmp_path / "seek", tmp_path / "reread")
    os.unlink(rb._input_position_path(rb.latest_checkpoint(str(tmp_path / "reread"))))

    said = []
    seek = _run(path, tmp_path / "seek", said, holdout=1)
    assert any("seeking to file 1 of 1 (%s), byte %d (line %d): the %d batches already trained are not read again"
               % (path, position["offset"], 64 * batches, batches) in line for line in said), said
    assert seek["reader"]["lines"] == 64 * (20 - batches)           # only the rest is parsed
    assert seek["steps"] == 20 and seek["rows"] == 64 * 13 and seek["held_out"] == once["held_out"]

    said = []
    reread = _run(path, tmp_path / "reread", said, holdout=1)
    assert any("read again and skipped, because the checkpoint has no recorded input position" in line
               for line in said), said
    assert reread["reader"]["lines"] == 64 * 20                     # today's resume parses it all again
    assert reread["steps"] == 20 and reread["held_out"] == once["held_out"]
    _same_final_checkpoint(tmp_path / "once", tmp_path / "seek", tmp_path / "reread")
    for d in ("once", "seek", "reread"):
        _positions_match_checkpoints(tmp_path / d)
    assert _position(tmp_path / "seek")["offset"] == len("".join(lines[:64 * 20]).encode())   # the split


def test_a_directory_resumed_mid_second_file_seeks_there_and_checks_the_files(tmp_path, graph_mode):
    """Batches span the files: the position is exactly where the next batch starts (in the second
    file); the resumed run opens neither file before it; it ends as the uninterrupted run. A position
    that does not fit the files (list, sizes, line start, another checkpoint) is refused with the reason."""
    import shutil
    lines = _lines(100 + 400 + 90)
    folder = tmp_path / "days"
    folder.mkdir()
    (folder / "a.txt").write_text("".join(lines[:100]))
    (folder / "b.txt").write_text("".join(lines[100:500]))
    (folder / "c.txt").write_text("".join(lines[500:]))
    once = _run(folder, tmp_path / "once")
    assert once["steps"] == 10 and once["rows"] == 590
    _run(folder, tmp_path / "ckpt", steps=3)
    position = _position(tmp_path / "ckpt")
    rows = 64 * position["batches"]
    assert position["source"] == 1 and 100 < rows < 500 and position["rows"] == rows - 100
    assert position["offset"] == len("".join(lines[100:rows]).encode())
    assert [f["name"] for f in position["files"]] == ["a.txt", "b.txt"]
    shutil.copytree(tmp_path / "ckpt", tmp_path / "probe")

    said = []
    seek = _run(folder, tmp_path / "ckpt", said)
    assert any("seeking to file 2 of 3 (%s), byte %d (line %d)" % (folder / "b.txt", position["offset"], rows - 100)
               in line for line in said), said
    assert seek["reader"]["files"] == 2 and seek["reader"]["lines"] == 590 - rows
    assert seek["steps"] == 10 and seek["rows"] == 590 - 64 * 3
    _same_final_checkpoint(tmp_path / "once", tmp_path / "ckpt")
    _positions_match_checkpoints(tmp_path / "ckpt")

    checkpoint = rb.latest_checkpoint(str(tmp_path / "probe"))
    sources = rb._data_sources("t", str(folder))

    def why(sources=sources, stops=None):
        found, reason = rb._input_resume_position(checkpoint, rb._CriteoInput(sources, BS, stops=stops))
        assert found is None
        return reason
    found, reason = rb._input_resume_position(checkpoint, rb._CriteoInput(sources, BS))
    assert reason is None and found == {k: position[k] for k in ("batches", "source", "offset", "lines", "rows")}
    assert "files up to the position changed" in why([str(folder / "0.txt")] + sources)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.txt").write_text("".join(lines[:99]))       # same name, another size
    assert "a.txt before the position changed size" in why([str(tmp_path / "other" / "a.txt")] + sources[1:])
    (tmp_path / "other" / "b.txt").write_text("x" + "".join(lines[100:500]))   # shifted by a byte
    assert "no line of b.txt starts at the recorded position" in why(sources[:1] + [str(tmp_path / "other" /
                                                                                        "b.txt")] + sources[2:])
    assert "past the held-out split" in why(stops=[None, 10, None])
    record = _position(tmp_path / "probe")
    record["step"] += 1
    with open(rb._input_position_path(checkpoint), "w") as fh:
        json.dump(record, fh)
    assert "belongs to another checkpoint (step %d, the checkpoint's %d)" % (record["step"], record["step"] - 1) \
        in why()
    with open(rb._input_position_path(checkpoint), "w") as fh:
        fh.write("{not json")
    assert "unreadable" in why()


def test_a_gz_file_resumes_by_seeking_and_a_truncated_file_falls_back_saying_why(tmp_path, graph_mode):
    """``.gz``: the resumed run seeks (decompressing up to the position, parsing nothing before it) and
    ends as the uninterrupted run. A file cut short before the position is not sought in: the run
    reads it again from its start, says why, and trains nothing past what the checkpoint had."""
    import shutil
    lines = _lines(64 * 12 + 30)
    path = tmp_path / "day.txt.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("".join(lines))
    once = _run(path, tmp_path / "once")
    _run(path, tmp_path / "ckpt", steps=4)
    position = _position(tmp_path / "ckpt")
    assert position["offset"] == len("".join(lines[:64 * position["batches"]]).encode())   # decompressed bytes
    shutil.copytree(tmp_path / "ckpt", tmp_path / "cut")
    said = []
    seek = _run(path, tmp_path / "ckpt", said)
    assert any("seeking to file 1 of 1" in line for line in said), said
    assert seek["reader"]["lines"] == 64 * 12 + 30 - 64 * position["batches"]
    assert seek["steps"] == once["steps"] == 13
    _same_final_checkpoint(tmp_path / "once", tmp_path / "ckpt")

    plain = tmp_path / "plain.txt"                   # a plain file, then cut short before the position
    plain.write_text("".join(lines))
    _run(plain, tmp_path / "plain", steps=4)
    position = _position(tmp_path / "plain")
    plain.write_text("".join(lines[:64 * 3 + 5]))
    said = []
    cut = _run(plain, tmp_path / "plain", said)
    assert any("read again and skipped, because the file plain.txt is shorter (%d bytes) than the recorded "
               "position (byte %d)" % (plain.stat().st_size, position["offset"]) in line for line in said), said
    # the whole (cut) file is parsed again and all of it skipped: only the batches the checkpoint had
    # prepared are trained, nothing of the file past the checkpoint's position
    assert cut["reader"]["lines"] == 64 * 3 + 5
    assert cut["steps"] == position["batches"] and cut["rows"] == 64 * (position["batches"] - 4)
