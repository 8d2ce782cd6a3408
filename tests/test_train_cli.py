"""python -m recboost train / serve-check: files, .gz, directories and pipes; holdout; resume; export.

Every count is checked against the lines the test wrote (the table's lookups are 26 per trained row);
models are compared bit for bit with a model trained on the same rows another way."""
import errno
import gzip
import inspect
import io
import json
import os
import re
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
    batch = next(iter(rb.CriteoReader(io.BytesIO("".join(lines).encode()), batch_size=len(lines))))
    return batch[0], batch[1]


def _predict(result, probe):
    return result["model"].predict(*probe).asnumpy()


@pytest.mark.slow
def test_a_directory_with_a_gz_file_and_stdin_train_on_exactly_the_lines_given(tmp_path, graph_mode, monkeypatch):
    """A directory (a plain file and a .gz, read in name order as one stream: batches span the
    files; a hidden file and Spark's markers left out; a malformed line counted and skipped) trains on every row once,
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
    (folder / "_SUCCESS").write_text("")                           # a Spark job's marker, and a part's checksum
    (folder / "_committed_123").write_text('{"added": ["day-1.txt"]}\n')
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


def test_a_job_called_from_python_leaves_mindspores_mode_as_the_caller_had_it(tmp_path, pynative):
    """train_job, serve_check and demo compile in GRAPH_MODE; called from Python they leave MindSpore's mode
    as they found it, whether they return or raise, and the model train_job returns runs in that mode."""
    import mindspore as ms
    path = tmp_path / "day.txt"
    lines = _lines(64 * 3)
    path.write_text("".join(lines))
    result = rb.train_job(str(path), batch_size=BS, export=str(tmp_path / "export"), **QUIET)
    assert ms.get_context("mode") == ms.PYNATIVE_MODE
    op_by_op = _predict(result, _probe(lines[:BS]))             # the returned model, op by op
    with pytest.raises(ValueError, match="'export' must be a new or empty directory"):
        rb.train_job(str(path), batch_size=BS, export=str(tmp_path / "export"), **QUIET)
    assert ms.get_context("mode") == ms.PYNATIVE_MODE
    assert rb.serve_check(str(tmp_path / "export"), str(path), batch_size=BS, printer=lambda l: None)["rows"] == len(lines)
    assert ms.get_context("mode") == ms.PYNATIVE_MODE
    with pytest.raises(ValueError, match="'model' of 'network' must be 'widedeep'"):
        rb.serve_check(str(tmp_path / "export"), str(path), model="deepfm", printer=lambda l: None)
    assert ms.get_context("mode") == ms.PYNATIVE_MODE
    assert rb.demo(steps=2, batch_size=BS, eval_batches=1, capacity=1 << 12, **QUIET)["steps"] == 2
    assert ms.get_context("mode") == ms.PYNATIVE_MODE
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        compiled = _predict(result, _probe(lines[:BS]))
        with pytest.raises(ValueError, match="'model'"):
            rb.demo(model="dlrm")
        assert ms.get_context("mode") == ms.GRAPH_MODE
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    np.testing.assert_allclose(op_by_op, compiled, rtol=1e-5, atol=1e-6)

def test_a_seed_mindspore_cannot_take_is_refused_naming_it(tmp_path):
    """--seed is MindSpore's global seed too: 0 to 2**32 - 1 (a larger one failed inside numpy, a negative
    one in MindSpore, neither naming --seed), refused before the input is opened."""
    for seed, expected in ((-1, "an int >= 0"), (2 ** 32, "an int <= 4294967295"),
                           (10 ** 23, "an int <= 4294967295")):
        with pytest.raises(ValueError, match=r"For 'recboost train', 'seed' must be %s, but got %d\.$" % (
                expected, seed)):
            rb.train_job(str(tmp_path / "nowhere.txt"), seed=seed, **QUIET)

def test_an_input_whose_every_line_is_malformed_is_bad_input(tmp_path, graph_mode, capsys, monkeypatch):
    """Not one line parsed (a --timestamp-column the file does not have, blank lines only): the job trained
    nothing and said done with exit 0; now it is a ValueError naming 'data', the lines and why they were
    skipped, exit code 2 from the command. A file with some good lines trains on them as before."""
    path = tmp_path / "day.txt"
    lines = _lines(96)
    path.write_text("".join(lines))
    with pytest.raises(ValueError, match=r"For 'recboost train', 'data' must be Criteo-format lines .*, but got "
                                         r"\"96 lines, every one malformed: \{'field_count': 96\}\"\.$"):
        rb.train_job(str(path), batch_size=BS, timestamp_column=1, **QUIET)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n" * 10)
    with pytest.raises(SystemExit) as exited:
        rb.main(["train", "--data", str(blank), "--batch-size", str(BS), "--progress-seconds", "1000"])
    assert exited.value.code == 2 and "10 lines, every one malformed" in capsys.readouterr().err
    blank.write_text("")                # an empty input: exit 0 and "done: 0 rows trained" before
    with pytest.raises(ValueError, match=r"'data' must be Criteo-format lines .*, but got \"'.*blank.txt', of "
                                         r"empty files only \(nothing trained or written\)\"\.$"):
        rb.train_job(str(blank), batch_size=BS, checkpoint_dir=str(tmp_path / "ckpt"), **QUIET)
    assert not (tmp_path / "ckpt").exists()            # refused before a checkpoint or a config is written

    class Stdin:                        # standard input that ends at once: known only once read
        buffer = io.BytesIO(b"")
    monkeypatch.setattr(sys, "stdin", Stdin)
    with pytest.raises(ValueError, match=r"'data' must be Criteo-format lines .*, but got 'an input with no line'\.$"):
        rb.train_job("-", batch_size=BS, **QUIET)
    path.write_text("".join(lines[:64]) + "\n" * 3)
    assert rb.train_job(str(path), batch_size=BS, **QUIET)["rows"] == 64


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_model_bit_for_bit(tmp_path, request, graph_mode, capsys):
    """``kill -9`` in the middle of a file, then the same command again: the final checkpoint and the
    served export chain are those of an uninterrupted run, bit for bit. The file is first a named
    pipe fed half its lines (so the kill lands mid-file for sure), then the whole file at that path: the
    resume proves and seeks in it by the position the pipe's checkpoint carries."""
    lines = _lines(64 * 50)
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "day.txt").write_text("".join(lines))
    # the uninterrupted run goes on beside the killed one (its own directories); waited for below
    uninterrupted = subprocess.Popen(_train_cmd(whole / "day.txt", whole / "ckpt", whole / "export"), cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    request.addfinalizer(lambda: uninterrupted.poll() is None and uninterrupted.kill())

    cut = tmp_path / "cut"
    cut.mkdir()
    data = cut / "day.txt"
    os.mkfifo(data)
    proc = subprocess.Popen(_train_cmd(data, cut / "ckpt", cut / "export", "--resume-by-count"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)     # (a pipe: refused without it)
    try:
        with open(data, "w") as pipe:
            pipe.write("".join(lines[:64 * 25 + 10]))
            pipe.flush()
            deadline = time.time() + 300
            while not os.path.exists(cut / "ckpt" / "recboost-20.npz") and time.time() < deadline:
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                time.sleep(0.2)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert rb.latest_checkpoint(str(cut / "ckpt")).endswith("recboost-20.npz")
    position = _position(cut / "ckpt")                 # carried inside the checkpoint, written with it at once
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

    stderr = uninterrupted.communicate(timeout=600)[1]
    assert uninterrupted.returncode == 0, stderr[-3000:]
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

    # the same directory with another setting: refused, naming it, before anything is trained (the same
    # command's entry point, rb.main, in this process: exit 2 is its SystemExit(2); a traceback fails the test)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        rb.main(_train_cmd(data, cut / "ckpt", cut / "export", "--lr", "0.01")[3:])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert "learning_rate: 0.001 recorded, 0.01 now" in err
    assert rb.latest_checkpoint(str(cut / "ckpt")).endswith("recboost-50.npz")


@pytest.mark.slow
def test_serve_check_scores_with_the_export_chain_as_the_model_does(tmp_path, graph_mode, capsys):
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
    # the bundles record the network: a Wide&Deep export scored as DeepFM (the same parameters) is refused,
    # whether --model says so or a train-config.json edited with its checksum made again
    bundle = re.escape(repr(str(tmp_path / "export" / "bundle-000000008")))
    refused = (r"For 'Predictor', the setting 'model' of 'network' must be 'widedeep' like the bundle %s "
               r"\('directory'\), but got 'deepfm'\.$" % bundle)
    with pytest.raises(ValueError, match=refused):
        rb.serve_check(str(tmp_path / "export"), str(path), batch_size=BS, model="deepfm", printer=lambda l: None)
    with pytest.raises(SystemExit) as exited:                 # the command: exit code 2, the message, no traceback
        rb.main(["serve-check", str(tmp_path / "export"), "--data", str(path), "--batch-size", str(BS),
                 "--model", "deepfm"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert re.search("^python -m recboost serve-check: " + refused[:-1], err, re.M), err
    config_path = tmp_path / "export" / "train-config.json"
    config = json.loads(config_path.read_text())
    assert config.pop("sha256") and config["model"] == "widedeep"
    config_path.write_bytes(rb._json_checked_bytes(dict(config, model="deepfm")))
    with pytest.raises(ValueError, match=refused):
        rb.serve_check(str(tmp_path / "export"), str(path), batch_size=BS, printer=lambda l: None)
    # an edit without the checksum: the file is refused, named
    config_path.write_text(json.dumps(dict(config, model="deepfm", sha256="0" * 64)))
    with pytest.raises(ValueError, match=r"For 'recboost serve-check', the job settings %s is damaged or was edited: "
                                         r"its content's sha256 is [0-9a-f]{64} but the file records 0{64}; "
                                         r"recboost refuses to use it\.$" % re.escape(repr(str(config_path)))):
        rb.serve_check(str(tmp_path / "export"), str(path), batch_size=BS, printer=lambda l: None)


@pytest.mark.slow
def test_a_failed_export_is_logged_and_retried_while_the_job_trains_on(tmp_path, graph_mode, monkeypatch):
    """``train --export``: the first bundle (step 3) hits a full disk; the job trains to its end, logs the
    failure naming the bundle, the file and the bytes, exports a full bundle at step 6 and a delta at 8,
    and the chain serves as the model scores."""
    lines = _lines(64 * 7 + 5)
    path = tmp_path / "day.txt"
    path.write_text("".join(lines))
    logged, printed, calls = [], [], []
    monkeypatch.setattr(rb, "_log", logged.append)
    real = rb._HashingWriter.write

    def write(self, data):
        calls.append(self.fh.name)
        if len(calls) == 1:                          # the first bytes of the first bundle
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)
    monkeypatch.setattr(rb._HashingWriter, "write", write)
    export = tmp_path / "export"
    result = rb.train_job(str(path), batch_size=BS, export=str(export), export_every=3, progress_seconds=1e9,
                          printer=printed.append)
    assert result["steps"] == 8 and result["rows"] == len(lines)
    assert sorted(os.listdir(export)) == ["bundle-000000006", "bundle-000000008", "train-config.json"]
    assert result["exports"] == [str(export / "bundle-000000006"), str(export / "bundle-000000008")]
    (failure,) = result["export_failures"]
    assert failure["step"] == 3 and failure["path"] == str(export / "bundle-000000003")
    assert re.fullmatch(r"\[Errno 28\] No space left on device: writing \d+ bytes to '%s/\.tmp-\d+-[0-9a-f]+\.bundle/"
                        r"table-0-ids\.npy': the bundle '%s' was not written \(nothing of it is left\)" % (
                            re.escape(str(export)), re.escape(failure["path"])), failure["error"]), failure["error"]
    assert [line for line in logged if "FAILED" in line] == [
        "OnlineExport: EXPORTING THE BUNDLE %s FAILED at step 3 (OSError: %s); nothing of it is left, training goes "
        "on, the next export point tries again (a full bundle); 1 failed export(s) so far" % (failure["path"],
                                                                                            failure["error"])]
    assert printed[-1] == ("1 EXPORT(S) FAILED, at step(s) [3] (logged above; each retried at the next export "
                           "point); the newest bundle is %s" % (export / "bundle-000000008"))
    kinds = [json.load(open(export / n / "manifest.json"))["kind"] for n in ("bundle-000000006", "bundle-000000008")]
    assert kinds == ["full", "delta"]
    served = rb.serve_check(str(export), str(path), batch_size=BS, printer=lambda l: None)
    model = result["model"]
    own = rb._score_input(lambda d, i: model.predict(d, i).asnumpy(), rb.CriteoReader(str(path), batch_size=BS))
    assert served["step"] == 8 and (served["auc"], served["log_loss"]) == (own["auc"], own["log_loss"])


_CONFIG = {"timestamp_column": None, "data": "/data/day.txt", "model": "widedeep", "batch_size": 64,
           "capacity": 1 << 20, "access_threshold": 1, "eviction_threshold": -1, "eviction_policy": None,
           "growth": True, "learning_rate": 1e-3, "seed": 0, "boost_level": "O0", "amp_level": "O0", "holdout": 0,
           "admission_counter": None}


def _flip_byte(data, at):
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]


# train-config.json spoiled: (case, content from the good file's bytes, message after "For 'recboost train', ")
JOB_CONFIG_CASES = [
    ("null", lambda good: b"null", r"the job settings {path} is damaged or was edited: it holds a JSON NoneType, "
                                   r"not an object; recboost refuses to use it\. {hint}$"),
    ("list", lambda good: b"[]", r"the job settings {path} is damaged or was edited: it holds a JSON list, not an "
                                 r"object; recboost refuses to use it\. {hint}$"),
    ("flipped_byte", lambda good: _flip_byte(good, good.index(b'"model"') + 12),
     r"the job settings {path} is damaged or was edited: its content's sha256 is [0-9a-f]{{64}} but the file records "
     r"[0-9a-f]{{64}}; recboost refuses to use it\. {hint}$"),
    ("cut", lambda good: good[:len(good) // 2],
     r"the job settings {path} is damaged or was edited: it is not valid UTF-8 JSON \(JSONDecodeError: .*\); "
     r"recboost refuses to use it\. {hint}$"),
    ("hand_edit", lambda good: good.replace(b'"batch_size": 64', b'"batch_size": 128'),
     r"the job settings {path} is damaged or was edited: its content's sha256 is [0-9a-f]{{64}} but the file records "
     r"[0-9a-f]{{64}}; recboost refuses to use it\. {hint}$"),
    ("no_checksum", lambda good: json.dumps(_CONFIG).encode(),
     r"the job settings {path} is damaged or was edited: it has no 'sha256' checksum field \(written by an older "
     r"recboost, or by hand\); recboost refuses to use it\. {hint}$"),
    ("wrong_type", lambda good: rb._json_checked_bytes(dict(_CONFIG, batch_size="64")),
     r"the field 'batch_size' of the job settings {path} must be an int, but got '64'\. {hint}$"),
    ("bad_value", lambda good: rb._json_checked_bytes(dict(_CONFIG, model="dcn")),
     r"the field 'model' of the job settings {path} must be one of \['widedeep', 'deepfm'\], but got 'dcn'\. "
     r"{hint}$"),
    ("missing_field", lambda good: rb._json_checked_bytes({k: v for k, v in _CONFIG.items() if k != "seed"}),
     r"the field 'seed' of the job settings {path} must be an int >= 0 and <= 4294967295, but got 'missing'\. "
     r"{hint}$"),
    ("another_setting", lambda good: rb._json_checked_bytes(dict(_CONFIG, learning_rate=0.01)),
     r"the settings of a run resuming from {folder} must be those it was started with \({plain}; use another "
     r"--checkpoint-dir to start afresh\), but got 'learning_rate: 0.01 recorded, 0.001 now'\.$"),
]


@pytest.mark.parametrize("case,spoil,message", JOB_CONFIG_CASES, ids=[c[0] for c in JOB_CONFIG_CASES])
def test_a_spoiled_train_config_is_one_error_naming_the_file(tmp_path, case, spoil, message):
    """Written with its checksum and read through its schema: null, [], a flipped byte, a cut, a hand edit,
    no checksum, a wrong type or value, a missing field, another setting: each one ValueError naming the
    file (serve-check reads it the same way)."""
    folder = str(tmp_path / "ckpt")
    rb._job_config_write(folder, dict(_CONFIG))
    path = os.path.join(folder, "train-config.json")
    rb._job_config_check("recboost train", folder, dict(_CONFIG))          # as written: the same settings
    with open(path, "rb") as fh:
        good = fh.read()
    assert json.loads(good) == dict(_CONFIG, sha256=json.loads(good)["sha256"])
    with open(path, "wb") as fh:
        fh.write(spoil(good))
    pattern = message.format(path=re.escape(repr(path)), folder=re.escape(repr(folder)), plain=re.escape(path),
                             hint=re.escape("To change a setting, start afresh with another --checkpoint-dir."))
    with pytest.raises(ValueError, match=r"^For 'recboost train', " + pattern):
        rb._job_config_check("recboost train", folder, dict(_CONFIG))
    if case != "another_setting":
        with pytest.raises(ValueError, match=r"^For 'recboost serve-check', .*%s" % re.escape(repr(path))):
            rb.serve_check(folder, os.path.join(folder, "nothing.txt"), printer=lambda l: None)


def test_the_job_settings_are_checked_once_before_anything_is_read_from_the_keywords_and_the_options(
        tmp_path, capsys):
    """train_job's keywords and the command line's options are one declaration: each checked by its rule
    before the input is opened (the data here does not exist: its error would come first otherwise), an
    unknown keyword named in recboost's error form, and the options exactly the keywords."""
    missing = str(tmp_path / "missing.txt")
    cases = [(dict(capacity=2), TypeError, ValueError, r"'capacity' must be an int >= 3, but got 2\."),
             (dict(learning_rate=float("nan")), ValueError, r"'learning_rate' must be a finite number > 0, but got nan"),
             (dict(learning_rate=-1.0), ValueError, r"'learning_rate' must be a finite number > 0, but got -1\.0"),
             (dict(growth=1), TypeError, r"'growth' must be a bool, but got 1"),
             (dict(holdout=-1), ValueError, r"'holdout' must be an int >= 0 or 'file', but got -1"),
             (dict(windw=5), TypeError, r"the keyword 'windw' must be one of \['access_threshold', 'admission_counter'")]
    for options, *kinds, message in cases:
        with pytest.raises(tuple(kinds), match=r"^For 'recboost train', " + message):
            rb.train_job(missing, **QUIET, **options)
    with pytest.raises(SystemExit) as stop:
        rb.main(["train", "--data", missing, "--capacity", "2"])
    assert stop.value.code == 2 and "'capacity' must be an int >= 3" in capsys.readouterr().err
    keywords = set(inspect.signature(rb.train_job).parameters) - {"printer"}
    with pytest.raises(SystemExit):
        rb.main(["train", "--help"])
    text = capsys.readouterr().out
    flags = set(re.findall(r"^  (--[a-z-]+)", text, re.M)) - {"--help"}
    renamed = {"--lr": "learning_rate", "--no-growth": "growth"}
    assert {renamed.get(f, f[2:].replace("-", "_")) for f in flags} == keywords
    assert "hash table:\n  --capacity" in text          # the table's options: their own group


def test_the_table_options_are_checked_by_table_configs_own_rules(tmp_path, graph_mode, capsys):
    """The hash table's options (train_job's keywords, the command line's options, train-config.json's
    fields) have no rules of their own: each is refused exactly as TableConfig refuses its field (the
    same expected value, named as the job names it), before the input is opened; the table itself is
    made from a TableConfig, so demo's bad table settings are named for the job as well."""
    missing = str(tmp_path / "missing.txt")
    bad = {"capacity": 2, "access_threshold": -2, "eviction_threshold": 2 ** 62 + 1, "eviction_policy": "fifo",
           "admission_counter": "bloom", "growth": 1}
    for name, value in bad.items():
        field = "use_dynamic_expansion" if name == "growth" else name
        with pytest.raises((TypeError, ValueError)) as table:
            rb.TableConfig(**dict({"embedding_size": 4, "capacity": 10}, **{field: value}))
        with pytest.raises(type(table.value)) as job:
            rb.train_job(missing, **QUIET, **{name: value})
        assert str(job.value) == str(table.value).replace("For 'TableConfig', '%s'" % field,
                                                          "For 'recboost train', '%s'" % name)
    with pytest.raises(SystemExit) as stop:
        rb.main(["train", "--data", missing, "--access-threshold", "-2"])
    assert stop.value.code == 2 and "'access_threshold' must be an int >= -1, but got -2." in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^For 'recboost demo', 'capacity' must be an int >= 3, but got 2\.$"):
        rb.demo(capacity=2, **QUIET)
    with pytest.raises(ValueError, match=r"^For 'recboost demo', 'eviction_threshold' must be an int >= -1, "):
        rb.demo(eviction_threshold=-5, **QUIET)


@pytest.mark.slow
def test_train_config_is_the_recorded_settings_as_the_previous_version_wrote_it(tmp_path, graph_mode):
    """train-config.json holds exactly the settings a resume must share, as the version before
    _JobSettings wrote them (``_CONFIG``: that version's fields; the file is canonical JSON with its
    checksum, so the bytes are that version's), and the directory resumes and trains on."""
    path = tmp_path / "day.txt"
    path.write_text("".join(_lines(64 * 6)))
    rb.train_job(str(path), batch_size=BS, steps=2, checkpoint_dir=str(tmp_path / "ckpt"), **QUIET)
    config = tmp_path / "ckpt" / "train-config.json"
    recorded = json.loads(config.read_text())
    del recorded["sha256"]
    assert recorded == dict(_CONFIG, data=str(path))
    resumed = rb.train_job(str(path), batch_size=BS, steps=4, checkpoint_dir=str(tmp_path / "ckpt"), **QUIET)
    assert resumed["resumed_from"].endswith("recboost-2.npz") and resumed["steps"] == 4


def test_bad_input_ends_with_exit_2_and_a_message_naming_it(tmp_path, graph_mode, capsys, monkeypatch):
    """``python -m recboost`` once as a process (its exit code and stderr), then the same entry point,
    ``rb.main``, in this process: an exit 2 is its SystemExit(2), and anything but an exit (a traceback)
    fails the test as it would fail the process's."""
    out = subprocess.run([sys.executable, "-m", "recboost", "train", "--data", str(tmp_path / "missing.txt")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "missing.txt" in out.stderr

    def run(*args):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            rb.main(list(args))
        return stop.value.code, capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    code, err = run("train", "--data", str(tmp_path / "empty"))
    assert code == 2 and "holds none" in err

    class Stdin:                                               # an empty standard input
        buffer = io.BytesIO(b"")
    monkeypatch.setattr(sys, "stdin", Stdin)
    code, err = run("train", "--data", "-", "--holdout", "2")
    assert code == 2 and "standard input" in err
    cut = tmp_path / "cut.txt.gz"                              # a .gz cut short: named, with where it stops
    with gzip.open(cut, "wt") as fh:
        fh.write("".join(_lines(600)))
    cut.write_bytes(cut.read_bytes()[:-2000])
    code, err = run("train", "--data", str(cut), "--batch-size", "64")
    assert code == 2 and "cut.txt.gz" in err and "cut short" in err
    code, err = run("serve-check", str(tmp_path / "empty"), "--data", str(cut))
    assert code == 2 and "'model' must be given" in err
    data = tmp_path / "day.txt"                                # an export path that is no directory
    data.write_text("".join(_lines(BS)))
    (tmp_path / "regular").write_text("")
    for export, expected in ((tmp_path / "regular", "a directory, but got '%s, which is a file'"),
                             (tmp_path / "regular" / "sub", "a path whose existing part is a directory, but got "
                                                            "'%s (" + str(tmp_path / "regular") + " is a file)'")):
        code, err = run("train", "--data", str(data), "--batch-size", str(BS), "--export", str(export))
        assert code == 2 and "'export' must be " + expected % export in err, err


def _with_time(lines, times, column=1):
    """``lines`` with the integer ``times`` inserted as tab-separated column ``column``."""
    out = []
    for line, t in zip(lines, times):
        fields = line.rstrip("\n").split("\t")
        out.append("\t".join(fields[:column] + [str(t)] + fields[column:]) + "\n")
    return out


@pytest.mark.slow
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
    net, table = rb._job_network("widedeep", 0, 1e-3, {"capacity": 1 << 16, "access_threshold": 1})
    assert table.config == rb.TableConfig(17, 1 << 16, access_threshold=1, use_dynamic_expansion=True,
                                          optimizer=rb.SparseAdam(1e-3), name="ids")
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


@pytest.mark.slow
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
            return _run("-", tmp_path / "ckpt", said, **kwargs)          # a 16K-row table: small checkpoints
        finally:
            Stdin.buffer.close()
    assert feed(first)["steps"] == 5
    resumed = feed(rest)
    assert any("standard input is taken as the rows that follow the 5 batches of 64 rows (320 rows) the "
               "checkpoint consumed" in line for line in said), said
    assert any("320 rows had been trained before it" in line for line in said)
    assert resumed["steps"] == 8 and resumed["rows"] == 64 * 3
    once = rb.train_job(str(whole), batch_size=BS, eviction_threshold=3, capacity=1 << 14, **QUIET)
    probe = _probe(lines[:40])
    np.testing.assert_array_equal(_predict(resumed, probe).view(np.uint32), _predict(once, probe).view(np.uint32))

    # stopped mid-stream: the checkpoint keeps the batches the prefetcher had taken, to replay; the
    # rows to feed are those after every consumed batch, as the log says, not after the trained rows
    # (the old log said only "192 rows had been trained": fed after them, 2 batches trained twice)
    import shutil
    shutil.rmtree(tmp_path / "ckpt")
    said.clear()
    assert feed(whole, steps=3)["steps"] == 3
    manifest = rb._checkpoint_file_manifest(rb.latest_checkpoint(str(tmp_path / "ckpt")))
    consumed = manifest["taken"] - manifest["stream_start"]
    assert consumed > 3 and manifest["samples"] == 3 * BS          # batches kept to replay
    (tmp_path / "rest2.txt").write_text("".join(lines[64 * consumed:]))
    said.clear()
    resumed = feed(tmp_path / "rest2.txt")
    assert any("the %d batches of 64 rows (%d rows) the checkpoint consumed" % (consumed, 64 * consumed) in line
               for line in said), said
    assert resumed["steps"] == 8
    np.testing.assert_array_equal(_predict(resumed, probe).view(np.uint32), _predict(once, probe).view(np.uint32))


# ---- resume seeks: the position recorded with each checkpoint --------------------------------------------
def _run(data, ckpt, said=None, **kwargs):
    """``train_job`` with checkpoints every 2 steps in ``ckpt`` (eviction on: its schedule is state too),
    on a table of 16K rows (more than these files' ids; the default 1M rows would make every checkpoint
    ~200 MB and the position fuzz, which writes one 300 times, take minutes)."""
    kwargs.setdefault("capacity", 1 << 14)
    return rb.train_job(str(data), batch_size=BS, checkpoint_dir=str(ckpt), checkpoint_every=2,
                        eviction_threshold=3, progress_seconds=1e9,
                        printer=(said.append if said is not None else lambda line: None), **kwargs)


def _position(ckpt):
    """The input position the latest checkpoint of ``ckpt`` carries (its manifest's field "extra")."""
    return rb._checkpoint_file_manifest(rb.latest_checkpoint(str(ckpt)))["extra"]


def _with_extra(path, extra):
    """Write the checkpoint ``path`` again, whole and valid (its checksums made again, as a tamperer
    could), carrying ``extra`` as its position (None: none, as a checkpoint whose position could not be
    found, or one of a version that wrote the position beside it)."""
    manifest, arrays = rb._read_checkpoint_file(path)
    manifest = {k: v for k, v in manifest.items() if k not in ("members", "sha256", "extra")}
    if extra is not None:
        manifest["extra"] = extra
    with open(path, "wb") as fh:
        rb._write_checkpoint_file(fh, manifest, arrays)


def _same_final_checkpoint(*dirs):
    """The latest checkpoints of ``dirs`` hold the same manifest (but the run id) and arrays, bit for bit."""
    want_manifest, want = _checkpoint_arrays(rb.latest_checkpoint(str(dirs[0])))
    for d in dirs[1:]:
        got_manifest, got = _checkpoint_arrays(rb.latest_checkpoint(str(d)))
        assert got_manifest == want_manifest and sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _positions_match_checkpoints(ckpt):
    """Every checkpoint carries its position, and no side file is written beside it."""
    names = os.listdir(ckpt)
    checkpoints = [n for n in names if n.endswith(".npz")]
    assert checkpoints and not [n for n in names if n.endswith(".json") and n != "train-config.json"]
    for name in checkpoints:
        assert rb._checkpoint_file_manifest(str(ckpt / name))["extra"]["format"] == 3, name


@pytest.mark.slow
def test_a_resumed_run_seeks_in_its_file_and_ends_as_a_rereading_resume_and_an_uninterrupted_run(tmp_path,
                                                                                               graph_mode, capsys):
    """A file (with one batch held out): the resumed run parses only the lines after the recorded
    position; its final checkpoint is bit for bit that of a resume that re-reads the file (the position
    removed from every checkpoint: refused unless resume_by_count, it cannot be proven) and of an
    uninterrupted run."""
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
    assert 7 <= batches < 20 and position["source"] == 0
    assert rb.latest_checkpoint(str(tmp_path / "seek")).endswith("recboost-7.npz")
    assert position["lines"] == position["rows"] == 64 * batches
    assert position["offset"] == len("".join(lines[:64 * batches]).encode())
    shutil.copytree(tmp_path / "seek", tmp_path / "reread")
    for name in os.listdir(tmp_path / "reread"):                    # no checkpoint has its position
        if name.endswith(".npz"):
            _with_extra(str(tmp_path / "reread" / name), None)
    shutil.copytree(tmp_path / "seek", tmp_path / "older")          # the newest one could not find its position
    _with_extra(rb.latest_checkpoint(str(tmp_path / "older")), None)

    said = []
    seek = _run(path, tmp_path / "seek", said, holdout=1)
    assert any("seeking to file 1 of 1 (%s), byte %d (line %d): the %d batches already trained are not read again"
               % (path, position["offset"], 64 * batches, batches) in line for line in said), said
    assert seek["reader"]["lines"] == 64 * (20 - batches)           # only the rest is parsed
    assert seek["steps"] == 20 and seek["rows"] == 64 * 13 and seek["held_out"] == once["held_out"]

    with pytest.raises(ValueError, match="the resume from '%s' must be proven to continue the input it was "
                       "trained on, by the input position it carries; if you know the input is unchanged, run again with "
                       "--resume-by-count" % rb.latest_checkpoint(str(tmp_path / "reread"))):
        _run(path, tmp_path / "reread", holdout=1)
    said = []
    reread = _run(path, tmp_path / "reread", said, holdout=1, resume_by_count=True)
    assert any("read again and skipped by their count, UNPROVEN (--resume-by-count), because the checkpoint has "
               "no recorded input position" in line for line in said), said
    assert reread["reader"]["lines"] == 64 * 20                     # it parses it all again
    assert reread["steps"] == 20 and reread["held_out"] == once["held_out"]

    said = []
    capsys.readouterr()
    older = _run(path, tmp_path / "older", said, holdout=1)        # the newest checkpoint with its position
    logged = capsys.readouterr().err
    assert any("the newest checkpoint %s carries no input position" % (tmp_path / "older" / "recboost-7.npz")
               in line and "resuming from %s, the newest one with its position" % (tmp_path / "older" /
                                                                                  "recboost-6.npz") in line
               for line in said), said
    assert older["resumed_from"] == str(tmp_path / "older" / "recboost-6.npz") and older["steps"] == 20
    assert any("removing the checkpoints after step 6, which carry no input position (their steps are trained "
               "again): recboost-7.npz" in line for line in logged.splitlines()), logged   # (issue 61 item 2)
    _same_final_checkpoint(tmp_path / "once", tmp_path / "seek", tmp_path / "reread", tmp_path / "older")
    for d in ("once", "seek", "reread", "older"):
        _positions_match_checkpoints(tmp_path / d)
    assert _position(tmp_path / "seek")["offset"] == len("".join(lines[:64 * 20]).encode())   # the split


@pytest.mark.slow
def test_a_directory_resumed_mid_second_file_seeks_there_and_checks_the_files(tmp_path, graph_mode, stopped_dir):
    """Batches span the files: the position is exactly where the next batch starts (in the second
    file); the resumed run opens neither file before it; it ends as the uninterrupted run. A position
    that does not fit the files (list, sizes, content, the held-out split, another checkpoint) is
    refused, naming the file and how it differs. (The files and the run stopped at step 3: the module's
    ``stopped_dir``, copied.)"""
    import shutil
    base, lines, position = stopped_dir
    folder = base / "days"
    once = _run(folder, tmp_path / "once")
    assert once["steps"] == 10 and once["rows"] == 590
    shutil.copytree(base / "ckpt", tmp_path / "ckpt")
    rows = 64 * position["batches"]
    assert position["source"] == 1 and 100 < rows < 500 and position["rows"] == rows - 100
    assert position["offset"] == len("".join(lines[100:rows]).encode())
    assert [f["name"] for f in position["files"]] == ["b.txt", "c.txt"]
    shutil.copytree(tmp_path / "ckpt", tmp_path / "probe")

    said = []
    seek = _run(folder, tmp_path / "ckpt", said)
    assert any("seeking to file 2 of 3 (%s), byte %d (line %d)" % (folder / "c.txt", position["offset"], rows - 100)
               in line for line in said), said
    assert seek["reader"]["files"] == 2 and seek["reader"]["lines"] == 590 - rows
    assert seek["steps"] == 10 and seek["rows"] == 590 - 64 * 3
    _same_final_checkpoint(tmp_path / "once", tmp_path / "ckpt")
    _positions_match_checkpoints(tmp_path / "ckpt")

    checkpoint = rb.latest_checkpoint(str(tmp_path / "probe"))
    sources = rb._data_sources("t", str(folder))

    def refused(match, sources=sources, stops=None):
        with pytest.raises(ValueError, match=match):
            rb._input_resume_position(checkpoint, rb._CriteoInput(sources, BS, stops=stops, digests=True))
    found, reason = rb._input_resume_position(checkpoint, rb._CriteoInput(sources, BS, digests=True))
    assert reason is None and {k: found[k] for k in ("batches", "source", "offset", "lines", "rows")} == \
        {k: position[k] for k in ("batches", "source", "offset", "lines", "rows")}
    assert found["done"] == position["files"][:1] and found["done"][0]["rows"] == 100
    refused("the file 0.txt was added before the position", [str(folder / "0.txt")] + sources)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "b.txt").write_text("".join(lines[:99]))       # same name, another size
    refused("the file b.txt changed size: %d bytes when it was read, %d now" % (
        (folder / "b.txt").stat().st_size, (tmp_path / "other" / "b.txt").stat().st_size),
        [str(tmp_path / "other" / "b.txt")] + sources[1:])
    (tmp_path / "other" / "c.txt").write_text("x" + "".join(lines[100:500]))   # shifted by a byte
    refused("the file c.txt was edited", sources[:1] + [str(tmp_path / "other" / "c.txt")] + sources[2:])
    refused("the file c.txt is cut by the held-out split at byte 10", stops=[None, 10, None])
    record = _position(tmp_path / "probe")
    record["batches"] += 1                                   # a valid checkpoint, carrying a position of another
    _with_extra(checkpoint, record)
    refused(r"the field 'extra.batches' of the checkpoint '%s' must be the checkpoint's taken - stream_start = %d, "
            r"but got %d" % (checkpoint, record["batches"] - 1, record["batches"]))
    data = bytearray(open(checkpoint, "rb").read())
    data[data.index(b'"offset": ') + len(b'"offset": ')] ^= 1         # a byte of the manifest: the zip's CRC-32 tells
    open(checkpoint, "wb").write(bytes(data))
    refused(r"The checkpoint '%s' cannot be read \(its member 'manifest.npy' is damaged" % checkpoint)


@pytest.mark.slow
def test_a_gz_file_resumes_by_seeking_and_a_truncated_file_is_refused_naming_it(tmp_path, graph_mode):
    """``.gz``: the resumed run seeks (decompressing up to the position, parsing nothing before it) and
    ends as the uninterrupted run. A file cut short before the position is refused, naming it, and
    nothing is trained."""
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
    latest = rb.latest_checkpoint(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="the file plain.txt is shorter than when it was read: %d bytes were read, "
                       "it holds %d now" % (len("".join(lines).encode()), plain.stat().st_size)):
        _run(plain, tmp_path / "plain")
    assert rb.latest_checkpoint(str(tmp_path / "plain")) == latest and position == _position(tmp_path / "plain")


# ---- a resume proves its input (issue #35) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def stopped_dir(tmp_path_factory):
    """A directory of three files (b.txt 100 lines, c.txt 400, d.txt 90) and the checkpoint directory of
    a run of it stopped at step 3: its position is in c.txt. Tests copy what they change."""
    import mindspore as ms
    base = tmp_path_factory.mktemp("stopped")
    lines = _lines(590)
    folder = base / "days"
    folder.mkdir()
    for name, part in (("b.txt", lines[:100]), ("c.txt", lines[100:500]), ("d.txt", lines[500:])):
        (folder / name).write_text("".join(part))
    old = ms.get_context("mode")
    try:
        _run(folder, base / "ckpt", steps=3)
    finally:
        ms.set_context(mode=old)
    position = _position(base / "ckpt")
    assert position["source"] == 1 and 100 < 64 * position["batches"] < 500
    return base, lines, position


def _prove(ckpt, sources, stops=None):
    """The position of the latest checkpoint of ``ckpt`` proven against the files ``sources``."""
    return rb._input_resume_position(rb.latest_checkpoint(str(ckpt)),
                                     rb._CriteoInput([str(s) for s in sources], BS, stops=stops, digests=True))


def test_a_file_inserted_before_the_position_is_refused_naming_it_and_nothing_trains(tmp_path, graph_mode,
                                                                                      capsys):
    """The issue's case: a run of a directory stopped, then a file that sorts before the position added.
    The old resume re-read the new file order and skipped a count of batches (the new file's rows never
    trained, a later file's trained twice, exit 0). Now: exit 2 naming the file, nothing trained;
    with the file gone again the proof holds."""
    lines = _lines(590)
    folder = tmp_path / "days"
    folder.mkdir()
    (folder / "day-02.txt").write_text("".join(lines[:500]))
    (folder / "day-03.txt").write_text("".join(lines[500:]))
    _run(folder, tmp_path / "ckpt", steps=3)
    latest, position = rb.latest_checkpoint(str(tmp_path / "ckpt")), _position(tmp_path / "ckpt")
    assert position["source"] == 0
    (folder / "day-01.txt").write_text("".join(_lines(128, seed=7)))
    cmd = ["train", "--data", str(folder), "--batch-size", str(BS), "--checkpoint-dir", str(tmp_path / "ckpt"),
           "--checkpoint-every", "2", "--eviction-threshold", "3", "--progress-seconds", "1000",
           "--capacity", str(1 << 14)]                                          # _run's table
    with pytest.raises(SystemExit) as exit_:
        rb.main(cmd)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert "must be the input that checkpoint was trained on, unchanged up to its position" in err
    assert "the file day-01.txt was added before the position (it comes before day-02.txt, which had been " \
           "read)" in err
    assert rb.latest_checkpoint(str(tmp_path / "ckpt")) == latest and _position(tmp_path / "ckpt") == position
    os.unlink(folder / "day-01.txt")
    found, reason = _prove(tmp_path / "ckpt", sorted(folder.iterdir()))
    assert reason is None and found["offset"] == position["offset"]


def test_a_file_removed_replaced_or_edited_before_the_position_is_refused_naming_it(tmp_path, stopped_dir):
    """Each change to the files up to the position is refused, naming the file and how it changed; a
    file after the position, and lines appended to the position's file, may change (not yet read)."""
    base, lines, position = stopped_dir
    ckpt = base / "ckpt"
    folder = base / "days"
    b, c, d = (folder / n for n in ("b.txt", "c.txt", "d.txt"))
    found, reason = _prove(ckpt, [b, c, d])
    assert reason is None and found["offset"] == position["offset"] and found["lines"] == position["lines"]
    assert [f["name"] for f in found["done"]] == ["b.txt"] and found["done"][0]["rows"] == 100

    def variant(name, text):
        path = tmp_path / name
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return path
    with pytest.raises(ValueError, match=r"the file b.txt read before the position, was removed or renamed "
                                         r"\(c.txt is in its place now\)"):
        _prove(ckpt, [c, d])
    with pytest.raises(ValueError, match=r"the file c.txt read before the position, was removed \(the input has 1 "):
        _prove(ckpt, [b])
    with pytest.raises(ValueError, match="the file b.txt read before the position, is now file 2 in reading order"):
        _prove(ckpt, [c, b, d])
    # b.txt replaced by another file of the same size: its lines in another order
    same_size = variant("b.txt", "".join(lines[50:100] + lines[:50]))
    assert same_size.stat().st_size == b.stat().st_size
    with pytest.raises(ValueError, match="the file b.txt was edited: its first %d bytes have the blake2b-256 "
                                         "digest" % b.stat().st_size):
        _prove(ckpt, [same_size, c, d])
    # the position's own file edited before the position: one hex digit of its first line, same size
    text = c.read_text()
    at = text.index("\t", text.index("\t") + 1) + 1          # the first dense value
    edited = variant("c.txt", text[:at] + ("7" if text[at] != "7" else "8") + text[at + 1:])
    with pytest.raises(ValueError, match="the file c.txt was edited"):
        _prove(ckpt, [b, edited, d])
    with pytest.raises(ValueError, match="the file b.txt changed size: %d bytes when it was read, %d now" % (
            b.stat().st_size, b.stat().st_size + len(lines[0]))):
        _prove(ckpt, [variant("b.txt", b.read_text() + lines[0]), c, d])
    # not refused: the file after the position changed, lines appended to the position's file
    found, reason = _prove(ckpt, [b, variant("c.txt", c.read_text() + "".join(lines[:5])), variant("d.txt", "")])
    assert reason is None and found["offset"] == position["offset"]


def _manifest_text(data):
    """``(start, end)`` of the manifest's JSON among the checkpoint bytes ``data`` (a stored member)."""
    from test_file_fuzz import _member_body
    body, size = _member_body(data, "manifest.npy")
    header = int.from_bytes(data[body + 8:body + 10], "little")          # a .npy of version 1
    return body + 10 + header, body + size


@pytest.mark.slow
def test_a_damaged_or_tampered_position_is_refused_naming_the_checkpoint(tmp_path, stopped_dir):
    """The position rides inside the checkpoint, under its manifest's checksum: a flipped byte (with the
    zip's CRC-32 made to fit or not), a cut, are refused naming the checkpoint. A position rewritten with
    valid checksums is checked against the files and itself: an offset moved to another line start,
    lines or rows changed, are refused. Never trusted, never a fallback. A checkpoint of a version that
    wrote the position beside it is not proven by that side file: refused, naming the file."""
    import shutil
    from test_file_fuzz import _fix_crcs
    base, lines, position = stopped_dir
    sources = [base / "days" / n for n in ("b.txt", "c.txt", "d.txt")]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base / "ckpt", ckpt)
    path = rb.latest_checkpoint(str(ckpt))
    good = open(path, "rb").read()
    start, end = _manifest_text(good)
    flipped = bytearray(good)
    at = good.index(b'"offset": ', start) + len(b'"offset": ')
    flipped[at] = ord("1") if flipped[at] != ord("1") else ord("2")
    for damaged, problem in ((bytes(flipped), r"its member 'manifest.npy' is damaged \(Bad CRC-32"),
                             (_fix_crcs(bytes(flipped)), r"its manifest is damaged or was edited: its content's "
                                                         r"sha256 is [0-9a-f]{64} but the file records"),
                             (good[:end - 5], r"")):
        with open(path, "wb") as fh:
            fh.write(damaged)
        with pytest.raises(ValueError, match=r"The checkpoint '%s' cannot be read \(%s" % (path, problem)):
            _prove(ckpt, sources)
    with open(path, "wb") as fh:
        fh.write(good)
    for bad, expected in (([], "an object, but got []"), ("x", "an object, but got 'x'")):
        _with_extra(path, bad)
        with pytest.raises(ValueError, match=r"the field 'extra' of the checkpoint '%s' must be %s"
                                             % (path, re.escape(expected))):
            _prove(ckpt, sources)

    def tampered(**fields):
        record = json.loads(json.dumps(position))
        for key, value in fields.items():
            if key.startswith("last_"):
                record["files"][-1][key[5:]] = value
            else:
                record[key] = value
        _with_extra(path, record)
    c_lines = (base / "days" / "c.txt").read_bytes().splitlines(keepends=True)
    row = position["lines"]
    back = sum(len(l) for l in c_lines[:row - 1])             # the line start one row before the position
    assert back < position["offset"]
    tampered(offset=back)
    with pytest.raises(ValueError, match=r"the field 'extra.lines' \(and 'extra.offset'\) of the checkpoint '%s' "
                                         r"must be %d, the lines of c.txt's bytes before the offset %d"
                                         % (path, row - 1, back)):
        _prove(ckpt, sources)
    tampered(offset=back, lines=row - 1, last_lines=row - 1)  # offset and lines moved together: rows tell
    with pytest.raises(ValueError, match=r"the field 'extra.files\[1\].rows' of the checkpoint '%s' must be at "
                                         r"most its lines, %d" % (path, row - 1)):
        _prove(ckpt, sources)
    tampered(offset=back, lines=row - 1, last_lines=row - 1, rows=row - 1, last_rows=row - 1)
    with pytest.raises(ValueError, match="the field 'extra.rows' of .* fill its %d batches of %d"
                                         % (position["batches"], BS)):
        _prove(ckpt, sources)
    tampered(lines=row + 1, last_lines=row + 1)
    with pytest.raises(ValueError, match=r"the field 'extra.lines' \(and 'extra.offset'\) .* must be %d" % row):
        _prove(ckpt, sources)
    tampered(rows=row - 1)
    with pytest.raises(ValueError, match=r"the field 'extra.files\[1\].rows' of .* must be the position's rows, %d"
                                         % (row - 1)):
        _prove(ckpt, sources)
    tampered(offset=position["files"][-1]["read"] + 1)
    with pytest.raises(ValueError, match="the field 'extra.offset' of .* must be at most the bytes read of its file"):
        _prove(ckpt, sources)
    tampered(batch_size=BS * 2)                               # its rows no longer fill its batches
    with pytest.raises(ValueError, match="the field 'extra.rows' of .* fill its %d batches of %d"
                                         % (position["batches"], 2 * BS)):
        _prove(ckpt, sources)
    tampered()
    assert _prove(ckpt, sources)[0]["offset"] == position["offset"]          # re-signed as it was: proven
    _with_extra(path, None)                                   # none: not proven, the reason said
    found, reason = _prove(ckpt, sources)
    assert found is None and reason == "the checkpoint has no recorded input position (none could be found when " \
                                       "it was written)"
    side = path[:-4] + ".input.json"                          # the older version's side file beside it
    with open(side, "w") as fh:
        json.dump(dict(position, format=2, step=3, sha256="0" * 64), fh)
    found, reason = _prove(ckpt, sources)
    assert found is None and reason == "the checkpoint has no recorded input position (it was written by an older " \
                                       "recboost, whose position file %s beside it this version does not read)" \
                                       % os.path.basename(side)
    for name in os.listdir(ckpt):                             # every checkpoint as the older version wrote it
        if name.endswith(".npz"):
            _with_extra(str(ckpt / name), None)
    with pytest.raises(ValueError, match=r"the resume from '%s' must be proven to continue the input it was trained "
                                         r"on, by the input position it carries; .*--resume-by-count.* but got 'none "
                                         r"\(nor has any checkpoint of the directory\): the checkpoint has no recorded "
                                         r"input position \(it was written by an older recboost, whose position file "
                                         r"recboost-3.input.json beside it this version does not read\)'" % path):
        _run(base / "days", ckpt)
    resumed = _run(base / "days", ckpt, resume_by_count=True)           # its way on: the input read by count
    assert resumed["resumed_from"] == path and resumed["steps"] == 10


def test_a_holdout_of_the_whole_input_is_refused_before_training(tmp_path, graph_mode, capsys):
    """--holdout N of as many lines as the file holds (or more) would train nothing (the old job exited 0
    having trained nothing): an error naming --holdout, its value and the file's lines, before anything
    is written. A directory's holdout comes from its last file; standard input cannot be split."""
    path = tmp_path / "day.txt"
    path.write_text("".join(_lines(64 * 3)))
    for holdout in (3, 5):
        with pytest.raises(ValueError, match=r"'holdout' \(--holdout, batches of --batch-size 64\) must be fewer "
                                             r"lines than the file %s holds, 192 \(at most 2 batch\(es\)\), but got "
                                             r"'%d \(%d lines\)'" % (path, holdout, 64 * holdout)):
            rb.train_job(str(path), batch_size=BS, holdout=holdout, checkpoint_dir=str(tmp_path / "ckpt"), **QUIET)
    assert not (tmp_path / "ckpt").exists()
    folder = tmp_path / "days"
    folder.mkdir()
    (folder / "a.txt").write_text("".join(_lines(64 * 3)))
    (folder / "b.txt").write_text("".join(_lines(40, seed=2)))
    with pytest.raises(ValueError, match=r"fewer lines than the directory's last file %s, which it is split from, "
                                         r"holds, 40 \(too few to hold a batch out.*; or --holdout file"
                                         % (folder / "b.txt")):
        rb.train_job(str(folder), batch_size=BS, holdout=1, **QUIET)
    with pytest.raises(SystemExit) as exit_:
        rb.main(["train", "--data", str(path), "--batch-size", "64", "--holdout", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--holdout" in err and "192" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="'holdout' must be 0 with standard input"):
        rb.train_job("-", batch_size=BS, holdout=1, **QUIET)


def _write_unsigned(path, arrays, manifest):
    """Write the checkpoint ``path`` of ``arrays`` as recboost does, but with the manifest ``manifest`` (a
    dict) as it is given: an edit whose checksums were not made again."""
    import zipfile
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in list(arrays.items()) + [("manifest", np.frombuffer(
                json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n", np.uint8))]:
            with zf.open(name + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, value, allow_pickle=False)


@pytest.mark.slow
@pytest.mark.live_backend
def test_the_position_member_fuzzed_is_refused_naming_the_checkpoint_or_proven_as_written(tmp_path, stopped_dir,
                                                                                          backend):
    """Seeded damage of the position a checkpoint carries (its manifest's field "extra"): flipped bits and
    zeroed blocks in its bytes (the zip's CRC-32 made to fit or not), cuts, and edits of one field (with
    the checksums left, and made again). Every result is a ValueError naming the checkpoint (or, for a
    field the proof does not need, the same position as the intact file), never a raw exception."""
    import random
    import shutil
    from test_file_fuzz import _fix_crcs
    base, _, position = stopped_dir
    sources = [str(base / "days" / n) for n in ("b.txt", "c.txt", "d.txt")]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base / "ckpt", ckpt)
    checkpoint = rb.latest_checkpoint(str(ckpt))
    good = open(checkpoint, "rb").read()
    _, arrays = rb._read_checkpoint_file(checkpoint)
    manifest = json.loads(good[slice(*_manifest_text(good))])          # as written: with its sha256
    want, _ = rb._input_resume_position(checkpoint, rb._CriteoInput(sources, BS, digests=True))
    want.pop("hasher")
    start, end = good.index(b'\n "extra": '), good.index(b'\n "format": ')    # the member's bytes (keys sorted)
    assert json.loads(b"{" + good[start + 1:end].rstrip(b",") + b"}")["extra"] == position

    def fields(value, at=()):
        """Every (path, leaf value) of the position."""
        if isinstance(value, dict):
            return [f for key in sorted(value) for f in fields(value[key], at + (key,))]
        if isinstance(value, list):
            return [f for k, item in enumerate(value) for f in fields(item, at + (k,))]
        return [(at, value)]
    leaves = fields(position)
    rng = random.Random(35)
    kinds = {"flip": 0, "cut": 0, "zero": 0, "field": 0, "field+checksum": 0}
    accepted = 0
    for trial in range(300):
        kind = list(kinds)[trial % len(kinds)]
        data = bytearray(good)
        if kind == "flip":
            data[rng.randrange(start, end)] ^= 1 << rng.randrange(8)
        elif kind == "cut":
            data = data[:rng.randrange(start, end)]
        elif kind == "zero":
            at = rng.randrange(start, end)
            data[at:at + rng.randint(1, 16)] = bytes(len(data[at:at + 16]))
        if kind in ("flip", "zero") and trial % 2:
            data = bytearray(_fix_crcs(bytes(data)))            # only the manifest's own checksum can tell
        if kind.startswith("field"):
            edited = json.loads(json.dumps(position))
            where, value = leaves[rng.randrange(len(leaves))]
            new = value + rng.choice([-1, 1]) if isinstance(value, int) and not isinstance(value, bool) else \
                (value[:-1] + ("0" if value[-1:] != "0" else "1") if isinstance(value, str) and value else 7)
            holder = edited
            for key in where[:-1]:
                holder = holder[key]
            holder[where[-1]] = new
            with open(checkpoint, "wb") as fh:
                fh.write(good)
            if kind == "field":
                _write_unsigned(checkpoint, arrays, dict(manifest, extra=edited))
            else:
                _with_extra(checkpoint, edited)
        else:
            with open(checkpoint, "wb") as fh:
                fh.write(bytes(data))
        kinds[kind] += 1
        try:
            found, reason = rb._input_resume_position(checkpoint, rb._CriteoInput(sources, BS, digests=True))
        except ValueError as exc:
            assert checkpoint in str(exc), (kind, str(exc))
            continue
        assert reason is None, (kind, reason)
        found.pop("hasher")
        assert found == want, kind                     # accepted only as written (e.g. a size of the
        accepted += 1                                  # position's file, which may grow)
    assert all(n >= 50 for n in kinds.values()) and accepted < 30


def test_criteo_reader_digest_holds_every_byte_it_read(tmp_path, backend):
    """``CriteoReader(digest=...)``: fed every byte read, in order (decompressed for .gz), from ``start``
    on; ``read_digest()`` gives the offset read up to (a chunk may run past the rows yielded)."""
    import hashlib

    def blake(data):
        return hashlib.blake2b(data, digest_size=32).hexdigest()
    text = "".join(_lines(300)).encode()
    path = tmp_path / "x.txt"
    path.write_bytes(text)
    with gzip.open(tmp_path / "x.txt.gz", "wb") as fh:
        fh.write(text)
    for source in (path, tmp_path / "x.txt.gz"):
        reader = rb.CriteoReader(str(source), batch_size=64, chunk_bytes=1000, digest=rb._input_hasher())
        assert reader.read_digest() == (0, blake(b""))
        next(reader)
        read, hexdigest = reader.read_digest()
        assert reader.position()["offset"] <= read < len(text) and hexdigest == blake(text[:read])
        start = reader.position()
        assert sum(len(b[2]) for b in reader) == 300 - 64
        assert reader.read_digest() == (len(text), blake(text))
        hasher = rb._input_hasher()
        hasher.update(text[:start["offset"]])
        rest = rb.CriteoReader(str(source), batch_size=64, start=start, digest=hasher)
        assert sum(len(b[2]) for b in rest) == 300 - 64 and rest.read_digest() == (len(text), blake(text))
    assert rb.CriteoReader(str(path)).read_digest() == (0, None)
    with pytest.raises(TypeError, match="'digest' must be None or a hashlib object"):
        rb.CriteoReader(str(path), digest="blake2b")


@pytest.mark.slow
def test_export_mindir_writes_the_network_as_mindir_into_every_bundle_of_the_job(tmp_path, graph_mode, capsys):
    """``train --export DIR --export-mindir``: every bundle of the chain (full, then deltas) holds
    dense.mindir, its inputs the job's batches' (13 dense features; 26 fields of 17 columns), and
    serve.py (docs/serving.md) serves the last delta through its chain bit for bit as a Predictor of
    the job's network; without --export the option is refused, exit code 2, before anything trains."""
    from test_mindir import _serve_here
    lines = _lines(64 * 4 + 5)
    path = tmp_path / "day.txt"
    path.write_text("".join(lines))
    export = tmp_path / "export"
    assert rb.main(["train", "--data", str(path), "--batch-size", str(BS), "--export", str(export), "--export-every",
                    "2", "--export-mindir", "--eviction-threshold", "2", "--capacity", "4096",
                    "--progress-seconds", "1000"]) == 0
    names = sorted(n for n in os.listdir(export) if n.startswith("bundle-"))
    assert names == ["bundle-000000002", "bundle-000000004", "bundle-000000005"]
    manifests = [json.load(open(export / n / "manifest.json")) for n in names]
    assert [m["kind"] for m in manifests] == ["full", "delta", "delta"]
    for m in manifests:
        assert m["mindir"] == {"file": "dense.mindir", "inputs": [
            {"name": "dense", "shape": [-1, 13], "dtype": "float32", "tables": []},
            {"name": "ids", "shape": [-1, 26, 17], "dtype": "float32", "tables": [0]}]}
        assert "dense.mindir" in m["files"]
    rb.ms.set_seed(3)
    table = rb.HashEmbedding(17, 64, use_dynamic_expansion=True, input_index=1, name="ids")
    predictor = rb.Predictor(rb.WideDeep(13, 26, 16, (400, 400), embedding=table), str(export / names[-1]))
    probe = _probe(lines[:40])
    serve = _serve_here(tmp_path)
    manifest, tables, graph = serve["read_bundle"](str(export / names[-1]))
    served = graph(*serve["network_inputs"](manifest, tables, probe)).asnumpy()
    assert np.array_equal(served, predictor.predict(*probe))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        rb.main(["train", "--data", str(path), "--batch-size", str(BS), "--export-mindir"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert re.search(r"^python -m recboost train: For 'recboost train', 'export_mindir' must be False without "
                     r"'export' \(the MindIR goes into the exported bundles\), but got True\.$", err, re.M), err


@pytest.mark.parametrize("flags, name, value", [(["--checkpoint-full-every", "3"], "checkpoint_full_every", 3),
                                                (["--resume-by-count"], "resume_by_count", True),
                                                (["--checkpoint-background"], "checkpoint_background", True),
                                                (["--checkpoint-background", "off"], "checkpoint_background", False)])
def test_checkpoint_options_without_a_checkpoint_dir_are_refused(tmp_path, graph_mode, capsys, flags, name, value):
    """Issue 61 item 6: ``--checkpoint-full-every K`` and ``--resume-by-count`` only act on the checkpoints of
    ``--checkpoint-dir``; without it they were ignored (exit 0). Refused as ``--export-mindir`` without
    ``--export`` is: exit code 2, the message naming the option, before anything trains."""
    path = tmp_path / "day.txt"
    path.write_text("".join(_lines(64 * 2)))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        rb.main(["train", "--data", str(path), "--batch-size", str(BS)] + flags)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err and "training" not in err
    assert re.search(r"^python -m recboost train: For 'recboost train', '%s' must be %s without 'checkpoint_dir' "
                     r"\(it acts on the checkpoints of that directory\), but got %r\.$"
                     % (name, "None" if name != "resume_by_count" else "False", value), err, re.M), err
    with pytest.raises(ValueError, match=r"'%s' must be .* without 'checkpoint_dir'" % name):
        rb.train_job(str(path), batch_size=BS, **{name: value}, **QUIET)


def test_a_last_line_read_cut_and_completed_since_is_named_as_a_changed_input(tmp_path, graph_mode):
    """Issue 61 item 14: a file whose last line was cut inside its final hex field when it was trained, then
    completed, was refused as "the field 'extra.lines' ... of the checkpoint must be 395 ..., but got 395":
    self-contradictory, and blaming the checkpoint. The input changed at the position: refused naming the
    file, the byte and what happened to its line, before anything trains."""
    lines = _lines(64 * 3 + 5)
    fields = lines[-1].rstrip("\n").split("\t")
    lines[-1] = "\t".join(fields[:-1] + ["deadbeef"]) + "\n"
    path = tmp_path / "day.txt"
    whole = "".join(lines)
    cut = whole[:-len("beef\n")]                        # the last line cut inside its final hex field
    path.write_text(cut)
    first = _run(path, tmp_path / "ckpt")
    assert first["steps"] == 4 and first["reader"]["lines"] == len(lines)
    path.write_text(whole)                              # the line completed since
    with pytest.raises(ValueError) as refused:
        _run(path, tmp_path / "ckpt")
    message = str(refused.value)
    assert re.search(r"For 'recboost train', the input of a run resuming from '.*recboost-4\.npz' must be the input "
                     r"that checkpoint was trained on, unchanged up to its position .*but got 'the file day\.txt ended "
                     r"inside its last line when it was read \(at byte %d, no newline\), and that line goes on now: "
                     r"the row trained from its cut part is not the line the file holds'" % len(cut.encode()),
                     message), message
    assert "must be %d" % len(lines) not in message


def test_export_caps_need_export(tmp_path):
    path = tmp_path / "day.txt"
    path.write_text("".join(_lines(10)))
    with pytest.raises(ValueError, match="'export_max_rows' must be None without 'export' \\(it caps the exported"):
        rb.train_job(str(path), batch_size=BS, export_max_rows=5, **QUIET)


@pytest.mark.slow
def test_a_score_table_trains_from_the_command_line_into_capped_bundles(tmp_path, graph_mode):
    """train --eviction-policy score --access-threshold -1 --no-growth --export-max-rows 40: the job's
    table scores its ids (a full table replaced some) and every bundle of the chain holds 40 rows."""
    path = tmp_path / "day.txt"
    path.write_text("".join(_lines(64 * 7 + 5)))
    result = rb.train_job(str(path), batch_size=BS, eviction_policy="score", access_threshold=-1, growth=False,
                          capacity=600, export=str(tmp_path / "export"), export_every=3, export_max_rows=40, **QUIET)
    table = result["model"].tables[0]
    assert table.cache.eviction_policy == "score" and table.cache.stats()["replaced"] > 0
    assert table.cache.scores(table.cache.state_dict()["keys"]).max() > 1.0
    for name in ("bundle-000000003", "bundle-000000006", "bundle-000000008"):
        bundle = tmp_path / "export" / name
        assert json.load(open(bundle / "manifest.json"))["tables"][0]["rows"] <= 40
    full = np.load(tmp_path / "export" / "bundle-000000003" / "table-0-ids.npy")
    assert full.size == 40


# ---- a named pipe as --data (issue 61 item 16) -----------------------------------------------------------
def _fifo_writer(path, data, request):
    """A thread that opens the named pipe ``path`` for writing and writes ``data`` once, as a producer
    would (a reader that stops early breaks the pipe: the thread ends). The finalizer lets a writer
    still waiting for a reader through, so that no thread outlives the test."""
    import threading

    def write():
        try:
            with open(path, "wb") as fh:
                fh.write(data)
        except BrokenPipeError:
            pass
    thread = threading.Thread(target=write, daemon=True)
    thread.start()

    def release():
        if thread.is_alive():
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            os.close(fd)
            thread.join(10)
    request.addfinalizer(release)
    return thread


def test_a_named_pipe_with_a_checkpoint_dir_is_refused_at_the_first_run_without_resume_by_count(tmp_path,
                                                                                                  graph_mode, request):
    """Nothing opens the pipe (no writer: an open would wait for ever): the first run is refused, saying
    what a pipe allows; so is a held-out split of it (it would be read to its end before training)."""
    fifo = tmp_path / "stream"
    os.mkfifo(fifo)
    _fifo_writer(fifo, b"", request)                # (a run that opened it would end at once, not wait)
    with pytest.raises(ValueError, match=r"^For 'recboost train', 'data' \(--data\) with 'checkpoint_dir' "
                       r"\(--checkpoint-dir\) must be a regular file, a directory or '-'; or, for a named pipe, with "
                       r"resume_by_count \(--resume-by-count\) on the first run and every resume: a pipe is read once, "
                       r"never sought in nor read again .*reads the stream again from the pipe's start .*, but got "
                       r"\"'%s', a named pipe, without resume_by_count\"\.$" % re.escape(str(fifo))):
        _run(fifo, tmp_path / "ckpt")
    assert not os.path.exists(tmp_path / "ckpt")                       # nothing written: refused before
    with pytest.raises(ValueError, match=r"'holdout' must be 0 with standard input or a named pipe"):
        rb.train_job(str(fifo), batch_size=BS, holdout=1, **QUIET)


@pytest.mark.slow
def test_a_named_pipe_resumes_by_count_to_the_model_of_an_uninterrupted_run(tmp_path, graph_mode, request):
    """``--data`` a real FIFO fed by a writer thread, with ``--resume-by-count``: stopped at step 3, then
    resumed with the writer writing the stream again from its start; the checkpoint's count of batches
    is skipped (logged as unproven, naming the pipe), and the final checkpoint's arrays are bit for bit
    those of one run over the same lines in a regular file. A resume without the flag is refused."""
    import gc
    lines = _lines(64 * 8)
    data = "".join(lines).encode()
    path = tmp_path / "day.txt"
    path.write_bytes(data)
    once = _run(path, tmp_path / "once")
    assert once["steps"] == 8
    fifo = tmp_path / "pipe" / "day.txt"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    writer = _fifo_writer(fifo, data, request)
    first = _run(fifo, tmp_path / "ckpt", steps=3, resume_by_count=True)
    assert first["steps"] == 3
    del first
    gc.collect()
    writer.join(30)
    assert not writer.is_alive()                  # the first writer is gone before the second one writes
    with pytest.raises(ValueError, match=r"a named pipe, without resume_by_count"):
        _run(fifo, tmp_path / "ckpt")
    manifest, _ = _checkpoint_arrays(str(tmp_path / "ckpt" / "recboost-3.npz"))
    consumed = manifest["taken"] - manifest["stream_start"]
    said = []
    _fifo_writer(fifo, data, request)
    resumed = _run(fifo, tmp_path / "ckpt", said, resume_by_count=True)
    assert any("resuming from %s: the batches already trained are read again and skipped by their count, UNPROVEN "
               "(--resume-by-count), because the input %s is a named pipe" % (tmp_path / "ckpt" / "recboost-3.npz",
                                                                            fifo) in line for line in said), said
    assert resumed["steps"] == 8 and resumed["rows"] == 64 * 5 and resumed["reader"]["lines"] == 64 * 8
    assert 3 <= consumed <= 8
    want_manifest, want = _checkpoint_arrays(rb.latest_checkpoint(str(tmp_path / "once")))
    got_manifest, got = _checkpoint_arrays(rb.latest_checkpoint(str(tmp_path / "ckpt")))
    for m in (want_manifest, got_manifest):        # the position names the file's size: a pipe's is 0
        m.pop("extra")
    assert got_manifest == want_manifest and sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


_BLAS_THREADS = """
import ctypes, hashlib, itertools, sys
import numpy as np
import recboost as rb

def threads():      # numpy's OpenBLAS pool size, read with its own call (not recboost's)
    with open("/proc/self/maps") as maps:
        path = next(line.split()[-1] for line in maps if "openblas64_" in line.rsplit("/", 1)[-1])
    return ctypes.CDLL(path).openblas_get_num_threads64_()

def stream():       # the demo's batches, whose labels take a matrix product numpy runs on the pool
    digest = hashlib.sha256()
    for batch in itertools.islice(rb.SyntheticClickStream(batch_size=2048, seed=3), 6):
        for column in batch:
            digest.update(np.ascontiguousarray(column).tobytes())
    return digest.hexdigest()

before, batches = threads(), stream()
try:
    rb.main(["train", "--data", "no-such-file.gz"])
except SystemExit as exc:
    assert exc.code == 2, exc.code
assert stream() == batches
print(before, threads())
"""


@pytest.mark.parametrize("env, after", [({}, 1), ({"OPENBLAS_NUM_THREADS": "2"}, 2)])
def test_the_command_line_runs_numpys_blas_on_one_thread_unless_openblas_num_threads_says(tmp_path, env, after):
    """python -m recboost sets numpy's OpenBLAS pool to one thread (its threads spin in sched_yield after
    each call, on the cores the step needs), and leaves a pool size the user set alone. The synthetic
    stream's batches are the same bytes on either."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                                                               "OMP_NUM_THREADS")}
    # (a pool of 2 before, whatever a test before this one left in the environment or the CPU mask)
    out = subprocess.run([sys.executable, "-c", _BLAS_THREADS], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(clean, GOTO_NUM_THREADS="2", **env), timeout=120,
                         preexec_fn=lambda: os.sched_setaffinity(0, range(os.cpu_count())))
    assert out.returncode == 0, out.stderr[-2000:]
    before, now = map(int, out.stdout.split()[-2:])
    assert before >= 2, "numpy's pool before the command line: %d threads (this test needs 2 cores)" % before
    assert now == after
