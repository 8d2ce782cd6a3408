"""Structure figures of recboost.py (issues #24, #59): the longest classes and functions, the private
references that cross a class boundary, and the figures of the whole file: each section's size, the
classes over 300 lines, the forward references across sections, the ``getattr`` reach-ins on private
names and the lines over 110 characters.

    python tools/structure.py [recboost.py] [--top N] [--verbose]

A cross-class private reference is an attribute ``x._name`` (not a dunder) read or written where
``x`` is not ``self``/``cls``/the class itself, inside recboost.py; references from tests/ and bench/
to a private name of recboost (``rb._name`` or ``obj._name``) are counted separately.
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layout  # noqa: E402   (tools/layout.py: the section banners)

#: a class longer than this counts in ``classes_over_300_lines``
BIG_CLASS = 300
#: a line longer than this counts in ``lines_over_110_characters``
WIDE_LINE = 110


def _spans(tree):
    classes, functions = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            classes.append((node.end_lineno - node.lineno + 1, node.name, node.lineno))
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions.append((item.end_lineno - item.lineno + 1, "%s.%s" % (node.name, item.name), item.lineno))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.col_offset == 0:
            functions.append((node.end_lineno - node.lineno + 1, node.name, node.lineno))
    return sorted(classes, reverse=True), sorted(functions, reverse=True)


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _cross_class_refs(tree):
    """``(line, expression)`` of each ``x._name`` in recboost.py where x is not self/cls/the owning class."""
    out = []

    def visit(node, owner):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Attribute) and _private(child.attr):
                base = child.value
                if not (isinstance(base, ast.Name) and base.id in ("self", "cls", owner)):
                    out.append((child.lineno, ast.unparse(child)))
            visit(child, owner)
    visit(tree, None)
    return out


def _outside_refs(paths):
    """Private attributes of recboost objects referenced from test and bench files."""
    count = 0
    for path in paths:
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                count += 1
    return count


def _constructor_parameters(tree):
    """``(count, class name)`` of each class's ``__init__``: its parameters but ``self`` (``*args`` and
    ``**kwargs`` count one each)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    a = item.args
                    count = len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                    out.append((count, node.name))
    return sorted(out, reverse=True)


def _section_of(starts):
    def find(line):
        k = 0
        for i, first in enumerate(starts):
            if first <= line:
                k = i
        return k
    return find


def _forward_refs(tree, path):
    """``(section used in, name, section defining it)`` of each module-level name (class, function or
    assigned name) read in a section above the one that defines it, once per section and name."""
    secs = layout.sections(path)
    find = _section_of([first for _, first, _, _, _ in secs])
    defined = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        else:
            names = []
        for name in names:
            defined.setdefault(name, find(node.lineno))
    out = set()

    def visit(node, local):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            params = node.args
            local = local | {a.arg for a in params.posonlyargs + params.args + params.kwonlyargs}
            local |= {a.arg for a in (params.vararg, params.kwarg) if a is not None}
        if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in defined
                and node.id not in local):         # (a parameter of that name is not the module's)
            used = find(node.lineno)
            if used < defined[node.id]:
                out.add((secs[used][0], node.id, secs[defined[node.id]][0]))
        for child in ast.iter_child_nodes(node):
            visit(child, local)
    visit(tree, frozenset())
    return sorted(out)


def forward_references(path=os.path.join(ROOT, "recboost.py")):
    """``[(section used in, name, section defining it, line of the first use there)]`` of the forward
    references across sections of ``path`` (see ``_forward_refs``)."""
    with open(path) as fh:
        tree = ast.parse(fh.read())
    secs = layout.sections(path)
    find = _section_of([first for _, first, _, _, _ in secs])
    out = []
    for used, name, defined in _forward_refs(tree, path):
        first = min(n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name
                    and isinstance(n.ctx, ast.Load) and secs[find(n.lineno)][0] == used)
        out.append((used, name, defined, first))
    return out


def _getattr_reach_ins(tree):
    """``(line, expression)`` of each ``getattr``/``hasattr``/``setattr``/``delattr`` call whose name
    is a private string literal (``getattr(model, "_prefetcher", None)``): a private read past the
    structure's other figures."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)):
            out.append((node.lineno, ast.unparse(node)))
    return out


def section_sizes(path=os.path.join(ROOT, "recboost.py")):
    """``{section title: lines}`` of recboost.py's sections (tools/layout.py's banners)."""
    return {title: lines for title, _, lines, _, _ in layout.sections(path)}


def figures(path=os.path.join(ROOT, "recboost.py")):
    """The structure figures tests/test_structure.py holds to its ceilings: ``longest_class``,
    ``longest_function``, ``constructor_parameters`` (the most any ``__init__`` takes), each with the
    name that has it, ``hash_embedding_length`` (the lines of the class HashEmbedding, 0 without it),
    then ``cross_class_private_references`` in recboost.py,
    ``private_references_from_tests_and_bench`` (their top-level .py files), ``classes_over_300_lines``
    (with the longest's name), ``forward_references_across_sections`` (section and name pairs, see
    :func:`_forward_refs`), ``getattr_private_reach_ins`` and ``lines_over_110_characters``. Each
    section's size is :func:`section_sizes`."""
    text = open(path).read()
    tree = ast.parse(text)
    classes, functions = _spans(tree)
    params = _constructor_parameters(tree)
    files = [os.path.join(d, f) for d in (os.path.join(ROOT, "tests"), os.path.join(ROOT, "bench"))
             for f in sorted(os.listdir(d)) if f.endswith(".py")]
    return {"longest_class": (classes[0][0], classes[0][1]),
            "longest_function": (functions[0][0], functions[0][1]),
            "constructor_parameters": params[0],
            "hash_embedding_length": next(((n, name) for n, name, _ in classes if name == "HashEmbedding"),
                                          (0, "HashEmbedding")),
            "cross_class_private_references": (len(_cross_class_refs(tree)), ""),
            "private_references_from_tests_and_bench": (_outside_refs(files), ""),
            "classes_over_300_lines": (sum(n > BIG_CLASS for n, _, _ in classes), classes[0][1]),
            "forward_references_across_sections": (len(_forward_refs(tree, path)), ""),
            "getattr_private_reach_ins": (len(_getattr_reach_ins(tree)), ""),
            "lines_over_110_characters": (sum(len(line) > WIDE_LINE for line in text.splitlines()), "")}


def main(argv):
    top = int(argv[argv.index("--top") + 1]) if "--top" in argv else 5
    args = [a for a in argv if not a.startswith("--") and not a.isdigit()]
    path = args[0] if args else os.path.join(ROOT, "recboost.py")
    tree = ast.parse(open(path).read())
    classes, functions = _spans(tree)
    print("%s: %d lines" % (os.path.relpath(path), len(open(path).read().splitlines())))
    print("longest classes:", ", ".join("%s %d" % (name, n) for n, name, _ in classes[:top]))
    print("longest functions:", ", ".join("%s %d" % (name, n) for n, name, _ in functions[:top]))
    refs = _cross_class_refs(tree)
    print("constructor parameters:", ", ".join("%s %d" % (name, n) for n, name in _constructor_parameters(tree)[:top]))
    print("cross-class private references in recboost.py: %d" % len(refs))
    files = [os.path.join(d, f) for d in (os.path.join(ROOT, "tests"), os.path.join(ROOT, "bench"))
             for f in sorted(os.listdir(d)) if f.endswith(".py")]
    print("private references from tests/ and bench/: %d" % _outside_refs(files))
    print("classes over %d lines: %d" % (BIG_CLASS, sum(n > BIG_CLASS for n, _, _ in classes)))
    forward = _forward_refs(tree, path)
    print("forward references across sections: %d" % len(forward))
    if "--verbose" in argv:
        for used, name, defined in forward:
            print("    %s (defined in %s) used in %s" % (name, defined, used))
    reach = _getattr_reach_ins(tree)
    print("getattr reach-ins on private names: %d" % len(reach))
    if "--verbose" in argv:
        for line, expr in reach:
            print("    line %d: %s" % (line, expr))
    print("lines over %d characters: %d" % (WIDE_LINE, sum(len(line) > WIDE_LINE for line in
                                                         open(path).read().splitlines())))
    print("section sizes:", ", ".join("%s %d" % item for item in section_sizes(path).items()))


if __name__ == "__main__":
    main(sys.argv[1:])
