"""Start-up guard: is the installed vLLM one this fork can work with?

The fork subclasses vLLM's NIXL push worker, overrides about twenty of its methods
and calls about as many of its methods and attributes. A vLLM release that renames
or reshapes one of them would not fail loudly: an override that is never called
just stops measuring, and a changed signature fails on the first handshake. So the
worker checks the whole surface once when it starts:

- every vLLM method we override or call exists and accepts what we pass;
- every attribute we read exists once vLLM's constructor has run;
- the metadata fields we decode and the seam the connector uses exist;
- the vLLM functions we re-implement in our own words (or whose exact behaviour, such
  as the order of what they do, we rely on) have the source CI tested
  (`PINNED_SOURCES`, a digest per tested minor): a patch release that changes one is
  named at start-up;
- the version is inside the range CI tests (`TESTED_MINORS`).
The per-minor tables (pinned functions, attribute sets) live in connector/glue/pins.py.

Anything wrong fails at once, naming the missing piece, the installed version and
the tested range. `NIXL_PUSH_OBSERVED_ALLOW_UNTESTED=1` runs anyway (logged), and
the API server then reports `vllm:nixl_observed_degraded 1` on /metrics.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import logging
import os
import re
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from connector.glue import pins

logger = logging.getLogger(__name__)

# vLLM minor releases CI runs the suite on (connector/glue/pins.py; keep in step with
# pyproject's `cuda` extra, tests/test_locks.py checks it).
TESTED_MINORS: tuple[tuple[int, int], ...] = pins.tested_minors()
TESTED_RANGE = (f">={TESTED_MINORS[0][0]}.{TESTED_MINORS[0][1]},"
                f"<{TESTED_MINORS[-1][0]}.{TESTED_MINORS[-1][1] + 1}")
ALLOW_UNTESTED_ENV = "NIXL_PUSH_OBSERVED_ALLOW_UNTESTED"
# The module-level name vLLM's NixlPushConnector.__init__ builds its worker by (our seam).
WORKER_SEAM = "NixlPushConnectorWorker"
SCHEDULER_SEAM = "NixlPushConnectorScheduler"


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM lacks something the fork relies on, or is untested."""


@dataclass(frozen=True)
class Call:
    """One vLLM method we override or call, and how we call it."""

    owner: str  # key into the owner table (see `_owners`)
    name: str
    # Positional arguments after self; None: we pass through whatever vLLM gives
    # (an observing override), so only existence matters.
    args: tuple[Any, ...] | None = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Keywords we pass only when the signature takes them (see compat.accepted).
    offered: tuple[str, ...] = ()
    # Keyword names the method must accept (we pass them when it does; without
    # them the result would be wrong, not just unmeasured).
    needs: tuple[str, ...] = ()
    # Parameter (after self) that must sit at a fixed position: (name, index).
    position: tuple[str, int] | None = None


_ANY = object()  # a placeholder argument value; only the binding is checked
_REMOTE_SIZES = ("remote_tp_rank", "remote_tp_size", "remote_dcp_size")

# Methods of vLLM's push worker (or its base) that connector/glue/worker.py overrides
# or calls, with the arguments it passes.
WORKER_CALLS: tuple[Call, ...] = (
    Call("worker", "_ensure_handshake", (_ANY, _ANY, _ANY, _ANY),
         needs=("pp_size", "notif_agents_only")),
    Call("worker", "_evict_stale_engines"),
    Call("worker", "add_remote_agent", (_ANY,), offered=_REMOTE_SIZES,
         needs=("remote_tp_rank", "remote_tp_size")),
    Call("worker", "_add_notif_only_remote_agent", (_ANY,), offered=_REMOTE_SIZES),
    Call("worker", "_validate_remote_parallel_config", (_ANY,)),
    Call("worker", "_validate_csa_linear_tp_layout", (_ANY,)),
    Call("worker", "_validate_remote_agent_handshake", None),
    Call("worker", "register_local_xfer_handler", None),
    Call("worker", "_build_local_splits_from_plan", None),
    Call("worker", "_build_fa_remote", None),
    Call("worker", "_build_mamba_remote", None),
    Call("worker", "_cleanup_remote_engine", (_ANY,), {"log_eviction": _ANY}),
    Call("worker", "start_load_kv", (_ANY,)),
    Call("worker", "_send_heartbeats", (_ANY,)),
    Call("worker", "_send_registration_to_p", (_ANY, _ANY)),
    Call("worker", "_do_send_reg_notif", (_ANY, _ANY)),
    Call("worker", "_do_start_push_kv", (_ANY, _ANY, _ANY)),
    Call("worker", "_xfer_blocks_for_req", (), {"req_id": _ANY, "meta": _ANY}),
    Call("worker", "_as_grouped_block_ids", (_ANY,)),
    Call("worker", "_logical_to_kernel_block_ids", (_ANY, _ANY)),
    Call("worker", "_apply_prefix_caching", (), {"decode_block_ids": _ANY, "prefill_block_ids": _ANY,
                                                 "decode_physical_per_logical": _ANY,
                                                 "prefill_physical_per_logical": _ANY}),
    Call("worker", "register_kv_caches", (_ANY,)),
    Call("worker", "_push_writer_loop"),
    Call("worker", "_xfer_blocks", None, position=("request_id", 2)),
    Call("worker", "_log_failure", (_ANY, _ANY, _ANY, _ANY, _ANY), {"remote_engine_id": _ANY}),
    Call("worker", "get_transfer_results"),
    Call("worker", "_handle_push_reg_notif", (_ANY,)),
    Call("worker", "_pop_matching_finished_blocks", (_ANY,)),
    Call("worker", "_handle_heartbeat", (_ANY,)),
    Call("worker", "_reap_expired_send_leases", (_ANY,)),
    Call("topology", "handshake_target_ranks", (_ANY, _ANY)),
    Call("stats", "__post_init__"),
    Call("stats", "reset"),
    Call("stats", "is_empty"),
    Call("stats", "reduce"),
    Call("stats", "aggregate", (_ANY,)),
    Call("stats", "record_failed_handshake"),
    Call("stats", "record_failed_notification"),
    Call("stats", "record_failed_transfer"),
    Call("prom", "observe", (_ANY, _ANY)),
    Call("scheduler", "_nixl_handshake_listener", (_ANY, _ANY, _ANY, _ANY, _ANY)),
    Call("scheduler", "set_xfer_handshake_metadata", (_ANY,)),
    Call("scheduler", "on_new_request", (_ANY,)),
)

# Attributes vLLM's push scheduler sets that the fork's scheduler reads (source scan too).
SCHEDULER_ATTRIBUTES: tuple[str, ...] = (
    "_heartbeat_req_engine", "_heartbeat_by_engine", "_push_pending_registrations",
    "_newly_finished_push_blocks",
)

# Per-minor tables (connector/glue/pins.py): the functions pinned by source digest and
# the worker attributes the fork reads.
PINNED_SOURCES = pins.PINNED_SOURCES

# Fields of the side-channel messages we decode ourselves.
METADATA_FIELDS: dict[str, tuple[str, ...]] = {
    "NixlHandshakePayload": ("compatibility_hash", "agent_metadata_bytes"),
    "NixlAgentMetadata": ("engine_id", "agent_metadata", "kv_caches_base_addr", "num_blocks",
                          "block_size", "region_num_blocks", "dcp_size"),
}


def source_digest(func: Any) -> str:
    """The digest `PINNED_SOURCES` holds for a function's source."""
    source = textwrap.dedent(inspect.getsource(func))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def minor_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string ('0.34.0', '0.32.0+cpu', '0.35.0.dev3'), or None."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def digest_of(qualname: str, owners: dict[str, Any] | None = None) -> str | None:
    """The source digest of vLLM's `Class.method` as installed (None: no such function)."""
    owners = owners or _owners()
    classes = {cls.__name__: cls for cls in (owners["base"], owners["worker"])}
    cls_name, name = qualname.split(".")
    func = _stock_method(classes[cls_name], name) if cls_name in classes else None
    try:
        return source_digest(getattr(func, "__func__", func)) if func is not None else None
    except (OSError, TypeError):
        return None


def pinned_source_problems(version: str, owners: dict[str, Any] | None = None,
                           pinned: dict[tuple[int, int], dict[str, str]] | None = None) -> list[str]:
    """vLLM functions the fork re-implements or relies on whose source is not the one CI
    tested on this minor."""
    minor = minor_of(version)
    wanted = (pinned or PINNED_SOURCES).get(minor) if minor else None
    if wanted is None:
        return []  # an untested minor: the version check says so
    owners = owners or _owners()
    problems = []
    for qualname, digest in wanted.items():
        got = digest_of(qualname, owners)
        if got != digest:
            why = pins.WHY_PINNED.get(qualname, "re-implemented or relied on by the fork")
            problems.append(f"{qualname} is not the source this connector was tested with on vLLM "
                            f"{minor[0]}.{minor[1]} ({why}; digest {got} != {digest}): review it "
                            "against connector/glue")
    return problems


def installed_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # pragma: no cover - vLLM import itself broken
        return "unknown"


def version_tested(version: str) -> bool:
    """True when `version` (e.g. '0.33.0', '0.32.0+cpu', '0.33.1.dev3') is a minor CI runs."""
    return minor_of(version) in TESTED_MINORS


def worker_attributes(version: str) -> tuple[str, ...]:
    """Attributes vLLM's worker constructor sets on this minor that the fork reads."""
    return pins.for_minor(pins.WORKER_ATTRIBUTES, minor_of(version))


def later_attributes(version: str) -> tuple[str, ...]:
    """Attributes vLLM's worker assigns later on this minor that the fork reads."""
    return pins.for_minor(pins.LATER_ATTRIBUTES, minor_of(version))


def _owners() -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
        NixlPushConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
        NixlPushConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
        NixlKVConnectorStats,
        NixlPromMetrics,
    )

    return {"worker": NixlPushConnectorWorker, "base": NixlBaseConnectorWorker,
            "topology": TransferTopology,
            "stats": NixlKVConnectorStats, "prom": NixlPromMetrics,
            "scheduler": NixlPushConnectorScheduler}


def _stock_method(cls: type, name: str) -> Any:
    """`cls.name` as vLLM defines it (raw, so static/class methods are recognisable)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


def check_call(call: Call, owner: type) -> str | None:
    """None when the call is fine, else what is wrong with it."""
    where = f"{owner.__name__}.{call.name}"
    func = _stock_method(owner, call.name)
    implicit: tuple[Any, ...] = (_ANY,)  # self or cls
    if isinstance(func, staticmethod | classmethod):
        implicit = () if isinstance(func, staticmethod) else implicit
        func = func.__func__
    if func is None or not callable(func):
        return f"{where} is missing"
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None  # builtins without a signature: existence is all we can check
    params = list(sig.parameters.values())
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    names = [p.name for p in params]
    for needed in call.needs:
        if needed not in names and not has_var_kw:
            return f"{where}{sig} no longer takes {needed!r}"
    if call.position is not None:
        name, index = call.position
        if names[len(implicit):][index:index + 1] != [name]:
            return f"{where}{sig}: expected {name!r} as argument {index + 1}"
    if call.args is None:
        return None
    offered = {k: _ANY for k in call.offered if k in names or has_var_kw}
    try:
        sig.bind(*implicit, *call.args, **call.kwargs, **offered)
    except TypeError as exc:
        shown = ", ".join(["self", *["_"] * len(call.args), *call.kwargs, *offered])
        return f"{where}{sig} does not accept ({shown}): {exc}"
    return None


def surface_problems(calls: Iterable[Call] = WORKER_CALLS,
                     owners: dict[str, Any] | None = None, version: str | None = None) -> list[str]:
    """Problems with the vLLM classes, methods and fields we rely on (class level)."""
    version = version or installed_version()
    problems: list[str] = []
    try:
        owners = owners or _owners()
    except ImportError as exc:
        return [f"cannot import a vLLM class the fork subclasses: {exc}"]
    for call in calls:
        owner = owners.get(call.owner)
        if owner is None:
            problems.append(f"{call.owner} class is missing")
            continue
        problem = check_call(call, owner)
        if problem:
            problems.append(problem)
    problems.extend(_metadata_problems())
    problems.extend(_seam_problems())
    problems.extend(_later_attribute_problems(owners["worker"], later_attributes(version)))
    problems.extend(_later_attribute_problems(owners["scheduler"], SCHEDULER_ATTRIBUTES))
    return problems


def _assigned_attributes(cls: type) -> set[str]:
    """Names vLLM's worker or scheduler modules assign as `self.<name> = ...`."""
    names: set[str] = set()
    for path in {inspect.getsourcefile(k) for k in cls.__mro__ if k is not object} - {None}:
        names |= _self_targets(path)
    return names


@functools.cache
def _self_targets(path: str) -> frozenset[str]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
        for target in targets:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id == "self"):
                names.add(target.attr)
    return frozenset(names)


def _later_attribute_problems(worker_cls: type, names: Iterable[str]) -> list[str]:
    assigned = _assigned_attributes(worker_cls)
    return [f"{worker_cls.__name__} no longer sets self.{name}" for name in names if name not in assigned]


def _metadata_problems() -> list[str]:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata
    except ImportError as exc:
        return [f"cannot import vLLM's NIXL metadata module: {exc}"]
    problems = [] if hasattr(metadata, "GET_META_MSG") else ["metadata.GET_META_MSG is missing"]
    for struct, wanted in METADATA_FIELDS.items():
        cls = getattr(metadata, struct, None)
        fields = set(getattr(cls, "__dataclass_fields__", None) or getattr(cls, "__struct_fields__", ()))
        problems.extend(f"{struct}.{name} is missing" for name in wanted if name not in fields)
    return problems


def _seam_problems() -> list[str]:
    """The connector injects its worker through the name vLLM's constructor uses."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as stock

    init = getattr(getattr(stock, "NixlPushConnector", None), "__init__", None)
    code = getattr(init, "__code__", None)
    return [f"NixlPushConnector.__init__ no longer builds its {role} by the name {seam!r}"
            for role, seam in (("worker", WORKER_SEAM), ("scheduler", SCHEDULER_SEAM))
            if not hasattr(stock, seam) or code is None or seam not in code.co_names]


def attribute_problems(worker: Any, names: Iterable[str]) -> list[str]:
    """Attributes vLLM's constructor should have set on `worker` but did not."""
    return [f"worker attribute {name!r} (set by vLLM's constructor) is missing"
            for name in names if not hasattr(worker, name)]


@dataclass
class Verdict:
    version: str
    tested: bool
    problems: list[str]

    @property
    def ok(self) -> bool:
        return self.tested and not self.problems

    def message(self) -> str:
        """One line per refused piece, under a head naming the version and the tested range."""
        if self.tested:
            lines = [f"nixl-push-observed: vLLM {self.version} (tested range {TESTED_RANGE}) lacks "
                     "pieces this connector relies on:"]
        else:
            newest = "{}.{}".format(*TESTED_MINORS[-1])
            lines = [f"nixl-push-observed: vLLM {self.version} is outside the tested range {TESTED_RANGE}:",
                     "  - the version: CI tests the vLLM minors "
                     + ", ".join("{}.{}".format(*m) for m in TESTED_MINORS)
                     + (f" (the pieces below are checked against {newest}'s)" if self.problems else "")]
        lines += [f"  - {p}" for p in self.problems]
        lines.append(f"Install a vLLM in {TESTED_RANGE}, or set {ALLOW_UNTESTED_ENV}=1 to run anyway "
                     "(telemetry is then marked degraded: vllm:nixl_observed_degraded 1).")
        return "\n".join(lines)


def import_failure_message(exc: ImportError) -> str:
    return (f"nixl-push-observed could not import a vLLM piece it relies on ({exc}). Installed vLLM: "
            f"{installed_version()}; tested range {TESTED_RANGE}. Install a vLLM in that range.")


def allow_untested() -> bool:
    return os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def assess(version: str | None = None) -> Verdict:
    """The class-level verdict (no worker instance needed: also used by the API server)."""
    version = version or installed_version()
    return Verdict(version, version_tested(version),
                   surface_problems(version=version) + pinned_source_problems(version))


def check_worker(worker: Any, *, version: str | None = None) -> Verdict:
    """Run at worker start-up: raise `UnsupportedVllmError` unless all is well or allowed."""
    verdict = assess(version)
    verdict.problems.extend(attribute_problems(worker, worker_attributes(verdict.version)))
    if verdict.ok:
        return verdict
    if not allow_untested():
        raise UnsupportedVllmError(verdict.message())
    logger.warning("%s\nRunning anyway because %s is set.", verdict.message(), ALLOW_UNTESTED_ENV)
    return verdict


def degraded() -> bool:
    """Whether this process runs on a vLLM the guard does not vouch for (for /metrics)."""
    try:
        return not assess().ok
    except Exception:
        logger.debug("guard assessment failed", exc_info=True)
        return True


def main(argv: list[str] | None = None) -> int:
    """Print the pin lines for the installed vLLM (every function pinned for any minor,
    or the `Class.method` names given): what to paste into pins.py for a new minor."""
    names = list(argv if argv is not None else sys.argv[1:]) or list(
        dict.fromkeys(name for minor in sorted(PINNED_SOURCES, reverse=True)
                      for name in PINNED_SOURCES[minor]))
    print(f"# vLLM {installed_version()}")
    for name in names:
        print(f'        "{name}": "{digest_of(name)}",')
    return 0


if __name__ == "__main__":
    sys.exit(main())
