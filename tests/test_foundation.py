"""The package shape: backend selection, kernel binding and signatures, vendoring, version check."""
import inspect
import os
import pydoc
import shutil
import subprocess
import sys

import pytest

import recboost

pytestmark = pytest.mark.fallback       # also on make test's numpy-fallback run (pytest.ini)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_import(cwd, env_extra, code="import recboost; print(recboost.FAST_BACKEND)"):
    env = dict(os.environ)
    env.pop("RECBOOST_NO_EXTENSIONS", None)
    env.pop("RECBOOST_REQUIRE_EXTENSIONS", None)
    env.update(env_extra)
    env["PYTHONPATH"] = cwd
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def test_backend_matches_environment():
    """CI runs with RECBOOST_REQUIRE_EXTENSIONS=1: there the compiled module must really be live."""
    if os.environ.get("RECBOOST_REQUIRE_EXTENSIONS") == "1":
        assert recboost.FAST_BACKEND is True
        import _recboost_fast
        assert _recboost_fast.__file__.endswith((".so", ".pyd")), _recboost_fast.__file__
        assert recboost._fast is _recboost_fast
        assert recboost.FAST_BACKEND_REASON == ""
    if os.environ.get("RECBOOST_NO_EXTENSIONS") == "1":
        assert recboost.FAST_BACKEND is False
        assert "RECBOOST_NO_EXTENSIONS" in recboost.FAST_BACKEND_REASON


def test_every_kernel_name_is_bound_to_the_live_backend():
    live = recboost._backend_kernels("fast" if recboost.FAST_BACKEND else "py")
    assert sorted(live) == sorted(recboost._KERNEL_NAMES)
    # the host-side kernels, and one fused update kernel per registered sparse optimizer
    optimizer_kernels = {kind.kernel for kind in recboost.sparse_optimizers().values()}
    assert len(optimizer_kernels) == len(recboost.sparse_optimizers()) and optimizer_kernels <= set(live)
    assert sorted(set(live) - optimizer_kernels) == sorted([
        "parse_criteo", "HashCache", "freeze_index_sequence", "pca_rows_copy", "gather_rows", "scatter_rows", "gather_pool",
        "gather_max", "unique_inverse", "unique_ids", "sum_by_row", "init_rows", "bf16_decode",
        "bf16_encode"])
    for name in live:
        bound = recboost._HashCacheKernel if name == "HashCache" else getattr(recboost, name)
        assert bound is live[name], name
    # the public HashCache: its checks in front of the bound kernel
    assert recboost.HashCache.__mro__[1:3] == (recboost._HashCacheChecks, recboost._HashCacheKernel)
    assert recboost._fast is None or recboost._HashCacheKernel is recboost._fast.HashCache


def _params(obj):
    return [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]


_HASH_CACHE_METHODS = ("lookup", "find", "counts", "evict", "stats", "state_dict", "load_state_dict", "take_replaced",
                      "record_changes", "changes", "entries")


def test_compiled_kernels_have_their_twins_signatures():
    """inspect.signature works on every compiled kernel (built with embedsignature and binding) and
    gives the numpy twin's parameters: names, kinds and defaults."""
    if not recboost.FAST_BACKEND:
        pytest.skip("about the compiled module, which this run does not use: " + recboost.FAST_BACKEND_REASON)
    fast, py = recboost._backend_kernels("fast"), recboost._backend_kernels("py")
    for name in recboost._KERNEL_NAMES:
        assert _params(fast[name]) == _params(py[name]), name
    # the kernels take the public HashCache's arguments, in its order (both read one list of the settings), but
    # its keyword-only sub-configs eviction= and admission=, whose flat values they take
    public = inspect.signature(recboost.HashCache).parameters.values()
    assert [p[0] for p in _params(fast["HashCache"])] == [p.name for p in public if p.kind != p.KEYWORD_ONLY]
    for method in _HASH_CACHE_METHODS:
        assert _params(getattr(fast["HashCache"], method)) == \
            _params(getattr(py["HashCache"], method)), method
    options = ["offsets", "scale", "largest", "clip_value", "clip_norm", "weight_decay", "decay", "weights", "argmax",
               "seed", "counter"]
    assert [p[0] for p in _params(fast["sparse_adam_update"])] == [
        "table", "m", "v", "uniq", "inverse", "grad", "acc", "lr_t", "beta1", "beta2", "c1", "c2", "eps"] + options
    assert _params(fast["sparse_sgd_update"])[-len(options):] == [
        (name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default) for name, default in
        zip(options, [None, None, None, float("inf"), float("inf"), 0.0, 0.0, None, None, 0, 0])]   # (all off by default)
    for name in ("sparse_sgd_update", "sparse_adagrad_update", "sparse_rowwise_adagrad_update", "sparse_ftrl_update"):
        assert [p[0] for p in _params(fast[name])][-4:] == ["weights", "argmax", "seed", "counter"], name  # (each alike)
    assert [p[0] for p in _params(fast["sum_by_row"])] == ["uniq", "inverse", "grad", "acc", "offsets", "scale",
                                                           "weights", "argmax"]
    assert [p[0] for p in _params(fast["gather_pool"])] == ["table", "rows", "offsets", "scale", "out", "weights"]


def test_hash_cache_signature_and_help():
    """The public HashCache shows its signature and documentation on either backend."""
    # these first (a new setting goes after them: old positional calls keep their meaning)
    assert str(inspect.signature(recboost.HashCache)).startswith(
        "(capacity, access_threshold=-1, eviction_threshold=-1, grow=False, eviction_policy=None, lfu_half_life=3600, "
        "admission_counter='exact', sketch_width=None, sketch_depth=None, sketch_window=None")
    assert str(inspect.signature(recboost.HashCache.lookup)) == "(self, ids, timestamp=None, max_admit=-1, labels=None)"
    text = pydoc.render_doc(recboost.HashCache, renderer=pydoc.plaintext)
    assert "Map arbitrary int64 ids to rows of a device table" in text
    for method in _HASH_CACHE_METHODS:
        doc = inspect.getdoc(getattr(recboost.HashCache, method))
        assert doc and len(doc) > 30, method
        assert "%s(self" % method in text, method


def test_both_env_switches_is_an_error(tmp_path):
    out = _run_import(ROOT, {"RECBOOST_NO_EXTENSIONS": "1", "RECBOOST_REQUIRE_EXTENSIONS": "1"})
    assert out.returncode != 0
    assert "both set" in out.stderr


def test_vendored_single_file_works_on_fallback(tmp_path):
    shutil.copy(os.path.join(ROOT, "recboost.py"), tmp_path / "recboost.py")
    # The editable install makes _recboost_fast importable from anywhere; a vendoring user has only
    # recboost.py, so hide the compiled module (sys.modules[...] = None makes its import fail).
    hide = "import sys; sys.modules['_recboost_fast'] = None; "
    code = hide + ("import recboost; assert recboost.__file__.startswith(%r), recboost.__file__; "
                   "print(recboost.FAST_BACKEND, recboost.__version__)" % str(tmp_path))
    out = _run_import(str(tmp_path), {}, code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", recboost.__version__]
    # and asking for the extension there is a clear ImportError
    out = _run_import(str(tmp_path), {"RECBOOST_REQUIRE_EXTENSIONS": "1"}, hide + "import recboost")
    assert out.returncode != 0
    assert "RECBOOST_REQUIRE_EXTENSIONS=1 but the compiled extension _recboost_fast cannot be imported" \
        in out.stderr


def test_stale_extension_is_refused(tmp_path):
    (tmp_path / "stale_fast.py").write_text('__version__ = "0.0.0-stale"\n')
    shutil.copy(os.path.join(ROOT, "recboost.py"), tmp_path / "recboost.py")
    # a stale build stands in for the real one
    code = "import sys, stale_fast; sys.modules['_recboost_fast'] = stale_fast; " \
           "import recboost; print(recboost.FAST_BACKEND)"
    out = _run_import(str(tmp_path), {}, code)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
    out = _run_import(str(tmp_path), {"RECBOOST_REQUIRE_EXTENSIONS": "1"}, code)
    assert out.returncode != 0 and "0.0.0-stale" in out.stderr and "rebuild" in out.stderr


def test_extension_version_matches_module():
    with open(os.path.join(ROOT, "_fast.pyx")) as fh:
        assert '__version__ = "%s"' % recboost.__version__ in fh.read()
