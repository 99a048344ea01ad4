"""The seams the layout promises, checked in the source and in the built wheel.

- The worker's flows (connector/glue: handshakes, receive, push, leases, peers) and the
  worker that assembles them (worker.py) use one another only through what
  `connector.glue.flow.Flow` declares: no flow imports a sibling flow module, and every
  `self.<name>` a flow or the worker uses is its own, declared in `Flow`, or vLLM's.
- The harness and the benchmarks use nothing of the worker's flows but what `Flow`
  declares and the worker's own declared seams (`without_engine`, `observed_*`).
- `Flow` declares nothing vLLM's worker defines (a declaration would shadow vLLM's).
- The wheel a user installs holds the `connector` package only: no tests, harness,
  demo, benchmarks or dashboards, and nothing of them inside `connector/`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from connector.glue import flow
from connector.glue.guard import _assigned_attributes

REPO = Path(__file__).resolve().parents[1]
GLUE = REPO / "connector" / "glue"
FLOWS = ("handshakes", "receive", "push", "leases", "peers")


def _tree(module: str) -> ast.Module:
    return ast.parse((GLUE / f"{module}.py").read_text())


def _defined_in(tree: ast.Module) -> set[str]:
    """Methods, annotated names and `self.<name> = ...` targets of a module's classes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
        for target in targets:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id == "self"):
                names.add(target.attr)
    return names


def _self_names(tree: ast.Module) -> set[str]:
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self"}


def _vllm_names() -> set[str]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

    return set(dir(NixlPushConnectorWorker)) | _assigned_attributes(NixlPushConnectorWorker)


def _declared() -> set[str]:
    return _defined_in(ast.parse(Path(flow.__file__).read_text()))


@pytest.mark.parametrize("module", FLOWS)
def test_a_flow_imports_no_sibling_flow(module: str) -> None:
    siblings = {f"connector.glue.{m}" for m in FLOWS if m != module}
    imported = {node.module for node in ast.walk(_tree(module))
                if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(_tree(module)) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert not imported & siblings


@pytest.mark.parametrize("module", FLOWS)
def test_a_flow_uses_only_its_own_names_the_declared_ones_and_vllms(module: str) -> None:
    tree = _tree(module)
    allowed = _defined_in(tree) | _declared() | _vllm_names()
    siblings = set().union(*(_defined_in(_tree(m)) for m in FLOWS if m != module))
    undeclared = sorted((_self_names(tree) - allowed) | ((_self_names(tree) & siblings) - allowed))
    assert undeclared == [], f"{module}.py uses names of another flow that Flow does not declare"


def test_the_worker_uses_only_its_own_names_the_declared_ones_and_vllms() -> None:
    tree = _tree("worker")
    allowed = _defined_in(tree) | _declared() | _vllm_names()
    flows = set().union(*(_defined_in(_tree(m)) for m in FLOWS))
    undeclared = sorted((_self_names(tree) & flows) - allowed)
    assert undeclared == [], "worker.py uses names of a flow that Flow does not declare"


def _attribute_names(root: Path) -> set[str]:
    names = set()
    for path in root.rglob("*.py"):
        names |= {node.attr for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Attribute)}
    return names


@pytest.mark.parametrize("tool", ["harness", "benchmarks"])
def test_the_tools_use_only_the_declared_seams_of_the_flows(tool: str) -> None:
    """A private name of a flow (its own helper, or its state) used from the harness or a
    benchmark is a seam nobody declared: it breaks silently when the flow changes."""
    flows = set().union(*(_defined_in(_tree(m)) for m in FLOWS)) | _defined_in(_tree("worker"))
    private = {n for n in flows if n.startswith("_") and not n.startswith("__")}
    used = _attribute_names(REPO / tool) & private
    assert sorted(used - _declared() - _vllm_names()) == []


def test_the_seam_check_sees_an_undeclared_use() -> None:
    """The check above on a module that calls a sibling's private helper."""
    tree = ast.parse("class X:\n    def f(self):\n        self._finished_blocks_for({})\n")
    assert "_finished_blocks_for" in _defined_in(_tree("push"))
    assert "_finished_blocks_for" in _self_names(tree) - (_defined_in(tree) | _declared() | _vllm_names())


def test_flow_declares_nothing_of_vllms_worker() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

    methods = {n for n, v in vars(flow.Flow).items() if callable(v)}
    assert methods and not methods & set(dir(NixlPushConnectorWorker))


def test_the_wheel_holds_the_connector_package_only(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "--disable-pip-version-check", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"connector"}, packages
    assert not [n for n in names if "/testing/" in n or "/tests/" in n or n.endswith("conftest.py")]
    assert "connector/glue/worker.py" in names and "connector/router/app.py" in names


def test_no_name_is_both_a_method_and_state() -> None:
    """An attribute assigned under a method's name would replace the method on the
    instance (a flow's call then hits the value)."""
    modules = [*FLOWS, "worker", "flow"]
    methods: set[str] = set()
    assigned: set[str] = set()
    for module in modules:
        tree = _tree(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                methods.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                assigned.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                                and isinstance(t.value, ast.Name) and t.value.id == "self")
    assert methods & assigned == set()
