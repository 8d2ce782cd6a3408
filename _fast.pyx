# cython: language_level=3
"""Compiled host kernels for recboost (built as ``_recboost_fast``).

Kernels only: typed arrays in, arrays out. Validation, logging and MindSpore stay in recboost.py,
which also holds a pure-numpy twin of every kernel here (named ``_py_<name>``); both must give
bit-identical results.
"""

# Must equal recboost.__version__; recboost refuses a stale build.
__version__ = "0.1.0"
