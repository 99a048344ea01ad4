"""P/D shapes as people deploy them: TP on both sides, heterogeneous TP, PP on P, block sizes.

One P engine (`Cluster`, one process per rank) against D engines of the fork and of
stock vLLM, side by side. Per case: the D engines first reach P by heartbeat
(the order real serving produces), then requests are pushed P->D and every D
rank's heads are checked against the P ranks that hold them. The fork's saving
figures come from its own connector stats; the stock ground truth is counted
from the NIXL calls its D workers made.

Where vLLM's push mode moves no KV (P and D block sizes differ, see `moves_kv`),
nothing is pushed unless asked (`--push`): only the heartbeat handshakes run.

    python -m harness.shapes --p-tp 2 --d-tp 1 [--p-pp 2] [--p-block-size 64] --connector fork|stock

prints one JSON line (engine logs go to files under --workdir).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from connector.glue.guard import installed_version, minor_of
from connector.vocabulary import SPAN_HANDSHAKE, Attr
from harness.cluster import Cluster
from harness.config import FORK, STOCK, EngineSpec
from harness.poll import wait_until
from harness.runner import free_port

LOCAL_AGENT = "NIXL_INIT_AGENT"
NUM_KV_HEADS = 4  # total KV heads: TP 4 still gives every rank its own head
NUM_LAYERS = 2
NUM_BLOCKS = 24
D_BLOCK_SIZE = 32
# vLLM's own stats key (stock and fork): one entry per failed handshake.
FAILED_HANDSHAKES = "num_failed_handshakes"

PerRank = list[list[dict[str, Any]]]


def moves_kv(p_block_size: int, d_block_size: int) -> bool:
    """Whether vLLM's push mode moves KV from P to D on this CPU backend.

    Only between equal block sizes. vLLM 0.32/0.33: with P 64 / D 32, P's WRITE lands
    and D's `get_transfer_results` fails its `block_size_ratio` assertion (which ends a
    harness engine's loop); with P 32 / D 64, P's P->D handshake fails it. vLLM 0.34+:
    no handshake between them succeeds (`push_refuses_other_block_sizes`).
    """
    return p_block_size == d_block_size


def push_refuses_other_block_sizes(version: str | None = None) -> bool:
    """vLLM 0.34+: push mode checks that P and D have the same block size (and physical
    blocks per logical block) in the parallel-config validation of every handshake,
    notification-only included, so a D->P handshake between them fails
    (`config_mismatch`, with vLLM's reason) before any NIXL call."""
    minor = minor_of(version or installed_version())
    return minor is not None and minor >= (0, 34)


@dataclass
class CaseResult:
    """What one P x D case did, from one D engine's point of view."""

    shape: dict[str, Any]
    connector: str
    pushed: bool = False
    bytes_ok: bool = False
    connected: list[bool] = field(default_factory=list)  # per D rank, to P after its heartbeat
    per_d_rank: list[dict[str, Any]] = field(default_factory=list)
    handshakes: list[list[dict[str, Any]]] = field(default_factory=list)  # per D rank, D->P
    calls: list[list[tuple[str, str, int]]] = field(default_factory=list)  # per D rank, this case
    stats: list[list[dict[str, Any]]] = field(default_factory=list)  # per D rank
    spans: list[list[dict[str, Any]]] = field(default_factory=list)  # per D rank (memory tracing)
    p_handshakes: list[list[dict[str, Any]]] = field(default_factory=list)  # per P rank, P->D
    p_stats: list[list[dict[str, Any]]] = field(default_factory=list)  # per P rank, this case
    failed: list[str] = field(default_factory=list)
    error: str | None = None
    log_files: list[str] = field(default_factory=list)  # per D rank (every case's lines)

    # ---- fork: from the connector's own stats
    @property
    def d_to_p(self) -> list[dict[str, Any]]:
        return [h for rank in self.handshakes for h in rank]

    @property
    def d_to_p_full_handshakes(self) -> int:
        """Fork: from its records. Stock (no records): D ranks that prepared a remote list."""
        if self.connector == FORK:
            return sum(not h["notif_only"] for h in self.d_to_p)
        return sum(any(c[0] == "prep_xfer_dlist" and c[1] != LOCAL_AGENT for c in rank)
                   for rank in self.calls)

    def saved(self, key: str) -> list[int]:
        return [sum(h[key] for h in rank) for rank in self.handshakes]

    @property
    def nothing_saved_because(self) -> list[str]:
        """Why the fork's handshake spans say nothing was saved (memory tracing only)."""
        return sorted({s["attributes"][Attr.NOTHING_SAVED_BECAUSE] for rank in self.spans for s in rank
                       if s["name"] == SPAN_HANDSHAKE and Attr.NOTHING_SAVED_BECAUSE in s["attributes"]})

    # ---- both: vLLM's own failed-handshake count
    @property
    def failed_handshakes(self) -> int:
        return sum(len(s.get(FAILED_HANDSHAKES, [])) for rank in self.stats for s in rank)

    @property
    def ok(self) -> bool:
        """No error, and where something was pushed, every byte landed right."""
        return self.error is None and (self.bytes_ok or not self.pushed)

    # ---- stock: from NIXL calls on D
    def prepared(self, local: bool) -> tuple[list[int], list[int]]:
        """(lists, descriptors) prepared per D rank, remote or local lists."""
        lists, descs = [], []
        for rank in self.calls:
            preps = [c for c in rank if c[0] == "prep_xfer_dlist" and (c[1] == LOCAL_AGENT) == local]
            lists.append(len(preps))
            descs.append(sum(c[2] for c in preps))
        return lists, descs

    def summary(self) -> dict[str, Any]:
        remote_lists, remote_descs = self.prepared(local=False)
        local_lists, local_descs = self.prepared(local=True)
        out: dict[str, Any] = {**self.shape, "connector": self.connector, "pushed": self.pushed,
                               "bytes_ok": self.bytes_ok, "d_ranks_connected": sum(self.connected),
                               "d_to_p_full_handshakes": self.d_to_p_full_handshakes,
                               "d_to_p_failed_handshakes": self.failed_handshakes,
                               "failed_requests": len(self.failed)}
        if self.connector == FORK:
            out["d_to_p_handshakes"] = len(self.d_to_p)
            out["d_to_p_notif_only_handshakes"] = len(self.d_to_p) - self.d_to_p_full_handshakes
            out["d_to_p_triggers"] = sorted({h["trigger"] for h in self.d_to_p})
            out["descriptors_saved"] = sum(self.saved("saved_descriptors"))
            out["registrations_saved"] = sum(self.saved("saved_registrations"))
            out["descriptors_saved_per_rank"] = self.saved("saved_descriptors")
            out["registrations_saved_per_rank"] = self.saved("saved_registrations")
            if self.spans:
                out["nothing_saved_because"] = self.nothing_saved_because
        out["d_remote_lists_prepared"] = sum(remote_lists)
        out["d_remote_descriptors_prepared"] = sum(remote_descs)
        out["d_local_lists_prepared"] = sum(local_lists)
        out["d_local_descriptors_prepared"] = sum(local_descs)
        out["d_lists_prepared_per_rank"] = [a + b for a, b in zip(remote_lists, local_lists)]
        out["d_descriptors_prepared_per_rank"] = [a + b for a, b in zip(remote_descs, local_descs)]
        if self.error:
            out["error"] = self.error
        return out


def engine_spec(name: str, role: str, connector: str, *, tp: int = 1, pp: int = 1,
                block_size: int = D_BLOCK_SIZE, workdir: str, tracing: Any = None,
                env: dict[str, str] | None = None) -> EngineSpec:
    return EngineSpec(name=name, engine_id=f"{name}-{secrets.token_hex(3)}", kv_role=role,
                      side_channel_port=free_port(), connector=connector, num_layers=NUM_LAYERS,
                      num_blocks=NUM_BLOCKS, num_kv_heads=NUM_KV_HEADS, block_size=block_size,
                      tp_size=tp, pp_size=pp, tracing=tracing, workdir=workdir, env=dict(env or {}))


def shape_of(p: Cluster, d: Cluster) -> dict[str, Any]:
    return {"p_tp": p.spec.tp_size, "p_pp": p.spec.pp_size, "p_block_size": p.spec.block_size,
            "d_tp": d.spec.tp_size, "d_block_size": d.spec.block_size}


def _records(stats: list[dict[str, Any]], direction: str) -> list[dict[str, Any]]:
    return [h for s in stats for h in s.get("handshakes", []) if h["direction"] == direction]


def _d_to_p_records(stats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return _records(stats, "d_to_p")


def collect_stats(cluster: Cluster, per_rank: PerRank, until: Callable[[PerRank], bool], what: str,
                  timeout_s: float) -> None:
    """Add each rank's new stats dicts to `per_rank` until `until(per_rank)` holds.

    Records reach a rank's stats on its next engine step, after the event itself:
    wait for the records a case needs, never for a fixed time.
    """
    def more() -> bool:
        for i, got in enumerate(cluster.call_all("stats")):
            per_rank[i].extend(got)
        return until(per_rank)

    wait_until(more, what, timeout_s, interval_s=0.05,
               last=lambda: [[{k: v for k, v in s.items() if v} for s in rank] for rank in per_rank])


def _handshake_ended(connections: dict[str, Any], stats: list[dict[str, Any]], p_engine_id: str,
                     fork: bool) -> bool:
    """One D rank's heartbeat handshake to P is over, whatever its outcome.

    The fork records every handshake it ends (then it is connected, or it failed);
    a stock D shows only its connection, or vLLM's failed-handshake count.
    """
    connected = p_engine_id in connections["remote_agents"]
    if fork:
        records = _d_to_p_records(stats)
        return bool(records) and (connected or records[-1]["outcome"] != "success")
    return connected or any(s.get(FAILED_HANDSHAKES) for s in stats)


class ShapeRunner:
    """Runs P x D cases and records what each D saw. D engines are reused across P engines."""

    def __init__(self, requests: int = 2, blocks_per_request: int = 2, timeout_s: float = 90.0):
        self.requests = requests
        self.blocks_per_request = blocks_per_request
        self.timeout_s = timeout_s
        self._seed = 0
        self._calls_seen: dict[str, list[int]] = {}
        self._written: dict[str, list[int]] = {}

    def _new_calls(self, d: Cluster) -> list[list[tuple[str, str, int]]]:
        """NIXL calls each D rank made since the previous look."""
        seen = self._calls_seen.setdefault(d.spec.engine_id, [0] * len(d.ranks))
        out = []
        for i, calls in enumerate(d.call_all("nixl_calls")):
            out.append([tuple(c) for c in calls[seen[i]:]])
            seen[i] = len(calls)
        return out

    def handshake_by_heartbeat(self, p: Cluster, d: Cluster, stats: PerRank) -> list[bool]:
        """Every D rank's heartbeat, before any registration, starts its D->P handshake;
        wait until each one ended (gathering D's stats into `stats`). Which D ranks are
        connected to P afterwards."""
        d.call_all("heartbeat", p.address, f"hb-{secrets.token_hex(3)}")
        eid, fork = p.spec.engine_id, d.spec.connector == FORK
        seen: list[Any] = []

        def ended(per_rank: PerRank) -> bool:
            seen[:] = d.call_all("connections")
            return all(_handshake_ended(c, s, eid, fork) for c, s in zip(seen, per_rank))

        collect_stats(d, stats, ended, f"the heartbeat handshake of every {d.name} rank to {p.name} to end",
                      self.timeout_s)
        return [eid in c["remote_agents"] for c in seen]

    def push(self, p: Cluster, d: Cluster) -> tuple[bool, list[dict[str, Any]], list[str]]:
        """Push requests P->D; check every D rank's heads against the P ranks holding them."""
        ratio = p.spec.block_size // d.spec.block_size
        pairs = []
        for _ in range(self.requests):
            base = f"cmpl-{secrets.token_hex(6)}"
            p_blocks = p.allocate(self.blocks_per_request)
            d_blocks = d.allocate(self.blocks_per_request * ratio)
            self._seed += 1
            for r, handle in enumerate(p.ranks):  # a different seed per rank: misrouted heads show
                handle.call("fill", p_blocks, self._seed * 101 + r)
            # vLLM pairs P and D requests by the id minus its random 8-hex suffix.
            p_id, d_id = f"{base}-{secrets.token_hex(4)}", f"{base}-{secrets.token_hex(4)}"
            pairs.append((p_id, d_id, p_blocks, d_blocks))
        for p_id, d_id, p_blocks, d_blocks in pairs:
            d.call_all("register", d_id, d_blocks, p.address, p_id, True)
            p.call_all("finish", p_id, p_blocks, 30.0)
        d_ids = {pair[1] for pair in pairs}

        def landed() -> bool:
            return all(d_ids <= set(r["finished_recving"]) | set(r["failed_recving"])
                       for r in d.call_all("results"))

        wait_until(landed, f"{len(d_ids)} pushes {p.name}->{d.name} to land or fail on every D rank",
                   self.timeout_s, interval_s=0.05)
        results = d.call_all("results")
        failed = sorted({i for r in results for i in d_ids
                         if i not in r["finished_recving"] or i in r["failed_recving"]})
        per_rank = [{"d_rank": t, "heads": list(hs), "from_p_tp_ranks": [], "ok": True}
                    for t, hs in enumerate(d.head_slices())]
        p_heads = p.head_slices()
        for _, d_id, p_blocks, d_blocks in pairs:
            if d_id in failed:
                for entry in per_rank:
                    entry["ok"] = False
                continue
            src, dst = p.kv_view(p_blocks), d.kv_view(d_blocks)
            for entry in per_rank:
                a, b = entry["heads"]
                entry["ok"] = bool(entry["ok"] and np.array_equal(src[:, a:b], dst[:, a:b]))
                entry["from_p_tp_ranks"] = sorted({t for t, (pa, pb) in enumerate(p_heads)
                                                   if pa < b and a < pb})
        written = self._written.setdefault(d.spec.engine_id, [])
        written.extend(b for pair in pairs for b in pair[3])
        dirty = [x for got in d.call_all("untouched", written) for x in got]
        ok = not failed and not dirty and all(e["ok"] for e in per_rank)
        return ok, per_rank, failed

    def run_case(self, p: Cluster, d: Cluster, push: bool | None = None) -> CaseResult:
        """D reaches P by heartbeat, then (when `push`; by default where vLLM moves KV
        between the two block sizes) requests are pushed P->D."""
        res = CaseResult(shape=shape_of(p, d), connector=d.spec.connector,
                         pushed=moves_kv(p.spec.block_size, d.spec.block_size) if push is None else push,
                         log_files=[str(rs.log_file) for rs in d.rank_specs])
        self._new_calls(d)
        d.call_all("stats")  # (what earlier cases left)
        p.call_all("stats")
        stats: PerRank = [[] for _ in d.ranks]
        p_stats: PerRank = [[] for _ in p.ranks]
        try:
            res.connected = self.handshake_by_heartbeat(p, d, stats)
            if res.pushed:
                res.bytes_ok, res.per_d_rank, res.failed = self.push(p, d)
                if not res.failed:  # every P rank handshook D before its WRITE
                    collect_stats(p, p_stats, lambda per: all(_records(s, "p_to_d") for s in per),
                                  f"a P->D handshake record from every {p.name} rank", self.timeout_s)
        except Exception as exc:  # recorded for the report; the caller decides
            res.error = f"{type(exc).__name__}: {exc}"
        try:  # (a D whose engine loop ended answers no more: keep what was gathered)
            d.call_all("stop_heartbeats", p.spec.engine_id)
            for i, got in enumerate(d.call_all("stats")):
                stats[i].extend(got)
            res.calls = self._new_calls(d)
            if d.spec.tracing == "memory":
                res.spans = [_handshake_spans(spans, p.spec.engine_id) for spans in d.call_all("spans")]
        except Exception as exc:
            res.error = res.error or f"{type(exc).__name__}: {exc}"
        res.stats = stats
        res.handshakes = [_d_to_p_records(s) for s in stats]
        res.p_handshakes = [_records(s, "p_to_d") for s in p_stats]
        res.p_stats = p_stats
        return res


def _handshake_spans(spans: list[dict[str, Any]], remote_engine_id: str) -> list[dict[str, Any]]:
    """Handshake spans to one remote engine, with their phase spans."""
    top = [s for s in spans if s["name"] == SPAN_HANDSHAKE
           and s["attributes"].get(Attr.REMOTE_ENGINE_ID) == remote_engine_id]
    ids = {s["span_id"] for s in top}
    return top + [s for s in spans if s["parent_span_id"] in ids]


@dataclass(frozen=True)
class PShape:
    tp: int = 1
    pp: int = 1
    block_size: int = D_BLOCK_SIZE
    d_tps: tuple[int, ...] = (1, 2)  # D engines (TP sizes) run against this P


# The matrix: P TP x D TP in {(1,1),(1,2),(2,1),(2,2),(4,2)}, P PP 2, and P's block
# size larger than D's (P 64 / D 32). vLLM's push mode moves no KV in that last one
# (`moves_kv`): only the handshakes run there (on 0.34 they fail), and it comes last,
# after which failed heartbeat handshakes cannot spill into another case.
MATRIX = (
    PShape(tp=1, d_tps=(1, 2)),
    PShape(tp=2, d_tps=(1, 2)),
    PShape(tp=4, d_tps=(2,)),
    PShape(tp=1, pp=2, d_tps=(1, 2)),
    PShape(tp=1, block_size=64, d_tps=(1,)),
)


def run_matrix(workdir: str, shapes: tuple[PShape, ...] = MATRIX, requests: int = 2,
               tracing: Any = "memory") -> Iterator[tuple[Cluster, Cluster, CaseResult]]:
    """Every shape against a fork D and a stock D of each TP size, side by side.

    D engines start once and serve every P shape; P engines start one at a time
    (few processes at once on a small machine). Yields (P, D, result) per case.
    """
    d_tps = sorted({t for s in shapes for t in s.d_tps})
    ds: dict[tuple[str, int], Cluster] = {}
    try:
        for tp in d_tps:
            for conn in (FORK, STOCK):
                spec = engine_spec(f"D{tp}{conn}", "kv_consumer", conn, tp=tp, workdir=workdir,
                                   tracing=tracing if conn == FORK else None)
                ds[(conn, tp)] = Cluster(spec)
        for cluster in ds.values():
            cluster.launch()
        for cluster in ds.values():
            cluster.finish_start()
        runner = ShapeRunner(requests=requests)
        for i, shape in enumerate(shapes):
            p = Cluster(engine_spec(f"P{i}tp{shape.tp}pp{shape.pp}bs{shape.block_size}", "kv_producer",
                                    FORK, tp=shape.tp, pp=shape.pp, block_size=shape.block_size,
                                    workdir=workdir))
            with p:
                for tp in shape.d_tps:
                    for conn in (FORK, STOCK):
                        d = ds[(conn, tp)]
                        yield p, d, runner.run_case(p, d)
    finally:
        for cluster in ds.values():  # all decoders shut down at once
            for handle in cluster.ranks:
                handle.request_stop()
        for cluster in ds.values():
            for handle in cluster.ranks:
                handle.finish_stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p-tp", type=int, default=1)
    ap.add_argument("--p-pp", type=int, default=1)
    ap.add_argument("--d-tp", type=int, default=1)
    ap.add_argument("--p-block-size", type=int, default=D_BLOCK_SIZE)
    ap.add_argument("--d-block-size", type=int, default=D_BLOCK_SIZE)
    ap.add_argument("--connector", choices=[FORK, STOCK], default=FORK, help="the D engine's connector")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--push", action=argparse.BooleanOptionalAction, default=None,
                    help="push requests (default: only where vLLM moves KV between the block sizes; "
                         "--push with different block sizes shows D's engine loop failing)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--matrix", action="store_true",
                    help="run the whole matrix (fork and stock D side by side), one JSON line per case")
    args = ap.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="shapes-")
    print(f"engine logs: {work}/*.log", file=sys.stderr)
    if args.matrix:
        ok = True
        for _, _, res in run_matrix(work, requests=args.requests):
            print(json.dumps(res.summary()), flush=True)
            ok = ok and res.ok
        return 0 if ok else 1
    p = Cluster(engine_spec("P", "kv_producer", FORK, tp=args.p_tp, pp=args.p_pp,
                            block_size=args.p_block_size, workdir=work))
    d = Cluster(engine_spec("D", "kv_consumer", args.connector, tp=args.d_tp,
                            block_size=args.d_block_size, workdir=work,
                            tracing="memory" if args.connector == FORK else None))
    ok = False
    try:
        p.start()
        d.start()
        res = ShapeRunner(requests=args.requests).run_case(p, d, push=args.push)
        summary, ok = res.summary(), res.ok
    except Exception as exc:
        summary = {"p_tp": args.p_tp, "p_pp": args.p_pp, "d_tp": args.d_tp, "connector": args.connector,
                   "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    finally:
        d.stop()
        p.stop()
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
