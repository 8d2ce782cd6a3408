"""The layout table of recboost.py in docs/development.md, made from the file's section banners.

    python tools/layout.py [recboost.py]     # print the table
    python tools/layout.py --write           # put it into docs/development.md, between its markers

A section starts at a banner: a ``# ====`` line, the section's title on the next line (``# Hash
embedding``), and a closing ``# ====`` line. The comment lines right after the banner open the section;
their first sentence (up to a full stop, a ``#`` line left empty or an indented sketch) says what the
section holds. The table gives per section its title, that sentence, and the classes it defines and the
public functions (those in ``__all__``) defined at its top level (no line numbers, which every edit would
shift: ``sections`` has them, and tools/structure.py the sizes). The lines before the first banner are the row "(top)": the
module docstring and the names assigned there.
tests/test_structure.py checks that docs/development.md holds exactly this table, so after a change to
recboost.py's sections run the ``--write`` command above.

Each section's opening comment also holds its owner table (``owners``): a line with ``Who owns what:``,
then one row a name or a few related names, in the column after ``#   ``, what they own beside them
(rows wrap with that column left empty). A sub-section (a ``# ---- title ----`` line) whose comment has
a table of its own owns the definitions up to the next sub-section with one (a sub-section without a
table is the part's above it); its section's table lists it as a row ``---- title``. tests/test_structure.py checks that each table names every class and function
defined at the top level of its part, and only names defined there.
"""
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import report  # noqa: E402   (bench/report.py: the one writer of a table between two markers)

RECBOOST = os.path.join(ROOT, "recboost.py")
DEVELOPMENT = os.path.join(ROOT, "docs", "development.md")
START, END = "<!-- layout-table:start -->", "<!-- layout-table:end -->"
WRITE = "python tools/layout.py --write"


def _is_rule(line):
    return re.fullmatch(r"# ={10,}\s*", line) is not None


def _summary(comment):
    """The first sentence of a section's opening comment lines (``#`` stripped), in markdown."""
    words = []
    for line in comment:
        text = line[1:]
        if not text.strip() or (words and text.startswith("   ")):       # an empty line or a sketch ends it
            break
        words.append(text.strip())
    text = " ".join(words)
    end = re.search(r"\.(\s|$)", text)
    text = (text[:end.start()] if end else text).rstrip(":;, ")
    return text.replace("``", "`").replace("|", "\\|")


def sections(path=RECBOOST):
    """recboost.py's sections in file order: ``(title, first_line, lines, summary, names)`` each, where
    ``names`` are the classes and the public functions defined at the section's top level (for "(top)",
    the names assigned there)."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    starts = [i for i in range(len(lines) - 2)
              if _is_rule(lines[i]) and lines[i + 1].startswith("# ") and _is_rule(lines[i + 2])]
    tree = ast.parse("\n".join(lines))
    public = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            public = set(ast.literal_eval(node.value))
    defined = [(node.lineno, node.name) for node in tree.body
               if isinstance(node, ast.ClassDef) or (
                   isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in public)]
    assigned = [(node.lineno, target.id) for node in tree.body if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)]
    out = []
    bounds = [0] + starts + [len(lines)]
    for k in range(len(bounds) - 1):
        first, stop = bounds[k], bounds[k + 1]
        if k == 0:                       # before the first banner: the docstring and the module's names
            if stop == first:
                continue
            title = "(top)"
            summary = "The module docstring" if ast.get_docstring(tree) is not None else ""
            names = [name for lineno, name in assigned if lineno <= stop]
        else:
            title = lines[first + 1][2:].strip()
            comment = []
            for line in lines[first + 3:stop]:
                if not line.startswith("#"):
                    break
                comment.append(line)
            summary = _summary(comment)
            names = [name for lineno, name in defined if first < lineno <= stop]
        out.append((title, first + 1, stop - first, summary, names))
    return out


OWNERS = "Who owns what:"


def _owner_rows(comment):
    """The names column of the owner table in ``comment`` (lines), one entry a row; None without one."""
    start = next((k for k, line in enumerate(comment) if OWNERS in line), None)
    if start is None:
        return None
    rows = []
    for line in comment[start + 1:]:
        if not line.startswith("#   "):
            break
        if len(line) > 4 and line[4] != " ":           # a row's names (else its description wraps on)
            rows.append(re.split(r"\s{2,}", line[4:].strip())[0])
    return rows


def _comment_after(lines, index):
    """The comment lines from ``lines[index]`` up to the first line that is not a comment."""
    out = []
    for line in lines[index:]:
        if not line.startswith("#"):
            break
        out.append(line)
    return out


def owners(path=RECBOOST):
    """The owner tables of recboost.py's sections (not "(top)") and of the sub-sections with a table of
    their own, in file order: ``(title, names, subsections, defined, assigned)`` each, where ``title``
    is the section's (``"Section / sub-section"`` for a sub-section's), ``names`` the identifiers its
    table names (None without a table), ``subsections`` the ``---- title`` rows of a section's table,
    ``defined`` the classes and functions defined at the top level of the part it owns and ``assigned``
    the names assigned there."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    tree = ast.parse("\n".join(lines))
    out = []
    for title, first, count, _summary_text, _names in sections(path):
        if title == "(top)":
            continue
        stop = first - 1 + count                              # 0-based end of the section
        parts = [(title, first - 1, _owner_rows(_comment_after(lines, first + 2)))]
        for j in range(first + 2, stop):
            sub = re.fullmatch(r"# ---- (.*?) -*\s*", lines[j])
            if sub:
                rows = _owner_rows(_comment_after(lines, j + 1))
                # a sub-section without a table of its own is the part's above it
                owner = "%s / %s" % (title, sub.group(1)) if rows is not None else parts[-1][0]
                parts.append((owner, j, rows))
        units = {}
        for k, (name, begin, rows) in enumerate(parts):
            end = parts[k + 1][1] if k + 1 < len(parts) else stop
            unit = units.setdefault(name, [rows, [], []])
            for node in tree.body:
                if begin < node.lineno <= end:
                    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        unit[1].append(node.name)
                    elif isinstance(node, ast.Assign):
                        unit[2].extend(t.id for t in node.targets if isinstance(t, ast.Name))
        for unit, (rows, defined, assigned) in units.items():
            names = None if rows is None else [n for row in rows if not row.startswith("---- ")
                                               for n in re.findall(r"[A-Za-z_]\w*", row)]
            subsections = [] if rows is None else [row[5:] for row in rows if row.startswith("---- ")]
            out.append((unit, names, subsections, defined, assigned))
    return out


def table(path=RECBOOST):
    """The markdown table of ``sections(path)``."""
    rows = ["| section | what it holds |", "|---|---|"]
    for title, _first, _count, summary, names in sections(path):
        held = summary or "(no opening comment)"
        if names:
            held += (". Assigns " if title == "(top)" else ". Defines ") + ", ".join("`%s`" % n for n in names)
        rows.append("| %s | %s |" % (title, held))
    return "\n".join(rows)


def documented(path=DEVELOPMENT):
    """The text between the layout-table markers of ``path`` (None without both markers)."""
    with open(path, encoding="utf-8") as fh:
        found = re.search(re.escape(START) + r"\n(.*?)\n?" + re.escape(END), fh.read(), re.S)
    return found.group(1) if found else None


def write(doc=DEVELOPMENT, path=RECBOOST):
    """Replace the text between the layout-table markers of ``doc`` with ``table(path)``."""
    report.write_table(table(path), doc, (START, END))


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    path = args[0] if args else RECBOOST
    if "--write" in argv:
        write(path=path)
        print("layout: wrote the table of %s into %s" % (os.path.relpath(path), os.path.relpath(DEVELOPMENT)))
    else:
        print(table(path))


if __name__ == "__main__":
    main(sys.argv[1:])
