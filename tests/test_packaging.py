"""The package's shape: no import cycles, the attention subpackage under its own name, the declared version
range, and ``import varlen`` without Triton."""

import ast
import importlib.metadata
import pathlib
import subprocess
import sys

import pytest
import tomllib
from packaging.requirements import Requirement

import varlen

SRC = pathlib.Path(varlen.__file__).parent
ROOT = SRC.parent.parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path):
    """(varlen module imported, whether at module level) for each import in ``path``."""
    tree = ast.parse(path.read_text())
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
            names = [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name and name.startswith("varlen"):
                yield name, id(node) in top_level


def _graph():
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph, deferred = {m: set() for m in modules}, []
    for module, path in modules.items():
        for name, top in _imports(path):
            while name not in modules:
                name = name.rpartition(".")[0]
            if name == module:
                continue
            if top:
                graph[module].add(name)
            else:
                deferred.append((module, name))
    return graph, deferred


def test_no_import_cycles_and_no_deferred_imports():
    """Module-level imports form no cycle, and no varlen module is imported inside a function (the usual
    way of hiding a cycle)."""
    graph, deferred = _graph()
    assert deferred == []
    done, active, cycles = set(), [], []

    def visit(m):
        active.append(m)
        for n in graph[m]:
            if n in active:
                cycles.append(active[active.index(n):] + [n])
            elif n not in done:
                visit(n)
        active.pop()
        done.add(m)

    for m in graph:
        if m not in done:
            visit(m)
    # A package's __init__ importing its own submodules is not a cycle of the submodules.
    cycles = [c for c in cycles if not any(b.startswith(a + ".") for a, b in zip(c, c[1:], strict=False))]
    assert cycles == []


def test_attention_function_and_subpackage_both_reachable():
    assert callable(varlen.attention)
    assert varlen.attn.dropout.attention_dropout_mask is varlen.attention_dropout_mask
    assert varlen.attn.api.attention is varlen.attention


def test_installed_versions_are_in_the_declared_range():
    """The torch and Triton this suite runs with lie in pyproject.toml's range (CI pins one end in
    .ci/constraints.txt; the GPU machines run the other)."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in map(Requirement, declared):
        if requirement.name in ("torch", "triton") and (requirement.marker is None or requirement.marker.evaluate()):
            version = importlib.metadata.version(requirement.name).split("+")[0]
            assert requirement.specifier.contains(version), (requirement, version)
    pinned = dict(line.split("==") for line in (ROOT / ".ci/constraints.txt").read_text().split()
                  if "==" in line and not line.startswith("#"))
    for name in ("torch", "triton"):
        requirement = next(Requirement(r) for r in declared if Requirement(r).name == name)
        assert requirement.specifier.contains(pinned[name]), (name, pinned[name])


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch, varlen
q = varlen.jagged([torch.randn(n, 2, 8) for n in (3, 0, 5)])
q.values.requires_grad_(True)
out = varlen.attention(q, q, q, causal=True)
varlen.sum(varlen.softmax(out, 1), 1).sum().backward()
assert q.values.grad is not None
for call in (lambda: varlen.attention(q, q, q, backend="triton"), lambda: varlen.softmax(q, 1, backend="triton")):
    try:
        call()
    except ValueError as exc:
        assert "triton is not installed" in str(exc), exc
    else:
        raise AssertionError("the Triton path ran without Triton")
print("ok")
"""


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_import_without_triton(interpret):
    """The PyTorch paths work without Triton; asking for the Triton kernels says it isn't installed."""
    env = {"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": interpret, "PYTHONPATH": str(SRC.parent)}
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
