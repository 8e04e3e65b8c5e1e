"""The house's rules, checked on the source (ARCHITECTURE.md, "Invariants"): the folders of gradsync import one
another without loops, the library below never imports the launchers, benchmarks or conformance suites above it,
and no module assigns the attributes of another module's objects (modules talk through methods)."""

from __future__ import annotations

import ast
import collections
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "gradsync"

# (module, attribute): the assignments to another module's objects that are the point of the code, each with why.
FOREIGN_ASSIGNMENTS_ALLOWED = {
    # torch's PowerSGDState has no method to change its group; torch's hooks read None as the default group.
    ("gradsync/comm/regroup.py", "process_group"): "torch's PowerSGDState, at an elastic regroup",
    # torch.autograd.Function's ctx is torch's object for exactly this: state saved for the backward.
    ("gradsync/nn/sync_batchnorm.py", "comm"): "an autograd Function's ctx",
    # threading.local: each thread's own attributes (the name 'index' is also a bucket's field).
    ("gradsync/store/etcd_client.py", "index"): "a threading.local",
    # ssl.SSLContext's settings are its attributes (the name is also EtcdAccess's field).
    ("gradsync/store/etcd_refusal.py", "check_hostname"): "an ssl.SSLContext",
}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _node_of(module: str) -> str:
    """A folder of gradsync (``gradsync.reducer.backward`` -> ``reducer``), or a top-level module (``settings``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "gradsync"


def _imports(path: Path) -> Iterator[str]:
    """Every gradsync module ``path`` imports, at module level or inside a function."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("gradsync."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gradsync":
            if node.module == "gradsync":  # from gradsync import settings, elastic, ...
                yield from (f"gradsync.{a.name}" for a in node.names)
            else:
                yield node.module


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for path in _modules():
        me = _module_name(path)
        if me in ("gradsync.__init__", "gradsync.__main__", "gradsync.cli"):
            continue  # the package's front door and the command re-export everything: they sit on top
        for target in _imports(path):
            if _node_of(target) != _node_of(me):
                graph[_node_of(me)].add(_node_of(target))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A loop in ``graph``, as the list of nodes around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_folders_of_gradsync_import_each_other_without_loops() -> None:
    graph = _folder_graph()
    assert graph["ddp"] and graph["reducer"], "the scan found no imports: it is not reading the package"
    loop = _cycle(graph)
    assert loop is None, f"an import loop between gradsync's folders: {' -> '.join(loop or [])}"


def _elastic_imports(path: Path) -> Iterator[str]:
    """The modules of gradsync/elastic that ``path`` imports (``from gradsync.elastic import keys`` names one)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "gradsync.elastic":
            yield from (f"gradsync.elastic.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradsync.elastic."):
            yield str(node.module)


def test_the_elastic_modules_import_each_other_without_loops() -> None:
    """Issue 59: a newcomer reads elastic/ from the bottom up. Every import counts, ``TYPE_CHECKING`` and
    function-level ones too (liveness.py and verdicts.py imported each other, one side for its types)."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for path in sorted((PACKAGE / "elastic").glob("*.py")):
        me = _module_name(path)
        if me.endswith("__init__"):
            continue  # the package's front door re-exports its modules
        graph[me] |= {t for t in _elastic_imports(path) if t != me}
    assert "gradsync.elastic.keys" in graph["gradsync.elastic.rounds"], "the scan is not reading elastic/"
    loop = _cycle(graph)
    assert loop is None, f"an import loop inside gradsync/elastic: {' -> '.join(loop or [])}"


def test_the_cycle_finder_finds_a_loop() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def test_the_library_never_imports_the_launchers_or_the_labs() -> None:
    above = ("gradsync.launch", "bench", "lab", "conformance")
    offenders = []
    for path in _modules():
        me = _module_name(path)
        if me.startswith("gradsync.launch") or me == "gradsync.cli":
            continue
        for target in _imports(path):
            if target.startswith(above):
                offenders.append(f"{me} imports {target}")
        text = path.read_text()
        for lab in ("bench", "lab", "conformance"):
            if f"\nimport {lab}" in text or f"\nfrom {lab} " in text or f"\nfrom {lab}." in text:
                offenders.append(f"{me} imports {lab}")
    assert not offenders, offenders


def _stores(tree: ast.AST) -> Iterator[ast.Attribute]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            yield from (t for t in ast.walk(target) if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store))


def _class_fields(tree: ast.AST) -> Iterator[str]:
    """Names a class body declares (dataclass fields, class attributes)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    yield item.target.id
                elif isinstance(item, ast.Assign):
                    yield from (t.id for t in item.targets if isinstance(t, ast.Name))


def _foreign_assignments() -> list[str]:
    """``obj.attr = ...`` where ``attr`` belongs to a gradsync class of another module (defined there as
    ``self.attr`` or in its class body) and to none of this module's: one module setting another's state."""
    owners: dict[str, set[str]] = collections.defaultdict(set)
    foreign: list[tuple[str, ast.Attribute]] = []
    for path in _modules():
        rel, tree = str(path.relative_to(ROOT)), ast.parse(path.read_text())
        for name in _class_fields(tree):
            owners[name].add(rel)
        for store in _stores(tree):
            if isinstance(store.value, ast.Name) and store.value.id in ("self", "cls"):
                owners[store.attr].add(rel)
            else:
                foreign.append((rel, store))
    return [
        f"{rel}:{store.lineno}: {ast.unparse(store)} = ... (an attribute of {sorted(owners[store.attr])})"
        for rel, store in foreign
        if owners[store.attr] and rel not in owners[store.attr] and (rel, store.attr) not in FOREIGN_ASSIGNMENTS_ALLOWED
    ]


def test_no_module_assigns_the_attributes_of_another_modules_objects() -> None:
    found = _foreign_assignments()
    assert not found, "modules talk through methods (ARCHITECTURE.md, invariant 8):\n" + "\n".join(found)


def test_the_assignment_lint_sees_one_module_setting_anothers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The lint's own check, on a package of two modules: the reducer setting a step's field from outside (as it did
    # before BackwardStep owned its phase) is reported; the step setting its own is not.
    package = tmp_path / "gradsync"
    package.mkdir()
    (package / "step.py").write_text("class Step:\n    def begin(self):\n        self.started = True\n")
    (package / "reducer.py").write_text("def on_ready(step):\n    step.started = True\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "PACKAGE", package)
    found = _foreign_assignments()
    assert len(found) == 1 and found[0].startswith("gradsync/reducer.py:2: step.started"), found


def test_architecture_names_every_file_of_the_package() -> None:
    """ARCHITECTURE.md says every file under gradsync/ is named in it: a reader who follows it finds each one."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    missing = [
        str(path.relative_to(ROOT))
        for path in _modules()
        if path.name != "__init__.py" and path.name not in text and str(path.relative_to(ROOT)) not in text
    ]
    assert not missing, f"ARCHITECTURE.md does not name: {missing}"
