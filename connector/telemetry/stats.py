"""Worker-side stats: vLLM's NIXL stats plus one summary per handshake and push counters.

It travels exactly like the stock object (worker `get_kv_connector_stats()` ->
aggregation across TP/PP workers -> `to_dict()` in SchedulerStats -> rebuilt in the
API server with `build_kv_connector_stats`), so every field stays msgpack-friendly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from connector.telemetry.record import HandshakeRecord
from connector.vocabulary import OUR_STAT_KEYS, StatKey


class ObservedNixlStats(NixlKVConnectorStats):
    """`NixlKVConnectorStats` with handshake summaries and push counters."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # Stats rebuilt from a stock peer's dict lack our keys: add them empty.
        for key in OUR_STAT_KEYS:
            self.data.setdefault(key, [])

    def reset(self) -> None:
        super().reset()
        for key in OUR_STAT_KEYS:
            self.data[key] = []

    # -- recording (worker threads; list.append is atomic under the GIL) -------
    def record_handshake(self, record: HandshakeRecord) -> None:
        self.data[StatKey.HANDSHAKES].append(record.to_stats())

    def record_push_reg_notif(self, sent: bool) -> None:
        self.data[StatKey.PUSH_REG_SENT if sent else StatKey.PUSH_REG_FAILED].append(1)

    def record_push(self, key: str) -> None:
        self.data[key].append(1)

    def record_receive(self, outcome: str, seconds: float, ids: tuple[str, str] | None) -> None:
        """One D-side receive; `ids` (trace id, span id) of its span become the exemplar."""
        rec: dict[str, Any] = {"outcome": outcome, "duration": seconds}
        if ids is not None:
            rec["trace_id"], rec["span_id"] = ids
        self.data[StatKey.RECEIVES].append(rec)

    # -- vLLM's contract ---------------------------------------------------------
    def is_empty(self) -> bool:
        # An interval with only handshakes (no transfer yet) must not be dropped.
        return super().is_empty() and not any(self.data.get(k) for k in OUR_STAT_KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        for key, values in other.data.items():
            self.data.setdefault(key, []).extend(values)
        return self

    @property
    def handshakes(self) -> list[dict[str, Any]]:
        return self.data.get(StatKey.HANDSHAKES, [])

    @property
    def receives(self) -> list[dict[str, Any]]:
        return self.data.get(StatKey.RECEIVES, [])

    def reduce(self) -> dict[str, int | float]:
        """The stock "KV Transfer metrics" log line, extended with handshakes."""
        out = dict(super().reduce())
        receives = self.receives
        if receives:
            out["Receives"] = len(receives)
            out["Failed receives"] = sum(r.get("outcome") != "success" for r in receives)
        hs = self.handshakes
        if not hs:
            out["Num handshakes"] = 0
            return out
        durations = np.asarray([h["duration"] for h in hs], dtype=float)
        d_to_p = [h for h in hs if h["direction"] == "d_to_p"]
        out.update(
            {
                "Num handshakes": len(hs),
                "Failed handshakes": sum(h["outcome"] != "success" for h in hs),
                "Notif-only D->P handshakes": sum(bool(h["notif_only"]) for h in d_to_p),
                "Full D->P handshakes": sum(not h["notif_only"] for h in d_to_p),
                "Avg handshake time (ms)": round(float(durations.mean()) * 1e3, 3),
                "P90 handshake time (ms)": round(float(np.percentile(durations, 90)) * 1e3, 3),
                "Descriptor regs saved": sum(h["saved_registrations"] for h in hs),
                "Descriptors saved": sum(h["saved_descriptors"] for h in hs),
                "PUSH_REG sent": len(self.data.get(StatKey.PUSH_REG_SENT, [])),
                "Pushes completed": len(self.data.get(StatKey.PUSHES_COMPLETED, [])),
            }
        )
        return out
