"""python -m recboost serve: the real server started as a subprocess on a free port of 127.0.0.1 and
queried over the network, with plain HTTP + JSON (urllib) and with tritonclient.http (binary and JSON
tensor data). The bundles (Wide&Deep(4, 6, 8, (16,)) over a 1024-row hash table: a full bundle at
step 5 and deltas at 10 and 15) are exported once for the module, with what a Predictor gives on
one batch at each step."""
import gzip
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

import recboost as rb  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = (5, 10, 15)


def _build(seed=0):
    import mindspore as ms
    ms.set_seed(seed)
    table = rb.HashEmbedding(9, 1024, access_threshold=1, use_dynamic_expansion=True, input_index=1, name="ids")
    return rb.WideDeep(4, 6, 8, (16,), embedding=table)


def _probability(logits):
    """The click probability of the logits as the server computes it (the logistic in float64, then float32)."""
    return (1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))).astype(np.float32)


def _damaged_copy(bundle, copy, name, back):
    """A copy of ``bundle`` at ``copy`` whose file ``name`` has one bit flipped ``back`` bytes from its end."""
    shutil.copytree(bundle, copy)
    with open(copy / name, "r+b") as fh:
        fh.seek(-back, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-back, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0x40]))
    return copy


def _bundle_name(step):
    return "bundle-%09d" % step


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """``src`` (the export directory: a full bundle at step 5, deltas at 10 and 15), ``full`` (a full
    bundle at step 20, of another directory; ``again``, the same exported again: another id), the serving batch
    ``dense``, ``ids`` (8 rows, the last one's ids never seen) and ``expected``: step -> the click
    probabilities (float32 [8, 1]) a Predictor of that bundle gives on it, in a fresh network."""
    import itertools
    import mindspore as ms
    from mindspore import nn
    ms.set_device("CPU")                     # before any kernel runs (a later set_device would be refused)
    src = tmp_path_factory.mktemp("export")
    net = _build()
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-2))
    stream = iter(rb.SyntheticClickStream(num_dense=4, num_sparse=6, vocab_sizes=[300] * 6, batch_size=256, seed=0))
    base = None
    for step in STEPS:
        model.train(1, list(itertools.islice(stream, 5)), dataset_sink_mode=False)
        assert model.step == step
        base = model.export(str(src / _bundle_name(step)), base=base)
    model.train(1, list(itertools.islice(stream, 5)), dataset_sink_mode=False)
    full = tmp_path_factory.mktemp("full") / _bundle_name(20)         # a new full bundle, elsewhere
    model.export(str(full))
    again = tmp_path_factory.mktemp("again") / _bundle_name(20)       # the same model exported again: another id
    model.export(str(again))
    dense, ids, _ = next(iter(rb.SyntheticClickStream(num_dense=4, num_sparse=6, vocab_sizes=[300] * 6,
                                                      batch_size=8, seed=1)))
    ids[-1] = 10 ** 12 + np.arange(6)
    expected = {step: _probability(rb.Predictor(_build(seed=step), str(src / _bundle_name(step))).predict(dense, ids))
                for step in STEPS}
    expected[20] = _probability(rb.Predictor(_build(seed=20), str(full)).predict(dense, ids))
    for a, b in itertools.combinations(expected, 2):          # the bundles tell apart by their predictions
        assert np.abs(expected[a] - expected[b]).max() > 1e-5
    return type("Bundles", (), dict(src=src, full=full, again=again, dense=dense, ids=ids, expected=expected))


class _Server:
    """``python -m recboost serve DIR --port 0 ...`` as a subprocess: its stderr read on a thread
    (``log``: the structured lines, parsed; ``unparsed``: lines that look like one and are not), ``port``
    from its 'listening' line. Its stderr unbuffered (PYTHONUNBUFFERED=1, as under many supervisors):
    each write reaches the pipe at once, so a log line written in pieces would mix with a worker's."""

    def __init__(self, directory, *args, env=None, wait=True):
        self.proc = subprocess.Popen([sys.executable, "-m", "recboost", "serve", str(directory), "--port", "0",
                                      *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        self.lines, self.log, self.unparsed = [], [], []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.port = None
        if wait:
            listening = self.wait_for(lambda line: line.get("event") == "listening", 120)
            self.port = listening["port"]
            self.url = "http://127.0.0.1:%d" % self.port

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("{"):
                try:
                    self.log.append(json.loads(line))
                except ValueError:
                    self.unparsed.append(line)

    def wait_for(self, test, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.log if test(line)]
            if found:
                return found[0]
            if self.proc.poll() is not None:
                self.reader.join(5)
                raise AssertionError("the server exited %s:\n%s" % (self.proc.returncode, "".join(self.lines)))
            time.sleep(0.02)
        raise AssertionError("timed out; the server's stderr:\n%s" % "".join(self.lines))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        self.reader.join(5)
        assert not self.unparsed, self.unparsed          # every log line whole, one JSON object a line
        return code


@pytest.fixture
def server_of(request):
    """Start servers (``server_of(directory, *args)``), each stopped (SIGTERM) at the test's end."""
    started = []

    def start(directory, *args, **kwargs):
        started.append(_Server(directory, *args, **kwargs))
        return started[-1]
    yield start
    for server in started:
        server.stop()


def _http(server, path, body=None, headers=None, method=None):
    """``(status, headers, body bytes)`` of one request to ``server``."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def _raw_response(sock):
    """The text of one HTTP response read from ``sock``: its head, and its body to its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            re.search(rb"(?im)^content-length: *(\d+)", data.split(b"\r\n\r\n", 1)[0]).group(1)):
        more = sock.recv(65536)
        assert more, data           # (closed before the response was whole)
        data += more
    return data.decode()


def _infer_body(dense, ids, **extra):
    """A JSON infer request of ``dense`` and ``ids`` (and the request fields ``extra``)."""
    return dict({"inputs": [
        {"name": "dense", "datatype": "FP32", "shape": list(dense.shape), "data": dense.ravel().tolist()},
        {"name": "ids", "datatype": "INT64", "shape": list(ids.shape), "data": ids.ravel().tolist()}]}, **extra)


def _infer_json(server, dense, ids):
    """``(step, probabilities)`` of one JSON infer request."""
    status, _, body = _http(server, "/v2/models/recboost/infer", _infer_body(dense, ids))
    assert status == 200, body
    answer = json.loads(body)
    output = answer["outputs"][0]
    assert output["name"] == "probability" and output["datatype"] == "FP32"
    return int(answer["model_version"]), np.array(output["data"], np.float32).reshape(output["shape"])


def _metric(server, name, labels=""):
    """The value of one sample of /metrics (0.0 when absent)."""
    _, _, body = _http(server, "/metrics")
    found = re.search(r"^%s%s (\S+)$" % (re.escape(name), re.escape(labels)), body.decode(), re.M)
    return float(found.group(1)) if found else 0.0


def _place(source, target):
    """Copy the bundle ``source`` to ``target`` all at once (a copy beside it, then a rename), as an export does."""
    staging = str(target) + ".copying"
    shutil.copytree(source, staging, copy_function=shutil.copy)
    os.rename(staging, target)


@pytest.fixture(scope="module")
def served(bundles, tmp_path_factory):
    """One server of the export directory (newest: step 15), its body limit 64 KiB and 2 s, for the read-only
    tests."""
    server = _Server(bundles.src, "--max-body-bytes", "65536", "--body-seconds", "2", "--model-name", "ctr")
    yield server
    assert server.stop() == 0


def test_serve_json_is_predictor_bit_for_bit(bundles, served):
    """The newest bundle of the directory (a delta, its chain followed) answers a JSON request with the
    click probabilities a Predictor of it gives, bit for bit, and its step as model_version."""
    status, _, body = _http(served, "/v2/models/ctr/infer", _infer_body(bundles.dense, bundles.ids, id="req-1"))
    assert status == 200
    answer = json.loads(body)
    assert answer["model_name"] == "ctr" and answer["model_version"] == "15" and answer["id"] == "req-1"
    got = np.array(answer["outputs"][0]["data"], np.float32).reshape(answer["outputs"][0]["shape"])
    assert got.shape == (8, 1) and got.tobytes() == bundles.expected[15].tobytes()


@pytest.mark.parametrize("binary_in, binary_out", [(True, True), (False, False), (True, None), (False, True)])
def test_serve_tritonclient(bundles, served, binary_in, binary_out):
    """tritonclient.http, unmodified: binary tensor data in and out (its default), JSON both ways, no
    outputs named (binary_data_output), JSON in and binary out: bit for bit a Predictor's."""
    httpclient = pytest.importorskip("tritonclient.http")
    client = httpclient.InferenceServerClient("127.0.0.1:%d" % served.port)
    try:
        inputs = [httpclient.InferInput("dense", list(bundles.dense.shape), "FP32"),
                  httpclient.InferInput("ids", list(bundles.ids.shape), "INT64")]
        inputs[0].set_data_from_numpy(bundles.dense, binary_data=binary_in)
        inputs[1].set_data_from_numpy(bundles.ids, binary_data=binary_in)
        outputs = None if binary_out is None else [httpclient.InferRequestedOutput("probability",
                                                                                    binary_data=binary_out)]
        result = client.infer("ctr", inputs, outputs=outputs)
        assert result.get_response()["model_version"] == "15"
        assert result.as_numpy("probability").tobytes() == bundles.expected[15].tobytes()
    finally:
        client.close()


@pytest.mark.slow
def test_the_docs_tritonclient_example_runs_against_a_served_bundle(server_of, tmp_path):
    """docs/serving.md's tritonclient call ("A serving process"), as written but for the server's port (the
    docs' 8000 is a free one here), against a served bundle of the train job's shape (13 dense features, 26
    ids): the probabilities it reads are float32 [64, 1], a Predictor's bit for bit, and the model version
    is the step of the bundle that answered."""
    from mindspore import nn
    from test_readme import _example

    def build():
        import mindspore as ms
        ms.set_seed(0)
        return rb.WideDeep(13, 26, 8, (16,), embedding=rb.HashEmbedding(9, 4096, input_index=1, name="ids"))
    net = build()
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-2))
    model.train(1, rb.SyntheticClickStream(seed=0, batch_size=64, num_batches=3), dataset_sink_mode=False)
    model.export(str(tmp_path / "serving" / _bundle_name(3)))
    server = server_of(tmp_path / "serving")
    code = _example("docs/serving.md", "## A serving process")
    assert code.count('"127.0.0.1:8000"') == 1
    scope = {}
    exec(compile(code.replace('"127.0.0.1:8000"', '"127.0.0.1:%d"' % server.port), "example.py", "exec"),  # noqa: S102
         scope)
    got = scope["result"].as_numpy("probability")
    expected = _probability(rb.Predictor(build(), str(tmp_path / "serving" / _bundle_name(3))).predict(
        scope["dense"], scope["ids"]))
    assert got.dtype == np.float32 and got.shape == (64, 1) and got.tobytes() == expected.tobytes()
    assert scope["result"].get_response()["model_version"] == "3"
    scope["client"].close()
    # the curl commands of the same section, as written but for the port: the metadata names the inputs,
    # and the infer request gets the JSON answer the section shows (one row), a Predictor's bit for bit
    shell = re.search(r"```bash\n(.*?)```", open(os.path.join(ROOT, "docs/serving.md")).read().split(
        "## A serving process", 1)[1], re.S).group(1)
    curls = re.findall(r"^curl .*?(?=\n[^ ]|\Z)", shell, re.S | re.M)
    assert len(curls) == 2 and all("localhost:8000" in c for c in curls)
    answers = [subprocess.run(["bash", "-c", c.split("#")[0].replace("localhost:8000", "127.0.0.1:%d" % server.port)],
                              capture_output=True, text=True, timeout=60, check=True).stdout for c in curls]
    metadata, answer = json.loads(answers[0]), json.loads(answers[1])
    assert [i["name"] for i in metadata["inputs"]] == ["dense", "ids"]
    request = json.loads(re.search(r"-d '(.*)'", curls[1], re.S).group(1))["inputs"]
    dense, ids = (np.array(request[k]["data"], dtype).reshape(request[k]["shape"]) for k, dtype in
                  ((0, np.float32), (1, np.int64)))
    shown = json.loads(re.search(r"^# (\{.*)", shell, re.M | re.S).group(1).replace("\n#  ", "").replace(
        "0.0312...", "0"))
    assert answer["model_name"] == shown["model_name"] and answer["model_version"] == "3"
    assert [(o["name"], o["datatype"], o["shape"]) for o in answer["outputs"]] == [
        (o["name"], o["datatype"], o["shape"]) for o in shown["outputs"]]
    expected = _probability(rb.Predictor(build(), str(tmp_path / "serving" / _bundle_name(3))).predict(dense, ids))
    assert np.array(answer["outputs"][0]["data"], np.float32).tobytes() == expected.tobytes()


def test_serve_health_and_metadata(bundles, served):
    """The health endpoints, the model's metadata (inputs from the bundle's network) and its readiness,
    through tritonclient and plain HTTP; another model name is a 404 with a JSON error."""
    httpclient = pytest.importorskip("tritonclient.http")
    client = httpclient.InferenceServerClient("127.0.0.1:%d" % served.port)
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("ctr")
        metadata = client.get_model_metadata("ctr")
        assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]
    finally:
        client.close()
    assert metadata == {"name": "ctr", "versions": ["15"], "platform": "recboost",
                        "inputs": [{"name": "dense", "datatype": "FP32", "shape": [-1, 4]},
                                   {"name": "ids", "datatype": "INT64", "shape": [-1, 6]}],
                        "outputs": [{"name": "probability", "datatype": "FP32", "shape": [-1, 1]}]}
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/ctr/ready"):
        assert _http(served, path)[0] == 200
    status, _, body = _http(served, "/v2/models/other")
    assert status == 404 and json.loads(body)["error"] == \
        "For 'recboost serve', the model name must be 'ctr', but got 'other'."


def _refusals(b):
    """(case id, body, headers, status, error kind, the message's parts)."""
    good = _infer_body(b.dense, b.ids)
    dense, ids = good["inputs"]

    def body(*inputs, **extra):
        return dict({"inputs": list(inputs)}, **extra)
    nan = json.dumps(body(dict(dense, data=[float("nan")] + dense["data"][1:]), ids)).encode()
    head = json.dumps(body(dict(dense, data=None, parameters={"binary_data_size": 128}), ids)).encode()
    inf = b.dense.copy()
    inf[2, 1] = np.inf
    return [
        ("shape", body(dict(dense, shape=[8, 5]), ids), {}, 400, "shape",
         ["For 'infer', the shape of the input 'dense' must be [-1, 4] (each -1 given as its size, at least one row), "
          "but got [8, 5]."]),
        ("shape_wildcard", body(dict(dense, shape=[-1, 4]), ids), {}, 400, "shape",   # the -1 itself: no size
         ["the shape of the input 'dense' must be [-1, 4] (each -1 given as its size, at least one row), but got "
          "[-1, 4]."]),
        ("rank", body(dense, dict(ids, shape=[48])), {}, 400, "shape", ["the shape of the input 'ids'", "[48]"]),
        ("values", body(dict(dense, data=dense["data"][:-1]), ids), {}, 400, "shape",
         ["the data of the input 'dense' must be 32 values (shape [8, 4]), but got '31 values'"]),
        ("over_nested", body(dict(dense, data=[np.reshape(dense["data"], [8, 4]).tolist()]), ids), {}, 400, "shape",
         ["the data of the input 'dense' must be 32 values (shape [8, 4]), but got 'nested as [1, 8, 4]'."]),
        ("nested_otherwise", body(dict(dense, data=np.reshape(dense["data"], [4, 8]).tolist()), ids), {}, 400, "shape",
         ["the data of the input 'dense'", "but got 'nested as [4, 8]'."]),
        ("rows", body(dense, dict(ids, shape=[4, 6], data=ids["data"][:24])), {}, 400, "shape",
         ["the rows of the input 'ids' must be 8 like the input 'dense', but got 4."]),
        ("dtype", body(dict(dense, datatype="FP64"), ids), {}, 400, "dtype",
         ["the datatype of the input 'dense' must be FP32, but got 'FP64'."]),
        ("ids_fp32", body(dense, dict(ids, datatype="FP32")), {}, 400, "dtype",
         ["the datatype of the input 'ids' must be INT64, but got 'FP32'."]),
        ("ids_fraction", body(dense, dict(ids, data=[1.5] + ids["data"][1:])), {}, 400, "dtype",
         ["the data of the input 'ids' must be INT64 values (integers), but got 'numbers with a fraction or "
          "exponent'."]),
        ("ids_strings", body(dense, dict(ids, data=[str(v) for v in ids["data"]])), {}, 400, "dtype",
         ["the data of the input 'ids'", "but got 'strings'"]),
        ("ids_range", body(dense, dict(ids, data=[2 ** 64] + ids["data"][1:])), {}, 400, "dtype",
         ["the data of the input 'ids'", "but got 'mixed values or integers out of range'"]),
        ("ids_bool", body(dense, dict(ids, data=[True] + ids["data"][1:])), {}, 400, "dtype",   # not taken as 1
         ["the data of the input 'ids' must be INT64 values (integers), but got 'booleans'."]),
        ("dense_bool", body(dict(dense, data=np.reshape(dense["data"], [8, 4]).tolist()[:7] + [[1.0, 2.0, 3.0, False]]),
                            ids), {}, 400, "dtype",
         ["the data of the input 'dense' must be FP32 values (numbers), but got 'booleans'."]),
        ("ids_range_mixed", body(dense, dict(ids, data=[-1, 2 ** 63] + ids["data"][2:])), {}, 400, "dtype",
         ["the data of the input 'ids'", "but got 'mixed values or integers out of range'"]),   # (numpy: floats)
        ("name", body(dict(dense, name="dens"), ids), {}, 400, "name",
         ["the name of inputs[0] must be one of ['dense', 'ids'] (the model's inputs), but got 'dens'."]),
        ("name_list", body(dict(dense, name=["dense"]), ids), {}, 400, "name",
         ["the name of inputs[0] must be one of ['dense', 'ids'] (the model's inputs), but got ['dense']."]),
        ("name_object", body(dense, dict(ids, name={"ids": 1})), {}, 400, "name",
         ["the name of inputs[1] must be one of", "but got {'ids': 1}."]),
        ("twice", body(dense, ids, dense), {}, 400, "name", ["the input 'dense' must be given once"]),
        ("missing", body(dense), {}, 400, "missing",
         ["the input 'ids' must be given (INT64 [-1, 6]), but got 'a request without it'."]),
        ("output", dict(good, outputs=[{"name": "logit"}]), {}, 400, "name",
         ["the name of outputs[0] must be 'probability' (the model's output), but got 'logit'."]),
        ("nan", nan, {}, 400, "non_finite",
         ["the values of the input 'dense' must be finite numbers, but got '1 non-finite values'."]),
        ("beyond_fp32", body(dict(dense, data=[1e39] + dense["data"][1:]), ids), {}, 400, "non_finite",
         ["the values of the input 'dense' must be numbers FP32 holds (of magnitude at most 3.403e+38), but got "
          "'1 beyond them, the first 1e+39'."]),
        ("inf_binary", head + inf.tobytes(), {"Inference-Header-Content-Length": str(len(head))},
         400, "non_finite", ["the values of the input 'dense' must be finite numbers"]),
        ("binary_extra", head + b.dense.tobytes() + b"\0" * 8, {"Inference-Header-Content-Length": str(len(head))},
         400, "malformed", ["the binary data of the request must be 128 bytes (the inputs' binary_data_size), but "
                            "got '136 bytes'."]),
        ("binary_short", head + b.dense.tobytes()[:100], {"Inference-Header-Content-Length": str(len(head))},
         400, "malformed", ["the binary data of the input 'dense' must be 128 bytes, but got '100 bytes left"]),
        ("binary_size", json.dumps(body(dict(dense, data=None, parameters={"binary_data_size": 64}), ids)).encode(),
         {"Inference-Header-Content-Length": "999999"}, 400, "malformed",
         ["the header 'Inference-Header-Content-Length' must be the bytes of the body's JSON part"]),
        ("header_digit", head + b.dense.tobytes(), {"Inference-Header-Content-Length": "\u00b2"}, 400, "malformed",
         ["the header 'Inference-Header-Content-Length' must be the bytes of the body's JSON part"]),
        ("header_digits", head + b.dense.tobytes(), {"Inference-Header-Content-Length": "9" * 5000}, 400, "malformed",
         ["the header 'Inference-Header-Content-Length' must be the bytes of the body's JSON part"]),   # (int() refuses)
        ("json", b'{"inputs": [', {}, 400, "malformed",
         ["the request body must be an inference request (a JSON object), but got 'malformed JSON"]),
        ("not_object", b"[1, 2]", {}, 400, "malformed", ["the request must be a JSON object with a list 'inputs'"]),
        ("inputs_null", b'{"inputs": null}', {}, 400, "malformed",
         ["the request must be a JSON object with a list 'inputs', but got \"'inputs': null\"."]),
        ("data_null", body(dict(dense, data=None), ids), {}, 400, "dtype",
         ["the data of the input 'dense' must be FP32 values (numbers), but got 'nulls'."]),
        ("ids_null", body(dense, dict(ids, data=[None] + ids["data"][1:])), {}, 400, "dtype",
         ["the data of the input 'ids' must be INT64 values (integers), but got 'nulls'."]),
        ("gzip", gzip.compress(json.dumps(good).encode()), {"Content-Encoding": "gzip"}, 415, "malformed",
         ["the header 'Content-Encoding' must be identity (uncompressed), but got 'gzip'."]),
        ("too_large", b" " * 70000 + json.dumps(good).encode(), {}, 413, "too_large",
         ["the request body must be at most 65536 bytes (--max-body-bytes), but got '"]),
    ]


def test_serve_refusals(bundles, served):
    """Every bad request is a 4xx whose JSON error names the input, the expected and the given, counted
    in the metrics by kind; never a 500. The server serves on after each."""
    counts = {}
    for case, body, headers, status, kind, parts in _refusals(bundles):
        got, _, answer = _http(served, "/v2/models/ctr/infer", body, headers)
        assert got == status, (case, answer)
        message = json.loads(answer)["error"]
        assert all(part in message for part in parts), (case, message)
        counts[kind] = counts.get(kind, 0) + 1
    for kind, count in counts.items():
        assert _metric(served, "recboost_serve_errors_total", '{kind="%s"}' % kind) == count, kind
    status, _, answer = _http(served, "/v2/models/ctr/infer", method="GET")
    assert status == 405 and "POST /v2/models/ctr/infer" in json.loads(answer)["error"]
    status, _, answer = _http(served, "/v2/nothing")
    assert status == 404 and "'GET /v2/nothing' (Not Found)" in json.loads(answer)["error"]
    status, _, answer = _http(served, "/v2/models/ctr/infer/", _infer_body(bundles.dense, bundles.ids))
    assert status == 404 and "'POST /v2/models/ctr/infer/' (Not Found)" in json.loads(answer)["error"]
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:   # a client gone mid-body
        sock.sendall(b"POST /v2/models/ctr/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 10)
    deadline = time.monotonic() + 30
    while _metric(served, "recboost_serve_errors_total", '{kind="disconnected"}') != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:   # a body too slow
        sock.sendall(b"POST /v2/models/ctr/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 10)
        started = time.monotonic()
        reply = _raw_response(sock)
    assert 1.5 < time.monotonic() - started < 20, time.monotonic() - started
    assert reply.startswith("HTTP/1.1 408") and reply.endswith("the request body must be whole within 2 s of its "
                                                               "headers (--body-seconds), but got '10 bytes by then'.\"}")
    assert _metric(served, "recboost_serve_errors_total", '{kind="slow_body"}') == 1
    assert _metric(served, "recboost_serve_errors_total", '{kind="internal"}') == 0
    assert "Traceback" not in "".join(served.lines) and "RuntimeWarning" not in "".join(served.lines)
    status, _, body = _http(served, "/v2/models/ctr/infer", _infer_body(bundles.dense, bundles.ids))
    assert status == 200 and json.loads(body)["model_version"] == "15"


@pytest.mark.serial      # worker processes and deadlines: not beside another test process (pytest.ini)
def test_serve_follows_a_live_directory(bundles, server_of, tmp_path):
    """A directory followed live while a client queries: a damaged delta is refused (logged by name,
    counted) and step 5 served on; the next delta, copied in before its base, is refused; the good delta
    in its place is swapped in, and then the one that came early; a half-written bundle is refused and a
    new full bundle swapped in. Every response's model_version is the bundle whose predictions it carries,
    bit for bit; the versions only go forward."""
    live = tmp_path / "live"
    live.mkdir()
    _place(bundles.src / _bundle_name(5), live / _bundle_name(5))
    server = server_of(live, "--poll-interval", "0.05")
    responses, stop = [], threading.Event()

    def client():
        while not stop.is_set():
            responses.append(_infer_json(server, bundles.dense, bundles.ids))
    thread = threading.Thread(target=client, daemon=True)
    thread.start()

    def served(step):
        server.wait_for(lambda line: line.get("event") == "bundle_served" and line["step"] == step, 60)
        deadline = time.monotonic() + 30
        while not responses or responses[-1][0] != step:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
    try:
        served(5)
        damaged = _damaged_copy(bundles.src / _bundle_name(10), tmp_path / "damaged", "table-0-rows.npy", 3)
        _place(damaged, live / _bundle_name(10))
        refusal = server.wait_for(lambda line: line.get("event") == "bundle_refused", 60)
        assert refusal["bundle"] == str(live / _bundle_name(10)) and "'table-0-rows.npy'" in refusal["error"] \
            and "(altered)" in refusal["error"]
        time.sleep(0.3)                                    # several polls: refused once, not read again
        assert _metric(server, "recboost_serve_refused_bundles_total") == 1
        assert _metric(server, "recboost_serve_bundle_step") == 5 and responses[-1][0] == 5
        _place(bundles.src / _bundle_name(15), live / _bundle_name(15))      # before its base, 10: refused
        refusal = server.wait_for(lambda line: line.get("event") == "bundle_refused" and
                                  line["bundle"] == str(live / _bundle_name(15)), 60)
        assert "must be a delta on the current bundle" in refusal["error"]
        shutil.rmtree(live / _bundle_name(10))
        _place(bundles.src / _bundle_name(10), live / _bundle_name(10))
        server.wait_for(lambda line: line.get("event") == "bundle_served" and line["step"] == 10, 60)
        served(15)                                         # tried again once its base is served (same poll)
        half = live / _bundle_name(17)                     # half-written: files copied in, no manifest yet
        half.mkdir()
        shutil.copy(bundles.src / _bundle_name(15) / "table-0-rows.npy", half)
        refusal = server.wait_for(lambda line: line.get("event") == "bundle_refused" and line["bundle"] == str(half),
                                  60)                      # (not an earlier refusal: its path may hold "17")
        assert refusal["error"] == "For 'recboost serve', the bundle %r must be a complete bundle (holding " \
            "manifest.json), but got 'a directory without it (half-written, or not a bundle)'." % str(half)
        _place(bundles.full, live / _bundle_name(20))      # a full bundle: a fresh network, built aside
        served(20)
        _place(bundles.src / _bundle_name(5), live / _bundle_name(25))     # an older bundle named newer
        refusal = server.wait_for(lambda line: line.get("event") == "bundle_refused" and
                                  line["bundle"] == str(live / _bundle_name(25)), 60)
        assert "the manifest's field 'step'" in refusal["error"] and "gives, 25, but got 5" in refusal["error"]
        time.sleep(0.3)                                    # polls: step 20 served on, never back to 5
        assert _metric(server, "recboost_serve_bundle_step") == 20 and responses[-1][0] == 20
    finally:
        stop.set()
        thread.join(30)
    versions = [step for step, _ in responses]
    assert versions == sorted(versions) and {5, 15, 20} <= set(versions) <= {5, 10, 15, 20}
    for step, probs in responses:
        assert probs.tobytes() == bundles.expected[step].tobytes(), step
    assert _metric(server, "recboost_serve_refused_bundles_total") == 4
    assert _metric(server, "recboost_serve_bundle_swaps_total") == 3
    assert 0 <= _metric(server, "recboost_serve_bundle_age_seconds") < 600


@pytest.mark.slow
@pytest.mark.serial      # worker processes and deadlines: not beside another test process (pytest.ini)
@pytest.mark.parametrize("workers", [1, 2])
def test_serve_follows_a_directory_replaced_by_another_runs(bundles, server_of, tmp_path, workers):
    """A bundle replaced at the path served (another id, the same step: another run's), its manifest then
    damaged in place, the directory deleted, then filled by another run from its start (lower steps): each
    change to the bundle served is logged ('bundle_left', once) and the newest bundle that passes is served
    with its whole chain, as at start; with none (the damaged one refused), the one served goes on. Older
    bundles removed change nothing. In one process and with workers."""
    live = tmp_path / "live"
    live.mkdir()
    for step in (5, 10, 15):
        _place(bundles.src / _bundle_name(step), live / _bundle_name(step))
    server = server_of(live, "--poll-interval", "0.05", *(["--workers", str(workers)] if workers > 1 else []))

    def served(step, bundle_id=None):
        line = server.wait_for(lambda line: line.get("event") == "bundle_served" and line["step"] == step and
                               line["id"] == (bundle_id or line["id"]) and line not in seen, 120)
        seen.append(line)
        deadline = time.monotonic() + 60
        while _infer_json(server, bundles.dense, bundles.ids)[0] != step:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        got = _infer_json(server, bundles.dense, bundles.ids)
        assert got[0] == step and got[1].tobytes() == bundles.expected[step].tobytes()

    def left(bundle, now):
        return server.wait_for(lambda line: line.get("event") == "bundle_left" and line["bundle"] == str(bundle)
                               and line["now"] == now, 60)
    seen = []
    served(15)
    _place(bundles.full, live / _bundle_name(20))    # a full bundle, then the bundles before it removed
    served(20)
    for step in (5, 10, 15):
        shutil.rmtree(live / _bundle_name(step))
    shutil.rmtree(live / _bundle_name(20))           # the bundle served replaced at its path: another id
    _place(bundles.again, live / _bundle_name(20))
    left(live / _bundle_name(20), "replaced")
    again = json.loads((bundles.again / "manifest.json").read_text())["id"]
    served(20, again)
    manifest = live / _bundle_name(20) / "manifest.json"     # the one served damaged in place: read as replaced,
    manifest.write_bytes(manifest.read_bytes()[:-40])        # it is refused when taken again, and goes on served
    server.wait_for(lambda line: line.get("event") == "bundle_refused" and line["bundle"] == str(manifest.parent)
                    and "manifest" in line["error"], 60)
    assert [line["now"] for line in server.log if line.get("event") == "bundle_left"] == ["replaced", "replaced"]
    assert _infer_json(server, bundles.dense, bundles.ids)[0] == 20
    shutil.rmtree(live)                              # another run, from its start: steps 5 and 10
    left(live / _bundle_name(20), "gone")
    time.sleep(0.3)                                  # polls with no bundle: served on, said once
    assert _infer_json(server, bundles.dense, bundles.ids)[0] == 20
    assert _http(server, "/v2/health/ready")[0] == 200
    live.mkdir()
    for step in (5, 10):
        _place(bundles.src / _bundle_name(step), live / _bundle_name(step))
    served(10)
    assert [line["now"] for line in server.log if line.get("event") == "bundle_left"] == ["replaced"] * 2 + ["gone"]


def test_serve_batches_and_drains_on_sigterm(bundles, server_of):
    """Concurrent requests are merged into one predict call up to --max-batch-size rows (the batch full:
    run at once, whatever --max-delay-ms); on SIGTERM the request in flight (waiting in the batcher for
    others, --max-delay-ms 10 min) is run at once and answered, and the server exits 0; a client that sent
    half its body and waits gets a 503 (a JSON error) after --drain-seconds; one that sent half its headers
    is closed."""
    server = server_of(bundles.src, "--max-batch-size", "24", "--max-delay-ms", "600000", "--drain-seconds", "2")
    head = b"POST /v2/models/recboost/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
    stalled = [socket.create_connection(("127.0.0.1", server.port), timeout=120) for _ in range(2)]
    stalled[0].sendall(head + b"\r\n{")                             # half its body
    stalled[1].sendall(head[:40])                                   # half its headers
    results = []
    threads = [threading.Thread(target=lambda: results.append(_http(
        server, "/v2/models/recboost/infer", _infer_body(bundles.dense, bundles.ids)))) for _ in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while _metric(server, "recboost_serve_batch_rows_count") < 2 or \
            _metric(server, "recboost_serve_queued_requests") < 1:      # the warm-up, 3 requests merged; the 4th
        assert time.monotonic() < deadline                              # waits for others
        time.sleep(0.02)
    assert _metric(server, "recboost_serve_batch_rows_sum") == 1 + 24
    assert _metric(server, "recboost_serve_queued_requests") == 1 and len(results) < 4
    server.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    for thread in threads:
        thread.join(60)
    assert server.stop() == 0 and time.monotonic() - sent < 30     # (the stalled client would hold it)
    reply = _raw_response(stalled[0])
    assert reply.startswith("HTTP/1.1 503") and "the request must be answered within --drain-seconds" in reply
    assert stalled[1].recv(100) == b""
    for sock in stalled:
        sock.close()
    assert [status for status, _, _ in results] == [200] * 4
    for _, _, body in results:                 # a merged batch may round its rows apart from one of 8 rows
        answer = json.loads(body)
        got = np.array(answer["outputs"][0]["data"], np.float32).reshape(8, 1)
        assert answer["model_version"] == "15" and np.abs(got - bundles.expected[15]).max() <= 1e-6
    assert server.log[-1]["event"] == "stopped" and "Traceback" not in "".join(server.lines)


NETWORKS = """
import mindspore as ms
import recboost as rb


def build(deepfm=False):
    ms.set_seed(3)
    table = rb.HashEmbedding(9, 64, input_index=1, name="ids")
    return rb.WideDeep(4, 6, 8, (16,), embedding=table, deepfm=deepfm)


def deepfm():
    return build(deepfm=True)
"""


def test_serve_network_option(bundles, server_of, tmp_path):
    """--network module:callable builds the network; the bundle's recorded network is checked against
    it: the same network serves bit for bit, DeepFM for a Wide&Deep bundle is refused by name (every
    bundle refused: exit 2, no traceback)."""
    (tmp_path / "nets.py").write_text(NETWORKS)
    env = {"PYTHONPATH": str(tmp_path)}
    server = server_of(bundles.src, "--network", "nets:build", env=env)
    step, probs = _infer_json(server, bundles.dense, bundles.ids)
    assert step == 15 and probs.tobytes() == bundles.expected[15].tobytes()
    refused = _Server(bundles.src, "--network", "nets:deepfm", env=env, wait=False)
    assert refused.proc.wait(120) == 2
    refused.reader.join(5)
    assert [line["bundle"][-13:] for line in refused.log if line["event"] == "bundle_refused"] == \
        [_bundle_name(step)[-13:] for step in (15, 10, 5)]
    assert "the setting 'model' of 'network' must be 'widedeep'" in refused.log[0]["error"]
    assert "whose bundles were all refused (see the log)" in refused.lines[-1]
    assert "Traceback" not in "".join(refused.lines)


def test_serve_without_the_extra(bundles):
    """import recboost imports no server module; serving without the extra 'serve' is exit 2 saying how
    to install it."""
    code = ("import sys\n"
            "import recboost\n"
            "assert not {'starlette', 'uvicorn', 'prometheus_client'} & set(sys.modules)\n"
            "sys.modules['uvicorn'] = None\n"
            "recboost.main(['serve', sys.argv[1]])\n")
    done = subprocess.run([sys.executable, "-c", code, str(bundles.src)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith("For 'recboost serve', serving needs the optional extra 'serve' (starlette, "
                                        "uvicorn, prometheus_client): pip install 'recboost[serve]' (missing: "
                                        "uvicorn).")


def test_serve_help_documents_every_option():
    """--help names every option with its text, and a bad option value is exit 2."""
    done = subprocess.run([sys.executable, "-m", "recboost", "serve", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for option in ("--host HOST the address", "--port PORT the TCP port", "--model-name NAME the model's name",
                   "--max-batch-size ROWS merge", "--max-delay-ms MS wait", "--poll-interval S look for",
                   "--network MODULE:CALLABLE build", "--max-body-bytes BYTES refuse", "DIR a train --export",
                   "--max-queue REQUESTS refuse a request with 503", "--workers N serve with this many worker",
                   "--drain-seconds S on SIGTERM, answer the requests in flight"):
        assert option in text, option
    done = subprocess.run([sys.executable, "-m", "recboost", "serve", ROOT, "--max-batch-size", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "For 'recboost serve', 'max_batch_size' must be an int >= 1, but got 0." \
        in done.stderr

def test_serve_settings_bound_the_waits():
    """--max-delay-ms, --poll-interval and --drain-seconds are bounded (an hour, a day, an hour): a larger one
    would overflow the batcher's or the follower's wait (a thread dead on its first request), so it is
    refused by name."""
    checked = rb._ServeSettings.checked
    for name, value, expected in (("max_delay_ms", 1e308, "a number of milliseconds from 0 to 3600000 (an hour)"),
                                  ("max_delay_ms", -1, "a number of milliseconds from 0 to 3600000 (an hour)"),
                                  ("max_delay_ms", float("nan"), "a number of milliseconds from 0 to 3600000"),
                                  ("poll_interval", 1e308, "a number of seconds > 0, at most 86400"),
                                  ("poll_interval", 0, "a number of seconds > 0, at most 86400"),
                                  ("drain_seconds", -1, "a number of seconds from 0 to 3600"),
                                  ("drain_seconds", float("inf"), "a number of seconds from 0 to 3600")):
        with pytest.raises(ValueError, match=r"For 'recboost serve', '%s' must be %s" % (name, re.escape(expected))):
            checked("recboost serve", {name: value})
    settings = checked("recboost serve", {"max_delay_ms": 3600000, "poll_interval": 86400, "drain_seconds": 0})
    assert (settings.max_delay_ms, settings.poll_interval, settings.drain_seconds) == (3600000, 86400, 0)


def test_a_bundle_named_for_another_step_or_breaking_its_install_is_refused(bundles, capfd):
    """A server reads a bundle once (``_take_bundle``): one whose manifest's step is not the step of its
    name (a copy of an older bundle placed as a newer one would be served, then the newer chain again,
    over and over) is refused naming both; whatever error its install raises (an IndexError of a manifest
    edited with its checksum remade) refuses it too, logged and counted: the follower never dies of it."""
    refused, counted = {}, []
    path = str(bundles.src / _bundle_name(5))

    def take(refused, install, step):
        return rb._take_bundle("recboost serve", path, refused, None, install, lambda: counted.append(1), step)
    assert take(refused, lambda *a: "ok", 25) is None
    assert take(refused, lambda *a: "ok", 25) is None          # passed over: refused once
    err = capfd.readouterr().err
    assert len(counted) == 1 and ("For 'recboost serve', the manifest's field 'step' of the bundle %r must be the "
                                  "step its name gives, 25, but got 5." % path) in err

    def broken(manifest, inputs, created):
        return [][manifest["step"]]
    assert take({}, broken, 5) is None
    assert len(counted) == 2 and "IndexError: list index out of range" in capfd.readouterr().err
    taken = take({}, lambda *a: "ok", 5)
    assert taken[0]["step"] == 5 and taken[3] == "ok" and len(counted) == 2


@pytest.mark.slow
def test_serve_a_train_job_export_and_refuse_a_bundle_whose_model_the_job_did_not_train(tmp_path):
    """A ``recboost train --export`` directory is served as the job's network (its train-config.json):
    it answers as a Predictor of that network does. A full bundle whose manifest says DeepFM (edited with
    its checksum remade: DeepFM has Wide&Deep's parameters, so nothing else tells) is refused, naming the
    job's train-config.json: every bundle of the chain refused, the server exits 2."""
    import mindspore as ms
    from test_train_cli import BS, _lines
    path = tmp_path / "day.txt"
    path.write_text("".join(_lines(64 * 4 + 5)))
    export = tmp_path / "export"
    assert rb.main(["train", "--data", str(path), "--batch-size", str(BS), "--export", str(export), "--export-every",
                    "2", "--capacity", "4096", "--progress-seconds", "1000"]) == 0
    names = sorted(n for n in os.listdir(export) if n.startswith("bundle-"))
    assert names == ["bundle-000000002", "bundle-000000004", "bundle-000000005"]
    ms.set_seed(1)
    batch = next(iter(rb.CriteoReader(str(path), batch_size=8)))
    dense, ids = (np.asarray(part) for part in batch[:2])
    table = rb.HashEmbedding(17, 64, use_dynamic_expansion=True, input_index=1, name="ids")
    predictor = rb.Predictor(rb.WideDeep(13, 26, 16, (400, 400), embedding=table), str(export / names[-1]))
    expected = _probability(predictor.predict(dense, ids))
    server = _Server(export)
    try:
        step, probs = _infer_json(server, dense, ids)
    finally:
        server.stop()
    assert step == 5 and probs.tobytes() == expected.tobytes()
    manifest_path = export / names[0] / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest.pop("sha256") and manifest["network"]["settings"]["model"] == "widedeep"
    manifest["network"]["settings"]["model"] = "deepfm"              # the checksum made again, as docs/serving.md
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)   # describes it
    manifest_path.write_text(json.dumps(dict(manifest, sha256=hashlib.sha256(canonical.encode()).hexdigest())))
    refused = _Server(export, wait=False)
    assert refused.proc.wait(120) == 2
    refused.reader.join(5)
    errors = [line["error"] for line in refused.log if line["event"] == "bundle_refused"]
    assert len(errors) == 3 and "Traceback" not in "".join(refused.lines)
    assert errors[-1] == ("For 'recboost serve', the setting 'model' of the bundle %r must be 'widedeep', the model "
                          "of the job that trained it (%s), but got 'deepfm'." % (str(export / names[0]),
                                                                                 export / "train-config.json"))


TINY = """
import mindspore as ms
from mindspore import nn, ops
import recboost as rb


class Tiny(nn.Cell):
    def __init__(self):
        super().__init__()
        self.table = rb.HashEmbedding(4, 256, access_threshold=1, use_dynamic_expansion=True, input_index=1,
                                      name="items")
        self.out = nn.Dense(3 + 5 * 4, 1)

    def construct(self, dense, ids):
        rows = self.table(ids)
        return self.out(ops.concat((dense, rows.reshape((rows.shape[0], -1))), 1))


def build():
    ms.set_seed(0)
    return Tiny()
"""


@pytest.mark.serial      # worker processes and deadlines: not beside another test process (pytest.ini)
def test_serve_a_network_of_ones_own(server_of, tmp_path, monkeypatch):
    """A network recboost does not rebuild is served with --network (its inputs from the bundle's
    mindir.inputs), bit for bit a Predictor's; without --network, from the bundle's MindIR (no user
    code: the rows looked up from its tables, the MindIR run on them), bit for bit a Predictor's too,
    across a delta (which brings its own MindIR), by one process and by 2 workers; a bundle without
    MindIR is refused by name (exit 2)."""
    import itertools
    from mindspore import nn
    (tmp_path / "tinynet.py").write_text(TINY)
    monkeypatch.syspath_prepend(str(tmp_path))
    import tinynet
    net = tinynet.build()
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-2))
    stream = iter(rb.SyntheticClickStream(num_dense=3, num_sparse=5, vocab_sizes=[100] * 5, batch_size=64,
                                          seed=2))
    model.train(1, list(itertools.islice(stream, 3)), dataset_sink_mode=False)
    dense, ids, _ = next(iter(rb.SyntheticClickStream(num_dense=3, num_sparse=5, vocab_sizes=[100] * 5,
                                                      batch_size=4, seed=3)))
    bundle = str(tmp_path / "exp" / _bundle_name(3))
    model.export(bundle, mindir=(dense, ids))
    model.train(1, list(itertools.islice(stream, 3)), dataset_sink_mode=False)
    delta = str(tmp_path / _bundle_name(6))
    model.export(delta, base=bundle, mindir=(dense, ids))
    predictor = rb.Predictor(tinynet.build(), bundle)
    expected = _probability(predictor.predict(dense, ids))
    expected_delta = _probability(predictor.apply(delta).predict(dense, ids))
    assert np.abs(expected - expected_delta).max() > 1e-5
    env = {"PYTHONPATH": str(tmp_path)}
    inputs = [{"name": "dense", "datatype": "FP32", "shape": [-1, 3]},
              {"name": "ids", "datatype": "INT64", "shape": [-1, 5]}]
    server = server_of(tmp_path / "exp", "--network", "tinynet:build", env=env)
    status, _, body = _http(server, "/v2/models/recboost")
    assert status == 200 and json.loads(body)["inputs"] == inputs
    step, probs = _infer_json(server, dense, ids)
    assert step == 3 and probs.tobytes() == expected.tobytes()
    servers = [server_of(tmp_path / "exp", "--poll-interval", "0.1", *workers)   # no --network or PYTHONPATH
               for workers in ((), ("--workers", "2"))]
    for server in servers:
        status, _, body = _http(server, "/v2/models/recboost")
        assert status == 200 and json.loads(body)["inputs"] == inputs
        for _ in range(4):                                  # (--workers 2: each worker, most likely)
            step, probs = _infer_json(server, dense, ids)
            assert step == 3 and probs.tobytes() == expected.tobytes()
    _place(delta, tmp_path / "exp" / _bundle_name(6))
    for server in servers:
        server.wait_for(lambda line: line.get("event") == "bundle_served" and line["step"] == 6, 120)
    deadline = time.monotonic() + 120
    while _metric(servers[1], "recboost_serve_bundle_step") != 6:          # every worker swapped
        assert time.monotonic() < deadline, "".join(servers[1].lines)
        time.sleep(0.1)
    for server in servers:
        for _ in range(4):
            step, probs = _infer_json(server, dense, ids)
            assert step == 6 and probs.tobytes() == expected_delta.tobytes()
    plain = str(tmp_path / "plain" / _bundle_name(6))
    model.export(plain)
    refused = _Server(tmp_path / "plain", env=env, wait=False)
    assert refused.proc.wait(120) == 2
    refused.reader.join(5)
    assert refused.log[0]["error"] == "For 'recboost serve', the network of the bundle %r must be a " \
        "recboost WideDeep, or a bundle exported with mindir= (its manifest lists the network's " \
        "inputs), but got 'tinynet:Tiny'." % plain


POOLED = """
import mindspore as ms
from mindspore import nn, ops
import recboost as rb


class Pooled(nn.Cell):
    def __init__(self, combiner, fields=1):
        super().__init__()
        self.items = rb.HashEmbedding(4, 256, access_threshold=1, use_dynamic_expansion=True, input_index=1,
                                      name="items")
        self.tags = rb.HashEmbedding(4, 256, access_threshold=1, use_dynamic_expansion=True, input_index=2,
                                     name="tags", combiner=combiner)
        self.out = nn.Dense(3 + 3 * 4 + 4 * fields, 1)

    def construct(self, dense, items, tags):
        rows, pooled = self.items(items), self.tags(tags)
        flat = (rows.shape[0], -1)
        return self.out(ops.concat((dense, rows.reshape(flat), pooled.reshape(flat)), 1))


def build(combiner, fields=1):
    ms.set_seed(0)
    return Pooled(combiner, fields)
"""


def _pooled_batch(rows, seed):
    """``(dense, items, values, offsets, weights)``: a batch of the Pooled network, its ``tags`` a ragged
    feature (bags of 0 to 4 ids, the first bag empty; a weight per id, one of them 0)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, size=rows)
    lengths[0] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = rng.integers(0, 40, size=offsets[-1]).astype(np.int64)
    weights = rng.uniform(0.1, 2, size=values.size).astype(np.float32)
    weights[min(1, values.size - 1)] = 0
    dense, items = rng.normal(size=(rows, 3)).astype(np.float32), rng.integers(0, 50, size=(rows, 3))
    return dense, items.astype(np.int64), values, offsets, weights


def _pooled_body(dense, items, values, offsets, weights=None):
    """A JSON infer request of the Pooled network: ``tags`` as its ids, ``tags_offsets`` (where each row's
    bag starts) and, when given, ``tags_weights``."""
    inputs = [{"name": "dense", "datatype": "FP32", "shape": list(dense.shape),
               "data": dense.ravel().tolist()},
              {"name": "items", "datatype": "INT64", "shape": list(items.shape),
               "data": items.ravel().tolist()},
              {"name": "tags", "datatype": "INT64", "shape": [values.size], "data": values.tolist()},
              {"name": "tags_offsets", "datatype": "INT64", "shape": [offsets.size - 1],
               "data": offsets[:-1].tolist()}]
    if weights is not None:
        inputs.append({"name": "tags_weights", "datatype": "FP32", "shape": [weights.size],
                       "data": weights.tolist()})
    return {"inputs": inputs}


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "max"])
def test_serve_ragged_pooled_and_weighted_ids_of_two_tables(server_of, tmp_path, monkeypatch, combiner):
    """A network of two tables, one read per id and one pooling a ragged feature with ``combiner``
    (trained with weighted ids), served from its MindIR: its inputs in the metadata; responses with and
    without weights (empty bags, a weight of 0) bit for bit a Predictor's, over JSON and tritonclient's
    binary data; every bad ragged part refused by name with what was expected and given."""
    import tritonclient.http as httpclient
    from mindspore import nn
    (tmp_path / "poolednet.py").write_text(POOLED)
    monkeypatch.syspath_prepend(str(tmp_path))
    import poolednet
    net = poolednet.build(combiner)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-2))
    train = []
    for seed in range(3):
        dense, items, values, offsets, weights = _pooled_batch(64, seed)
        label = (np.random.default_rng(seed).random((64, 1)) < 0.3).astype(np.float32)
        train.append((dense, items, rb.WeightedIds(values, weights, offsets), label))
    model.train(1, train, dataset_sink_mode=False)
    batch = dense, items, values, offsets, weights = _pooled_batch(6, 10)
    model.export(str(tmp_path / "exp" / _bundle_name(3)), mindir=(dense, items, (values, offsets)))
    predictor = rb.Predictor(poolednet.build(combiner), str(tmp_path / "exp" / _bundle_name(3)))
    plain = _probability(predictor.predict(dense, items, (values, offsets)))
    weighted = _probability(predictor.predict(dense, items, rb.WeightedIds(values, weights, offsets)))
    assert np.abs(plain - weighted).max() > 1e-5
    assert plain.tobytes() == _probability(model.predict(dense, items, (values, offsets))).tobytes()
    assert weighted.tobytes() == _probability(model.predict(dense, items, rb.WeightedIds(values, weights, offsets))
                                              ).tobytes()          # (the Predictor's any-size graph: the same bits)
    server = server_of(tmp_path / "exp")
    status, _, body = _http(server, "/v2/models/recboost")
    assert status == 200 and json.loads(body)["inputs"] == [
        {"name": "dense", "datatype": "FP32", "shape": [-1, 3]}, {"name": "items", "datatype": "INT64",
                                                                  "shape": [-1, 3]},
        {"name": "tags", "datatype": "INT64", "shape": [-1]}, {"name": "tags_offsets", "datatype": "INT64",
                                                               "shape": [-1]},
        {"name": "tags_weights", "datatype": "FP32", "shape": [-1], "optional": True}]
    for given, expected in ((None, plain), (weights, weighted)):
        status, _, body = _http(server, "/v2/models/recboost/infer", _pooled_body(*batch[:4], given))
        assert status == 200, body
        output = json.loads(body)["outputs"][0]
        assert np.array(output["data"], np.float32).reshape(output["shape"]).tobytes() == expected.tobytes()
    client = httpclient.InferenceServerClient(server.url[len("http://"):])
    arrays = [("dense", dense, "FP32"), ("items", items, "INT64"), ("tags", values, "INT64"),
              ("tags_offsets", offsets[:-1], "INT64"), ("tags_weights", weights, "FP32")]
    inputs = [httpclient.InferInput(name, list(array.shape), datatype) for name, array, datatype in arrays]
    for tensor, (_, array, _) in zip(inputs, arrays):
        tensor.set_data_from_numpy(array)
    assert client.infer("recboost", inputs).as_numpy("probability").tobytes() == weighted.tobytes()
    alone = _pooled_body(dense[1:2], items[1:2], values[offsets[1]:offsets[2]], offsets[1:3] - offsets[1],
                         weights[offsets[1]:offsets[2]])             # one row (a later bag), alone
    status, _, body = _http(server, "/v2/models/recboost/infer", alone)
    assert status == 200 and np.float32(json.loads(body)["outputs"][0]["data"][0]) == weighted[1, 0]

    def bad(part, data, shape=None):
        body = _pooled_body(*batch)
        tensor = next(t for t in body["inputs"] if t["name"] == part)
        tensor.update(data=data, shape=[len(data)] if shape is None else shape)
        return body
    n, at = values.size, "(a weight per id of 'tags')"
    what = "the offsets of the input 'tags' ('tags_offsets': where each row's bag starts in it, the last " \
        "bag to its end) must be"
    cases = [
        (bad("tags_offsets", [1] + offsets[1:-1].tolist()), "ragged", "%s offsets starting at 0, but got "
         "'1 at position 0'." % what),
        (bad("tags_offsets", [0, 3, 2, 4, 5, 6]), "ragged", "%s offsets that never decrease, but got "
         "'2 after 3 at position 2'." % what),
        (bad("tags_offsets", offsets[:-2].tolist() + [n + 1]), "ragged", "%s offsets at most %d (the ids "
         "given), but got '%d at position 5'." % (what, n, n + 1)),
        (bad("tags_offsets", offsets[:-2].tolist()), "shape", "the rows of the input 'tags_offsets' must be "
         "6 like the input 'dense', but got 5."),
        (bad("tags_weights", weights[:-1].tolist()), "ragged", "the shape of the input 'tags_weights' must "
         "be [%d] %s, but got [%d]." % (n, at, n - 1)),
        (bad("tags_weights", [float("inf")] + weights[1:].tolist()), "non_finite", "the values of the input "
         "'tags_weights' must be finite numbers, but got '1 non-finite values'."),
        (bad("tags", [0.5] + values[1:].tolist()), "dtype", "the data of the input 'tags' must be INT64 "
         "values (integers), but got 'numbers with a fraction or exponent'."),
        ({"inputs": _pooled_body(*batch)["inputs"][:3]}, "missing", "the input 'tags_offsets' must be given "
         "(INT64 [-1]), but got 'a request without it'."),
    ]
    if combiner == "mean":
        cases.append((bad("tags_weights", [-0.5] + weights[1:].tolist()), "ragged", "the values of the input "
                      "'tags_weights' must be weights >= 0 (a 'mean' table pools them: sum w*e / sum w), but "
                      "got '-0.5 at position 0'."))
    for body, kind, message in cases:
        status, _, answer = _http(server, "/v2/models/recboost/infer", body)
        assert status == 400 and json.loads(answer)["error"] == "For 'infer', " + message, (kind, answer)
    for kind in {kind for _, kind, _ in cases}:
        assert _metric(server, "recboost_serve_errors_total", '{kind="%s"}' % kind) == sum(
            k == kind for _, k, _ in cases), kind
    assert _metric(server, "recboost_serve_errors_total", '{kind="internal"}') == 0


def test_serve_padded_bags_of_several_fields(server_of, tmp_path, monkeypatch):
    """A pooled input of several bags a row (ids [B, 2, L] pooled to [B, 2, width] by "mean", with weights
    in training) is served as padded ids ``tags`` INT64 [-1, 2, -1] and optional ``tags_weights``; with
    and without weights, and at two bag lengths, bit for bit a Predictor's; weights of another shape
    or negative (mean) are refused by name."""
    from mindspore import nn
    (tmp_path / "poolednet.py").write_text(POOLED)
    monkeypatch.syspath_prepend(str(tmp_path))
    import poolednet

    def padded(rows, length, seed):
        rng = np.random.default_rng(seed)
        return (rng.integers(0, 40, size=(rows, 2, length)).astype(np.int64),
                rng.uniform(0.1, 2, size=(rows, 2, length)).astype(np.float32))
    net = poolednet.build("mean", fields=2)
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-2))
    train = []
    for seed in range(3):
        dense, items, _, _, _ = _pooled_batch(64, seed)
        label = (np.random.default_rng(seed).random((64, 1)) < 0.3).astype(np.float32)
        train.append((dense, items, rb.WeightedIds(*padded(64, 3, seed)), label))
    model.train(1, train, dataset_sink_mode=False)
    dense, items, _, _, _ = _pooled_batch(4, 10)
    bundle = str(tmp_path / "exp" / _bundle_name(3))
    model.export(bundle, mindir=(dense, items, padded(4, 3, 10)[0]))
    predictor = rb.Predictor(poolednet.build("mean", fields=2), bundle)
    server = server_of(tmp_path / "exp")
    status, _, body = _http(server, "/v2/models/recboost")
    assert status == 200 and json.loads(body)["inputs"][2:] == [
        {"name": "tags", "datatype": "INT64", "shape": [-1, 2, -1]},
        {"name": "tags_weights", "datatype": "FP32", "shape": [-1, 2, -1], "optional": True}]

    def body_of(ids, weights=None):
        inputs = _pooled_body(dense, items, np.zeros(0, np.int64), np.zeros(5, np.int64))["inputs"][:2]
        inputs.append({"name": "tags", "datatype": "INT64", "shape": list(ids.shape),
                       "data": ids.ravel().tolist()})
        if weights is not None:
            inputs.append({"name": "tags_weights", "datatype": "FP32", "shape": list(weights.shape),
                           "data": weights.ravel().tolist()})
        return {"inputs": inputs}
    for length in (3, 5):
        ids, weights = padded(4, length, 20 + length)
        for given in (None, weights):
            expected = _probability(predictor.predict(dense, items, ids if given is None else rb.WeightedIds(
                ids, weights)))
            status, _, answer = _http(server, "/v2/models/recboost/infer", body_of(ids, given))
            assert status == 200, answer
            output = json.loads(answer)["outputs"][0]
            got = np.array(output["data"], np.float32).reshape(output["shape"])
            assert got.tobytes() == expected.tobytes()
    ids, weights = padded(4, 3, 0)
    negative = weights.copy()
    negative[1, 1, 2] = -1
    for weights, message in (
            (weights[:, :, :2], "the shape of the input 'tags_weights' must be [4, 2, 3] (a weight per id of "
                                "'tags'), but got [4, 2, 2]."),
            (negative, "the values of the input 'tags_weights' must be weights >= 0 (a 'mean' table pools "
                       "them: sum w*e / sum w), but got '-1.0 at position 11'.")):
        status, _, answer = _http(server, "/v2/models/recboost/infer", body_of(ids, weights))
        assert status == 400 and json.loads(answer)["error"] == "For 'infer', " + message


def test_serve_int8_rows(server_of, tmp_path):
    """An export directory of int8 bundles (a full bundle and a delta: row_dtype='int8') is served bit for
    bit as a Predictor of it serves (the rows dequantized as docs/serving.md states)."""
    import itertools
    from mindspore import nn
    net = _build()
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-2))
    stream = iter(rb.SyntheticClickStream(num_dense=4, num_sparse=6, vocab_sizes=[300] * 6, batch_size=256, seed=0))
    base = None
    for step in (5, 10):
        model.train(1, list(itertools.islice(stream, 5)), dataset_sink_mode=False)
        base = model.export(str(tmp_path / "int8" / _bundle_name(step)), base=base, row_dtype="int8")
    dense, ids, _ = next(stream)
    dense, ids = dense[:8], ids[:8]
    expected = _probability(rb.Predictor(_build(seed=4), base).predict(dense, ids))
    exact = _probability(model.predict(dense, ids).asnumpy())
    assert 0 < np.abs(expected - exact).max() < 1e-3              # int8 rows: close, not equal
    server = server_of(tmp_path / "int8")
    step, probs = _infer_json(server, dense, ids)
    assert step == 10 and probs.tobytes() == expected.tobytes()


def _children(pid):
    """The pids of the processes whose parent is ``pid``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name) as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(name))
            except (OSError, ValueError):
                pass
    return found


def _workers_now(server):
    """worker number -> pid of the workers started last (the 'worker_started' lines)."""
    return {line["worker"]: line["pid"] for line in list(server.log) if line.get("event") == "worker_started"}


@pytest.mark.serial      # worker processes and deadlines: not beside another test process (pytest.ini)
@pytest.mark.parametrize("workers", [2, 4])
def test_serve_workers(bundles, server_of, tmp_path, workers):
    """--workers N: N worker processes of the server answer on its one port, each request bit for bit a
    Predictor's of the bundle it names; a delta placed in the directory is taken by every worker, a
    damaged one refused (once, counted once), a new full bundle taken by every worker; a
    worker killed (SIGKILL, with requests waiting in the batchers: each gets an answer or a connection
    error, none hangs) is started again and serves; SIGTERM stops every worker and exits 0."""
    live = tmp_path / "live"
    live.mkdir()
    _place(bundles.src / _bundle_name(5), live / _bundle_name(5))
    server = server_of(live, "--workers", str(workers), "--poll-interval", "0.05", "--max-delay-ms", "0")
    assert server.wait_for(lambda line: line.get("event") == "listening", 1)["workers"] == workers
    started = _workers_now(server)
    assert sorted(started) == list(range(workers)) and set(started.values()) <= set(_children(server.proc.pid))
    for _ in range(2 * workers):                     # a new connection each: the workers share them
        step, probs = _infer_json(server, bundles.dense, bundles.ids)
        assert step == 5 and probs.tobytes() == bundles.expected[5].tobytes()
    _place(bundles.src / _bundle_name(10), live / _bundle_name(10))
    server.wait_for(lambda line: line.get("event") == "bundle_served" and line["step"] == 10, 60)
    deadline, tens = time.monotonic() + 60, 0
    while tens < 4 * workers:                        # every worker swaps on its own: then only 10 answers
        assert time.monotonic() < deadline
        step, probs = _infer_json(server, bundles.dense, bundles.ids)
        assert probs.tobytes() == bundles.expected[step].tobytes()
        tens = tens + 1 if step == 10 else 0
    # refused once, by the supervisor (which counts it)
    damaged = _damaged_copy(bundles.src / _bundle_name(15), tmp_path / "damaged", "table-0-ids.npy", 2)
    _place(damaged, live / _bundle_name(15))
    refusal = server.wait_for(lambda line: line.get("event") == "bundle_refused", 60)
    assert "'table-0-ids.npy'" in refusal["error"] and "worker" not in refusal
    _place(bundles.full, live / _bundle_name(20))    # a full bundle: a fresh network in every worker
    server.wait_for(lambda line: line.get("event") == "bundle_served" and line["step"] == 20, 60)
    deadline, twenties = time.monotonic() + 120, 0
    while twenties < 4 * workers:
        assert time.monotonic() < deadline
        step, probs = _infer_json(server, bundles.dense, bundles.ids)
        assert step in (10, 20) and probs.tobytes() == bundles.expected[step].tobytes()
        twenties = twenties + 1 if step == 20 else 0
    for _ in range(2 * workers):                     # the supervisor's counts, whichever worker is scraped
        assert _metric(server, "recboost_serve_refused_bundles_total") == 1
        assert _metric(server, "recboost_serve_bundle_swaps_total") == 2
    if workers == 2:
        slow = server_of(live, "--workers", "2", "--max-delay-ms", "3000", "--max-batch-size", "1000")
        results = []

        def ask():
            try:
                results.append(_http(slow, "/v2/models/recboost/infer", _infer_body(bundles.dense, bundles.ids))[0])
            except OSError as exc:                   # the killed worker's connections: closed, an error
                results.append(type(exc).__name__)
        threads = [threading.Thread(target=ask) for _ in range(6)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        killed = _workers_now(slow)[0]
        os.kill(killed, signal.SIGKILL)
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads) and len(results) == 6
        assert set(results) <= {200, "RemoteDisconnected", "ConnectionResetError", "URLError"}, results
        exited = slow.wait_for(lambda line: line.get("event") == "worker_exited", 30)
        assert exited["worker"] == 0 and exited["pid"] == killed and exited["code"] == -signal.SIGKILL
        slow.wait_for(lambda line: line.get("event") == "worker_started" and line["pid"] != killed and
                      line["worker"] == 0, 30)
        replaced = _workers_now(slow)[0]
        deadline = time.monotonic() + 120
        while True:                                  # the new worker compiles, then answers with the others
            status, _, body = _http(slow, "/v2/models/recboost/infer", _infer_body(bundles.dense, bundles.ids))
            if status == 200:
                break
            assert time.monotonic() < deadline
        assert json.loads(body)["model_version"] == "20" and replaced in _children(slow.proc.pid)
        assert slow.stop() == 0 and slow.log[-1]["event"] == "stopped"
    pids = set(_workers_now(server).values())
    assert server.stop() == 0
    assert server.log[-1]["event"] == "stopped" and server.log[-1]["worker_codes"] == [0] * workers
    assert sum(line.get("event") == "worker_stopped" for line in server.log) == workers
    assert not pids & set(_children(os.getpid())) and "Traceback" not in "".join(server.lines)


def _anonymous(pid):
    """The anonymous memory (bytes) of the process ``pid`` (/proc/PID/smaps_rollup): its heap and
    arrays; not the pages of a file it maps (the shared rows' files of /dev/shm are shmem)."""
    with open("/proc/%d/smaps_rollup" % pid) as fh:
        return int(re.search(r"^Anonymous:\s+(\d+) kB", fh.read(), re.M).group(1)) * 1024


def _mapped_files(pid):
    """The paths of the files the process ``pid`` maps (/proc/PID/maps)."""
    with open("/proc/%d/maps" % pid) as fh:
        return {line.split(None, 5)[5].strip() for line in fh if len(line.split(None, 5)) == 6}


@pytest.mark.serial      # worker processes and deadlines: not beside another test process (pytest.ini)
def test_serve_workers_share_the_rows(server_of, tmp_path):
    """A bundle of 2^20 rows of width 64 (R = 256 MiB of float32 rows): one server process holds them in
    its own (anonymous) memory; with 4 workers every worker maps the supervisor's shared rows file, and
    no process of the server (supervisor, workers) holds a copy: each one's anonymous memory is below
    the one server's less R/2. (A copy would put a process at about the one server's, R/2 above the
    bound; the rows mapped put it at about the one server's less R, R/2 below: the bound is halfway,
    whatever the runtimes' own memory, which the test does not control.)"""
    import mindspore as ms
    from mindspore import nn
    rows, dim = 1 << 20, 64
    ms.set_seed(0)
    table = rb.HashEmbedding(dim, rows + 2, input_index=1, name="ids", optimizer=rb.SparseSGD(0.01))
    rb.sparse_lookup(table, (np.arange(rows, dtype=np.int64) + 1) * -7919)
    net = rb.WideDeep(4, 6, dim - 1, (16,), embedding=table)
    bundle = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-3)).export(
        str(tmp_path / "big" / _bundle_name(0)))
    del table, net
    rows_bytes = os.path.getsize(os.path.join(bundle, "table-0-rows.npy"))
    assert rows_bytes >= rows * dim * 4
    dense = np.zeros((8, 4), np.float32)
    ids = (np.arange(48, dtype=np.int64).reshape(8, 6) + 1) * -7919
    single = server_of(tmp_path / "big")
    for _ in range(8):
        assert _infer_json(single, dense, ids)[0] == 0
    one = _anonymous(single.proc.pid)
    assert single.stop() == 0
    assert one > rows_bytes                          # the one process: its own copy of the rows
    server = server_of(tmp_path / "big", "--workers", "4")
    for _ in range(8):
        assert _infer_json(server, dense, ids)[0] == 0
    workers = set(_workers_now(server).values())
    assert len(workers) == 4
    anonymous = {pid: _anonymous(pid) for pid in [server.proc.pid] + sorted(workers)}
    for pid in workers:
        shared = [path for path in _mapped_files(pid)
                  if "/recboost-serve-%d-" % server.proc.pid in path and path.endswith("-0-weight.npy")]
        assert len(shared) == 1 and os.path.getsize(shared[0]) >= rows_bytes, (pid, shared)
    assert all(value < one - rows_bytes / 2 for value in anonymous.values()), (one, anonymous, rows_bytes)
    assert server.stop() == 0


@pytest.mark.slow
@pytest.mark.serial      # worker processes and deadlines: not beside another test process (pytest.ini)
def test_serve_workers_metrics_are_the_whole_servers(bundles, server_of):
    """--workers 2: /metrics, scraped from any worker, counts the whole server's requests, errors and
    predict calls. The requests are sent to one worker and then the other (the other stopped with
    SIGSTOP: it accepts nothing); a worker killed keeps its counts; the gauges are the live workers'."""
    server = server_of(bundles.src, "--workers", "2", "--max-delay-ms", "0")
    workers = _workers_now(server)
    bad = _infer_body(bundles.dense, bundles.ids)
    bad["inputs"][0]["shape"] = [8, 5]
    sent = {0: 3, 1: 2}
    for number, count in sent.items():
        other = workers[1 - number]
        os.kill(other, signal.SIGSTOP)
        try:
            for _ in range(count):
                step, probs = _infer_json(server, bundles.dense, bundles.ids)
                assert step == 15 and probs.tobytes() == bundles.expected[15].tobytes()
            assert _http(server, "/v2/models/recboost/infer", bad)[0] == 400
            alone = _metric(server, "recboost_serve_requests_total")      # scraped from this worker
        finally:
            os.kill(other, signal.SIGCONT)
        assert alone == sum(sent[n] + 1 for n in range(number + 1))
    requests = sum(sent.values()) + 2
    for _ in range(6):                               # a new connection each: either worker answers
        assert _metric(server, "recboost_serve_requests_total") == requests
        assert _metric(server, "recboost_serve_errors_total", '{kind="shape"}') == 2
        assert _metric(server, "recboost_serve_batch_rows_count") == 2 + sum(sent.values())    # 2 warm-ups
        assert _metric(server, "recboost_serve_batch_rows_sum") == 2 + 8 * sum(sent.values())
        assert _metric(server, "recboost_serve_request_seconds_count") == requests
        assert _metric(server, "recboost_serve_bundle_step") == 15
        assert _metric(server, "recboost_serve_queued_requests") == 0
        assert 0 <= _metric(server, "recboost_serve_bundle_age_seconds") < 3600
    os.kill(workers[0], signal.SIGKILL)
    server.wait_for(lambda line: line.get("event") == "worker_exited", 30)
    assert _metric(server, "recboost_serve_requests_total") == requests
    assert _metric(server, "recboost_serve_bundle_step") == 15
    assert server.stop() == 0


@pytest.mark.slow
def test_serve_bounded_queue(bundles, server_of):
    """--max-queue 2: while two requests wait in the batcher (--max-delay-ms 5000; the queued-requests
    gauge says 2), a third is refused at once with 503 and a JSON error, counted as 'overloaded'; the two
    are answered, and so is the next."""
    server = server_of(bundles.src, "--max-queue", "2", "--max-delay-ms", "5000", "--max-batch-size", "1000")
    results = []
    threads = [threading.Thread(target=lambda: results.append(_http(
        server, "/v2/models/recboost/infer", _infer_body(bundles.dense, bundles.ids))[0])) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 4
    while _metric(server, "recboost_serve_queued_requests") < 2:       # both submitted (well inside the delay)
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, _, body = _http(server, "/v2/models/recboost/infer", _infer_body(bundles.dense, bundles.ids))
    assert status == 503 and results == []
    assert json.loads(body)["error"] == "For 'infer', the requests waiting for a predict call must be at most 2 " \
        "(--max-queue), but got 'a full queue: the server is overloaded, retry later'."
    for thread in threads:
        thread.join(30)
    assert results == [200, 200]
    assert _metric(server, "recboost_serve_errors_total", '{kind="overloaded"}') == 1
    assert _infer_json(server, bundles.dense, bundles.ids)[0] == 15


@pytest.mark.serial      # worker processes and deadlines: not beside another test process (pytest.ini)
def test_serve_workers_stop_when_the_supervisor_is_killed(bundles, server_of):
    """A supervisor killed (SIGKILL) leaves no server behind: its workers see their pipe close, drain and
    exit; the next supervisor removes the killed one's shared folder."""
    server = server_of(bundles.src, "--workers", "2")
    pids = list(_workers_now(server).values())
    folders = [name for name in os.listdir("/dev/shm") if name.startswith("recboost-serve-%d-" % server.proc.pid)] \
        if os.path.isdir("/dev/shm") else []
    server.proc.kill()
    server.proc.wait(30)

    def running(pid):
        try:
            with open("/proc/%d/stat" % pid) as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    deadline = time.monotonic() + 60
    while any(running(pid) for pid in pids):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    if folders:
        again = server_of(bundles.src, "--workers", "2")
        assert not set(folders) & set(os.listdir("/dev/shm"))
        assert _infer_json(again, bundles.dense, bundles.ids)[0] == 15


def _score_build(seed=0):
    import mindspore as ms
    ms.set_seed(seed)
    table = rb.HashEmbedding(9, 66, eviction_policy="score", access_threshold=-1, input_index=1, name="ids")
    return rb.WideDeep(4, 6, 8, (16,), embedding=table)


def test_serve_a_capped_bundle_and_its_capped_delta(server_of, tmp_path):
    """A "score" table of 64 rows exported capped to its 24 best rows (export(max_rows=24, mindir=...)), then
    a capped delta on it: each manifest records the cap and the policy that ranked the rows; Predictor,
    docs/serving.md's numpy reader and the serve process give the same bits on a batch holding ids the
    cap left out, which read the default row (RecModel.predict with them unknown). A bundle whose rows
    exceed its recorded cap, or a delta whose merged table does, is refused by Predictor and the reader."""
    import itertools
    from mindspore import nn
    from test_export import _edit_manifest
    from test_mindir import _serve_here
    net = _score_build()
    model = rb.RecModel(net, nn.BCEWithLogitsLoss(), nn.Adam(net.trainable_params(), 1e-2))
    stream = iter(rb.SyntheticClickStream(num_dense=4, num_sparse=6, vocab_sizes=[300] * 6, batch_size=256, seed=0))
    dense, ids, _ = next(stream)
    dense, ids = dense[:16], ids[:16]
    folder, base = tmp_path / "capped", None
    for step in (5, 10):
        model.train(1, list(itertools.islice(stream, 5)), dataset_sink_mode=False)
        assert len(net.embedding.cache) > 24 and net.embedding.cache.stats()["replaced"] > 0
        base = model.export(str(folder / _bundle_name(step)), base=base, max_rows=24, mindir=(dense, ids))
    for step, kind in ((5, "full"), (10, "delta")):
        manifest = json.load(open(folder / _bundle_name(step) / "manifest.json"))
        assert manifest["kind"] == kind
        assert manifest["tables"][0]["cap"] == {"max_rows": 24, "min_score": None, "ranked_by": "score"}
    predictor = rb.Predictor(_score_build(seed=3), base)
    kept = predictor.network.embedding.cache.ids
    assert kept.size == 24
    owned = net.embedding.cache.find(ids) != 0
    left_out = owned & ~np.isin(ids, kept)
    assert left_out.any() and (owned & ~left_out).any()          # the batch holds kept and left-out ids
    expected = predictor.predict(dense, ids)
    assert expected.tobytes() == model.predict(dense, np.where(left_out, 10 ** 12, ids)).asnumpy().tobytes()
    serve = _serve_here(tmp_path)
    manifest, tables, graph = serve["read_bundle"](base)
    assert tables[0]["ids"].tobytes() == kept.tobytes()
    assert graph(*serve["network_inputs"](manifest, tables, (dense, ids))).asnumpy().tobytes() == expected.tobytes()
    step, probs = _infer_json(server_of(folder), dense, ids)
    assert step == 10 and probs.tobytes() == _probability(expected).tobytes()
    # a recorded cap the rows exceed: refused by name (the checksum made again, as a deliberate edit would)
    edited = tmp_path / "edited"
    shutil.copytree(folder, edited)
    empty = model.export(str(edited / _bundle_name(11)), base=str(edited / _bundle_name(10)), max_rows=24,
                         mindir=(dense, ids))                 # nothing changed: 0 rows of its own
    _edit_manifest(empty, lambda m: m["tables"][0]["cap"].update(max_rows=10))
    with pytest.raises(ValueError, match=r"For 'Predictor', hash table 0 'ids' of the delta .*bundle-000000011.* "
                                         r"must be at most 10 rows \(its cap.*but got '24 rows'"):
        rb.Predictor(_score_build(), empty)
    with pytest.raises(ValueError, match="table ids holds 24 rows, more than its cap of 10"):
        serve["read_bundle"](empty)
    full = str(edited / _bundle_name(5))
    _edit_manifest(full, lambda m: m["tables"][0]["cap"].update(max_rows=23))
    with pytest.raises(ValueError, match=r"the file 'table-0-ids.npy' \(hash table 0 'ids'\) of the bundle .* must "
                                         r"be at most 23 ids \(its cap, 'tables\[0\].cap.max_rows'"
                                         r"\), but got '24 ids'"):
        rb.Predictor(_score_build(), full)
    with pytest.raises(ValueError, match="table ids holds 24 rows, more than its cap of 23"):
        serve["read_bundle"](full)
    _edit_manifest(full, lambda m: m["tables"][0]["cap"].update(max_rows=None, ranked_by="recency", min_score=0.5))
    with pytest.raises(ValueError, match=r"the manifest field 'tables\[0\].cap' .* must be None or a cap: "
                                         r"'max_rows', or 'min_score' ranked by 'score', but got .*'recency'"):
        rb.Predictor(_score_build(), full)
    _edit_manifest(full, lambda m: m["tables"][0]["cap"].update(min_score=None))
    with pytest.raises(ValueError, match=r"'tables\[0\].cap' .* a cap: .*got \{'max_rows': None, 'min_score': None"):
        rb.Predictor(_score_build(), full)
