"""The import structure: no module of jgrpo/ or models/ imports itself back through others, and
the memory plan builds on the setup stage without the training loop."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Where each package's files are (models/ installs as jgrpo.models).
PACKAGES = {"jgrpo": ROOT / "jgrpo", "jgrpo.models": ROOT / "models"}


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> its file, for every module of the two packages."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at any depth (inside functions too), except the
    bodies of `if TYPE_CHECKING:` (annotations only)."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (an imported name that is a module counts as
    that module, else as the module it comes from)."""
    modules = module_files()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
                continue
            source = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, source] if source else base)
            for alias in node.names:
                full = f"{source}.{alias.name}"
                targets.add(full if full in modules else known(source))
        graph[name] = {target for target in targets if target and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            connect(node)
    return found


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\n"
        "def f():\n    import y\n"
    )
    assert [node.names[0].name for node in runtime_imports(tree)[1:]] == ["y"]


def test_no_import_cycles_in_jgrpo_and_models():
    graph = import_graph()
    assert {"jgrpo.train", "jgrpo.setup", "jgrpo.plan", "jgrpo.models.transformer"} <= set(graph)
    assert "jgrpo.setup" in graph["jgrpo.plan"]  # the graph sees the package's own imports
    assert cycles(graph) == []


def test_the_memory_plan_does_not_import_the_training_loop():
    """`python -m jgrpo.plan` compiles a config's programs from the setup stage alone."""
    code = (
        "import sys\nfrom jgrpo import plan\nassert plan.main(['smoke']) == 0\n"
        "print('loop imported:', 'jgrpo.train' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "peak" in out.stdout  # the plan's report
    assert out.stdout.strip().endswith("loop imported: False")
