"""The structure ratchet of issue #36: recboost.py's longest class and function, the most parameters
any constructor takes, private references that cross a class boundary in recboost.py, and reach-ins
from tests/ and bench/ into recboost's private names (``tools/structure.py`` measures them). None
may rise above its ceiling below; when a change lowers one, lower its ceiling in the same commit, so
the structure only improves. Beside it, docs/development.md's layout table must be the one
``tools/layout.py`` makes from recboost.py's section banners (``python tools/layout.py --write``)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import layout  # noqa: E402   (tools/layout.py: the layout table of docs/development.md)
import structure  # noqa: E402

# Ceilings: the figures of 2026-11-26, after issues #35 and #37 landed.
CEILINGS = {
    "longest_class": 928,                               # RecModel
    "longest_function": 110,                            # _CheckpointStore.read (123 before _replay_batch;
                                                        # train_job: 161 before _JobSettings)
    "constructor_parameters": 14,                       # SyntheticClickStream.__init__ (HashEmbedding: 22 before TableConfig)
    "hash_embedding_length": 294,                       # HashEmbedding (684 before its _RowStore; #36: <= 300)
    "cross_class_private_references": 11,
    "private_references_from_tests_and_bench": 233,
}


@pytest.mark.parametrize("figure", sorted(CEILINGS))
def test_the_structure_does_not_regress(figure):
    value, name = structure.figures()[figure]
    assert value <= CEILINGS[figure], (
        "%s rose to %d (%s), above its ceiling %d: split the code or use public names instead"
        % (figure, value, name, CEILINGS[figure]))


def test_the_figures_measure_what_they_name(tmp_path):
    """The ratchet can fail: on a file of known shape the figures are those of its longest class and
    function, its widest constructor and its private reach-ins across classes."""
    source = tmp_path / "shape.py"
    body = "\n".join("        x = %d" % i for i in range(40))
    source.write_text(
        "class Small:\n    def __init__(self, a, b=1, *args, c, **kwargs):\n        self._a = a\n\n\n"
        "class Big:\n    def __init__(self, a):\n        self._a = a\n        other = Small(1, c=2)\n"
        "        other._a = 3\n\n    def long(self):\n%s\n\n\n"
        "def free(thing):\n    return thing._secret\n" % body)
    got = structure.figures(str(source))
    assert got["longest_class"] == (47, "Big")                  # lines 6 to 52: 5 lines, a blank, long()
    assert got["longest_function"] == (41, "Big.long")
    assert got["constructor_parameters"] == (5, "Small")         # a, b, *args, c, **kwargs
    assert got["cross_class_private_references"][0] == 2         # other._a (in Big) and thing._secret


def test_the_layout_table_of_development_md_matches_the_section_banners():
    """docs/development.md's table of recboost.py's sections is the one tools/layout.py makes from the
    file's banners and opening comments, line numbers included."""
    assert layout.documented() is not None, "docs/development.md lacks its %s / %s markers" % (
        layout.START, layout.END)
    assert layout.documented() == layout.table(), (
        "docs/development.md's layout table no longer matches recboost.py's sections: run `%s`" % layout.WRITE)


def test_the_layout_table_reads_banners_comments_and_definitions(tmp_path):
    """On a file of known shape: one row per banner plus "(top)", each with its banner's line, its
    length up to the next banner, its opening comment's first sentence (a sketch or an empty comment
    line ends it) and the classes and public functions it defines; --write puts the table between the
    markers."""
    rule = "# " + "=" * 20
    source = tmp_path / "mod.py"
    source.write_text("\n".join([
        '"""Doc."""', '__all__ = ["f"]',                                        # lines 1-2: (top)
        rule, "# First part", rule,                                            # lines 3-5
        "# Holds ``f`` and a|b: all of", "#   a sketch. Not this.",
        "def f():", "    pass", "class _C:", "    pass", "def _g():", "    pass",
        rule, "# Second", rule, "x = 1", "# late comment. Not a summary."]) + "\n")   # lines 14-18
    assert layout.sections(str(source)) == [
        ("(top)", 1, 2, "The module docstring", ["__all__"]),
        ("First part", 3, 11, "Holds `f` and a\\|b: all of", ["f", "_C"]),
        ("Second", 14, 5, "", [])]
    assert layout.table(str(source)).splitlines()[2:] == [
        "| (top) | The module docstring. Assigns `__all__` |",
        "| First part | Holds `f` and a\\|b: all of. Defines `f`, `_C` |",
        "| Second | (no opening comment) |"]
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n%s\nstale\n%s\nafter\n" % (layout.START, layout.END))
    layout.write(str(doc), str(source))
    assert layout.documented(str(doc)) == layout.table(str(source))
    assert doc.read_text().startswith("intro\n") and doc.read_text().endswith("\nafter\n")
