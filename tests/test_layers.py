"""The package's imports: no circle, layers one way (see docs/architecture.md).

``make lint`` checks the layer contract with import-linter (pyproject's
``[tool.importlinter]``); this test checks what a layers contract cannot:
that no module of the package takes part in an import circle, counting
every import that runs (imports under ``TYPE_CHECKING`` only name types).
"""

from __future__ import annotations

import grimp

PACKAGE = "celery_redislock"


def _graph(external: bool = False) -> grimp.ImportGraph:
    return grimp.build_graph(
        PACKAGE,
        include_external_packages=external,
        exclude_type_checking_imports=True,
        cache_dir=None,
    )


def _circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    modules = sorted(graph.modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.find_modules_directly_imported_by(node)):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in modules:
        if module not in index:
            visit(module)
    return found


def test_no_module_of_the_package_is_in_an_import_circle() -> None:
    graph = _graph()
    # A package imports its own modules (re-exports): not a circle of code.
    for module in list(graph.modules):
        for child in graph.find_children(module):
            if graph.direct_import_exists(importer=module, imported=child):
                graph.remove_import(importer=module, imported=child)
    assert _circles(graph) == []


def test_the_engine_and_below_never_import_celery() -> None:
    graph = _graph(external=True)
    for layer in ("engine", "asyncio", "store", "protocol", "worker", "ops"):
        for module in graph.find_descendants(f"{PACKAGE}.{layer}"):
            imported = graph.find_modules_directly_imported_by(module)
            assert not any(m == "celery" or m.startswith("celery.") for m in imported), module
