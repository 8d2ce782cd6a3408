"""Build recboost: one flat module (recboost.py) plus an optional Cython extension (_fast.pyx).

The extension is built as ``_recboost_fast`` so it cannot clash with another package's ``_fast``.
It is optional: if it fails to build, recboost installs and runs on its numpy fallback, unless
``RECBOOST_REQUIRE_EXTENSIONS=1`` is set, in which case a failed build fails the install.
"""
import os
import re

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
REQUIRE = os.environ.get("RECBOOST_REQUIRE_EXTENSIONS") == "1"


def _version():
    with open(os.path.join(HERE, "recboost.py"), encoding="utf-8") as fh:
        return re.search(r'^__version__ = "([^"]+)"', fh.read(), re.M).group(1)


def _extensions():
    try:
        from Cython.Build import cythonize
    except ImportError:
        if REQUIRE:
            raise
        return []
    exts = cythonize(
        [Extension("_recboost_fast", ["_fast.pyx"], extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"])],
        # binding and embedsignature (in CPython's text-signature form): inspect.signature() and help()
        # work on every compiled function and class
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False,
                             "cdivision": True, "initializedcheck": False, "binding": True,
                             "embedsignature": True, "embedsignature.format": "clinic"},
    )
    for ext in exts:          # cythonize() drops optional=True; set it again
        ext.optional = not REQUIRE
    return exts


setup(
    name="recboost",
    version=_version(),
    description="Training acceleration for recommendation (CTR) models on MindSpore, CPU first.",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    py_modules=["recboost"],
    ext_modules=_extensions(),
    python_requires=">=3.9",
    install_requires=["mindspore==2.10.0", "numpy<2"],
    # "bench": plotting for bench/report.py only, never needed at run time; "serve": python -m recboost serve's
    # HTTP server (Starlette on uvicorn) and its metrics; "test": the serve tests also query it with tritonclient
    # "test": pytest-xdist runs make test-all's suite on two processes; hypothesis generates tests/test_properties.py's inputs
    extras_require={"test": ["pytest", "pytest-benchmark", "pytest-xdist", "starlette", "uvicorn",
                             "prometheus_client", "tritonclient[http]", "hypothesis"],
                    "bench": ["matplotlib"],
                    "serve": ["starlette", "uvicorn", "prometheus_client"]},
)
