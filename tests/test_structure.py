"""The package's shape, held: what the redesign of issue 27 promised a reader, as checks that
fail when a change breaks it (docs/design.md; the walk of docs/walk.md is tests/test_walk.py's).

- One owner for the window's state: only fused_accum/ledger.py writes a slot's window fields.
- Modes own their layout: the one-process modules hold no sharded or DTensor branch.
- No class over 350 lines; no import circle among the package's modules.
"""

from __future__ import annotations

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fused_accum"
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_only_the_ledger_writes_a_slots_window_fields():
    writes = re.compile(r"\.(_?has_grad|_?folded_in|_?stepped)\s*=[^=]|assign_all\(")
    writers = {p.name for p in SOURCES if writes.search(p.read_text())}
    assert writers == {"ledger.py"}, writers


def test_the_one_process_modules_hold_no_sharded_dtensor_offload_or_remainder_branch():
    # (nor a word of them: a mode is its own module's, issues 27 and 35)
    mode_words = re.compile(r"sharding|Sharding|is_dtensor|staging|shards_grads|_sharded|offload|remainder", re.I)
    for name in ("flat.py", "step.py", "checkpoint.py"):
        found = mode_words.findall((PACKAGE / name).read_text())
        assert found == [], (name, found)


def test_the_core_holds_no_placement_branch():
    # Where the step runs is its placement's (fused_accum.placement): the core calls it at fixed
    # points, never through an `if offload` branch (issue 35).
    branch = re.compile(r"offload( is not None|\.)")
    for name in ("window.py", "fold.py", "checkpoint.py", "members.py", "ledger.py", "optimizer.py"):
        found = branch.findall((PACKAGE / name).read_text())
        assert found == [], (name, found)


def test_the_window_steps_in_one_sequence():
    # "Step the window" is written once per placement: the device's (placement.py) and the
    # host's (offload.py), each a step_window; the rest call it. Only the device placement and
    # the folder (step_in_backward's per-bucket step) call the stepper's fused step (issue 35).
    callers = {p.name for p in SOURCES if re.search(r"\.fused_step\(", p.read_text())}
    assert callers == {"placement.py", "fold.py"}, callers
    sequences = {p.name for p in SOURCES if re.search(r"def step_window\(", p.read_text())}
    assert sequences == {"placement.py", "offload.py"}, sequences


def test_only_the_masters_module_asks_what_the_master_is():
    # What the master is (an fp32 copy, none, a remainder) is one object per format, chosen once
    # (fused_accum.masters): nothing else branches on it (issue 35).
    formats = re.compile(r"has_master|has_remainder|master_weights\s*==|master_weights is True")
    askers = {p.name for p in SOURCES if formats.search(p.read_text())}
    assert askers <= {"masters.py", "optimizer.py"}, askers  # (the optimizer checks the argument)


def test_no_module_is_over_600_lines():
    long = [(p.name, n) for p in SOURCES if (n := len(p.read_text().splitlines())) > 600]
    assert long == []


def test_no_class_is_over_350_lines():
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 350:
                long.append((path.name, node.name, node.end_lineno - node.lineno + 1))
    assert long == []


def _imports(path: pathlib.Path) -> set:
    """The package's modules ``path`` imports, at any depth of its code (lazy imports too)."""
    here = _module(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            names = [f"{target}.{a.name}" for a in node.names] + [target]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("fused_accum"))
    return found


def test_no_import_circle():
    modules = {_module(p): p for p in SOURCES}
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    # a package's __init__ imported by its own modules is how Python loads them: not an arrow
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}
    circles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                circles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []


# --- the algorithm as the unit (issue 45) -------------------------------------------------------

# Where an algorithm may be named: its record and drop-in class, its update rule in each backend
# (the reference's spec, the Triton update: the C++ one is csrc/math.h's), the package's exports,
# and the demo and the command line's help (users of the public API). Everything else, every
# layer from the optimizer's face down to the backends' launchers, asks fused_accum.registry and
# names none.
NAMES_ALGORITHMS = {
    "algorithms.py",
    "muon.py",
    "backends/reference.py",
    "backends/triton/updates.py",
    "__init__.py",
    "demo.py",
    "__main__.py",
}
# The one deliberate exception: FusedAccumOptimizer's default optimizer=, the public signature.
NAMED_ON_PURPOSE = {("optimizer.py", "adamw")}


def _docstrings(tree: ast.AST) -> set:
    """The string constants that are docstrings (prose, as comments are)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.add(id(first.value))
    return found


def _words(tree: ast.AST):
    """Each identifier (split at its camel-case humps: AdamHyper -> adam_hyper) and each string
    constant that is not a docstring, lower case."""
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value.lower()
        for name in names:
            yield re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _algorithm_names_in(source: str, names) -> set:
    pattern = re.compile(
        rf"(?<![a-z0-9])({'|'.join(map(re.escape, sorted(names, key=len, reverse=True)))})(?![a-z0-9])"
    )
    return {m for word in _words(ast.parse(source)) for m in pattern.findall(word)}


def test_an_algorithms_name_appears_in_no_layer_module():
    from fused_accum.registry import ALGORITHMS  # (every registered one: a new one too)

    found = {}
    for path in SOURCES:
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in NAMES_ALGORITHMS:
            hits = {h for h in _algorithm_names_in(path.read_text(), ALGORITHMS) if (rel, h) not in NAMED_ON_PURPOSE}
            if hits:
                found[rel] = sorted(hits)
    assert found == {}


def test_the_algorithm_name_check_sees_identifiers_and_strings_not_prose():
    """The test above can fail: an identifier, a camel-cased class, an attribute, a keyword and a
    string each count; a docstring or a comment does not, nor a word that only contains a name."""
    names = ["adamw", "adam", "sgd", "lion"]
    cases = {
        "x = opt.adam_step": ["adam"],
        "class LionHyper: pass": ["lion"],
        "f(momentum_of_sgd=1)": ["sgd"],
        "raise ValueError('needs (adamw, lion)')": ["adamw", "lion"],
        "def f():\n    'Adam and Lion are prose here'\n    return 1  # sgd too": [],
        "million = lionel = adamant = 1": [],
    }
    for source, want in cases.items():
        assert _algorithm_names_in(source, names) == set(want), source
