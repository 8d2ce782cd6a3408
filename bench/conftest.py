"""Bench session set-up: the recboost tree to import, and the ``untimed`` marker.

``RECBOOST_BENCH_TREE`` (default: this checkout) goes first on ``sys.path`` before any bench module
imports recboost, so the gate's baseline side imports the baseline's ``recboost.py`` and its own
``_recboost_fast`` build. Tests marked ``untimed`` (quality, memory and size rows only) are skipped
in A/B mode (``RECBOOST_BENCH_MODE=ab``): they have no timed row.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _harness  # noqa: E402

sys.path.insert(0, _harness.TREE)
collect_ignore = ["results"]      # the gate's results and its baseline's checkout live there


def pytest_configure(config):
    config.addinivalue_line("markers", "untimed: a bench with no timed row (skipped in A/B mode)")


def pytest_collection_modifyitems(config, items):
    if _harness.AB:
        skip = pytest.mark.skip(reason="A/B mode: no timed row (quality, memory or size only)")
        for item in items:
            if "untimed" in item.keywords:
                item.add_marker(skip)
