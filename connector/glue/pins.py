"""What the start-up guard checks, per vLLM minor CI runs (data only; guard.py checks it).

- `PINNED_SOURCES`: vLLM functions the fork re-implements in its own words, or whose
  exact behaviour (often the order of what they do) it relies on, with the sha256
  (first 16 hex digits) of each one's dedented source, as CI tested it. Pin or unpin a
  function with one line per minor, plus its line in `WHY_PINNED`;
  `python -m connector.glue.guard` prints the lines for the installed vLLM.
- `WORKER_ATTRIBUTES` / `LATER_ATTRIBUTES`: the attributes of vLLM's worker the fork
  reads or replaces, set by its constructor / assigned later (when KV caches register).

A minor is tested when it has an entry in each table (tests/test_guard.py keeps them
in step with each other and with pyproject's `cuda` extra). This module is data: it
imports nothing of the project (guard.py reads it).
"""

from __future__ import annotations

Minor = tuple[int, int]

# ------------------------------------------------------------------ pinned sources
PINNED_SOURCES: dict[Minor, dict[str, str]] = {
    (0, 32): {
        "NixlBaseConnectorWorker._ensure_handshake": "259894cd168148e0",
        "NixlBaseConnectorWorker._nixl_handshake": "ab0315f92e542085",
        "NixlBaseConnectorWorker._log_failure": "10ad0c82a548c45c",
        "NixlBaseConnectorWorker._handle_heartbeat": "de391c234b5b3682",
        "NixlBaseConnectorWorker._reap_expired_send_leases": "fe6ddaa577df8371",
        "NixlPushConnectorWorker._handle_push_reg_notif": "9c04b1f1eaba6ea9",
        "NixlPushConnectorWorker.start_load_kv": "88de86599665fecb",
        "NixlPushConnectorWorker._push_writer_loop": "b241b98039044f8b",
        "NixlPushConnectorWorker.get_transfer_results": "f77817186d4c1dd0",
        "NixlBaseConnectorWorker.get_transfer_results": "940893539175e22d",
        "NixlPushConnectorWorker._pop_matching_registration": "4d349834db0ab68c",
        "NixlBaseConnectorWorker._send_heartbeats": "2a8a412490206141",
        "NixlPushConnectorWorker._do_start_push_kv": "f744c6a152e2d7aa",
        "NixlBaseConnectorWorker._evict_stale_engines": "9a5fd91af6f432b9",
        "NixlPushConnectorWorker._xfer_blocks_for_req": "140845f470c485c2",
        "NixlPushConnectorWorker._get_new_notifs": "e9f04324a95ff6d9",
        "NixlPushConnectorWorker._send_registration_to_p": "b63238f1eda0bc4a",
        "NixlPushConnectorWorker._do_send_reg_notif": "cdad4ef7b4bc2771",
    },
    (0, 33): {
        "NixlBaseConnectorWorker._ensure_handshake": "259894cd168148e0",
        "NixlBaseConnectorWorker._nixl_handshake": "ab0315f92e542085",
        "NixlBaseConnectorWorker._log_failure": "10ad0c82a548c45c",
        "NixlBaseConnectorWorker._handle_heartbeat": "de391c234b5b3682",
        "NixlBaseConnectorWorker._reap_expired_send_leases": "fe6ddaa577df8371",
        "NixlPushConnectorWorker._handle_push_reg_notif": "9c04b1f1eaba6ea9",
        "NixlPushConnectorWorker.start_load_kv": "88de86599665fecb",
        "NixlPushConnectorWorker._push_writer_loop": "b241b98039044f8b",
        "NixlPushConnectorWorker.get_transfer_results": "24c9c922d387de3b",
        "NixlBaseConnectorWorker.get_transfer_results": "940893539175e22d",
        "NixlPushConnectorWorker._pop_matching_registration": "4d349834db0ab68c",
        "NixlBaseConnectorWorker._send_heartbeats": "2a8a412490206141",
        "NixlPushConnectorWorker._do_start_push_kv": "f744c6a152e2d7aa",
        "NixlBaseConnectorWorker._evict_stale_engines": "9a5fd91af6f432b9",
        "NixlPushConnectorWorker._xfer_blocks_for_req": "140845f470c485c2",
        "NixlPushConnectorWorker._get_new_notifs": "ad58ad79de2dbc6d",
        "NixlPushConnectorWorker._send_registration_to_p": "b63238f1eda0bc4a",
        "NixlPushConnectorWorker._do_send_reg_notif": "cdad4ef7b4bc2771",
    },
    (0, 34): {
        "NixlBaseConnectorWorker._ensure_handshake": "259894cd168148e0",
        "NixlBaseConnectorWorker._nixl_handshake": "ab0315f92e542085",
        "NixlBaseConnectorWorker._log_failure": "10ad0c82a548c45c",
        "NixlBaseConnectorWorker._handle_heartbeat": "de391c234b5b3682",
        "NixlBaseConnectorWorker._reap_expired_send_leases": "fe6ddaa577df8371",
        "NixlPushConnectorWorker._handle_push_reg_notif": "9c04b1f1eaba6ea9",
        "NixlPushConnectorWorker.start_load_kv": "88de86599665fecb",
        "NixlPushConnectorWorker._push_writer_loop": "b241b98039044f8b",
        "NixlPushConnectorWorker.get_transfer_results": "24c9c922d387de3b",
        "NixlBaseConnectorWorker.get_transfer_results": "018a2aa039160895",
        "NixlPushConnectorWorker._pop_matching_registration": "4d349834db0ab68c",
        "NixlBaseConnectorWorker._send_heartbeats": "2a8a412490206141",
        "NixlPushConnectorWorker._do_start_push_kv": "f744c6a152e2d7aa",
        "NixlBaseConnectorWorker._evict_stale_engines": "9a5fd91af6f432b9",
        "NixlPushConnectorWorker._xfer_blocks_for_req": "61ad31254ddf3666",
        "NixlPushConnectorWorker._get_new_notifs": "ad58ad79de2dbc6d",
        "NixlPushConnectorWorker._send_registration_to_p": "b63238f1eda0bc4a",
        "NixlPushConnectorWorker._do_send_reg_notif": "cdad4ef7b4bc2771",
    },
}

# Why each pinned function is pinned: what in connector/glue depends on it (shown in a refusal).
WHY_PINNED: dict[str, str] = {
    "NixlBaseConnectorWorker._ensure_handshake":
        "re-implemented in handshakes.py (flavor, dedup by engine, upgrade, retries)",
    "NixlBaseConnectorWorker._nixl_handshake":
        "re-implemented in handshakes.py (the same exchange and checks, cut into phases)",
    "NixlBaseConnectorWorker._log_failure": "re-implemented in worker.py (same logger, line and keys)",
    "NixlBaseConnectorWorker._handle_heartbeat": "re-implemented in leases.py (renewal by request id)",
    "NixlBaseConnectorWorker._reap_expired_send_leases":
        "relied on by leases.py: it releases the expired entries of the `_reqs_to_send` it finds "
        "(the fork puts a map of the due leases there for the call) and touches no other",
    "NixlPushConnectorWorker._handle_push_reg_notif":
        "re-implemented in push.py (a bad PUSH_REG costs no other request)",
    "NixlPushConnectorWorker.start_load_kv":
        "relied on by worker.py: registrations and finished blocks are queued to the writer, leases "
        "set from the step's metadata, and heartbeats sent last (the only handshakes it starts)",
    "NixlPushConnectorWorker._push_writer_loop":
        "relied on by handshakes.py, push.py, receive.py, notifications.py: the writer alone calls "
        "_send_registration_to_p and _do_start_push_kv, reads NIXL notifications only through "
        "nixl_wrapper.get_new_notifs() (where the router stands), and hands PUSH_REGs to "
        "_handle_push_reg_notif and every other notification to _pending_completion_notifs",
    "NixlPushConnectorWorker.get_transfer_results":
        "relied on by worker.py: vLLM's base results first, then the WRITEs done, under "
        "_sending_transfers_lock",
    "NixlBaseConnectorWorker.get_transfer_results":
        "relied on by worker.py, receive.py, peers.py: notifications are read first, then "
        "_failed_recv_reqs is drained (the fork queues the receives it fails before calling it)",
    "NixlPushConnectorWorker._pop_matching_registration":
        "re-implemented in push.py (the lease ledger claims the match or refuses it)",
    "NixlBaseConnectorWorker._send_heartbeats":
        "re-implemented in leases.py (a failed send marks the peer suspect; a heartbeat kept while "
        "its engine's handshake is pending; only the receives still wanted, with their send time)",
    "NixlPushConnectorWorker._do_start_push_kv":
        "re-implemented in push.py (the handshake asked for with its trigger and span; a WRITE to a "
        "connection being dropped waits for the next one)",
    "NixlPushConnectorWorker._xfer_blocks_for_req":
        "relied on by push.py: each WRITE is posted through _xfer_blocks (with request_id by "
        "keyword) and all handles are published in one locked update at the end",
    "NixlPushConnectorWorker._send_registration_to_p":
        "re-implemented in receive.py (a failed handshake fails the receive only if no PUSH_REG of "
        "it reached P; the handshake asked for with its trigger and span)",
    "NixlPushConnectorWorker._do_send_reg_notif":
        "re-implemented in receive.py (a PUSH_REG that reached no agent is sent again with the next "
        "connection, never failed; which agents it reached goes to the receive ledger)",
    "NixlBaseConnectorWorker._evict_stale_engines":
        "relied on by peers.py: it releases idle engines only through _cleanup_remote_engine",
    "NixlPushConnectorWorker._get_new_notifs":
        "relied on by leases.py and peers.py: heartbeats are its only use of HB notifications (the "
        "fork's writer applies them and takes them out)",
}

# ------------------------------------------------------------------ attributes
# Set by vLLM's worker constructor (checked on the live worker at start-up).
_CONSTRUCTOR_ALL: tuple[str, ...] = (
    "kv_transfer_config", "nixl_wrapper", "_remote_agents", "_handshake_lock",
    "_handshake_futures", "_engine_clock_offset",
    "_engine_last_active", "xfer_stats", "tp_rank", "engine_id", "transfer_topo",
    "use_host_buffer", "device_id", "compat_hash", "enforce_compat_hash", "_is_csa_linear",
    "block_size", "src_xfer_handles_by_block_size", "block_len_per_layer",
    "pp_size", "_pending_completion_notifs", "_failed_recv_reqs",
    "_recving_metadata", "_push_finished_blocks", "_pending_d_registrations",
    "_reqs_to_send", "_reqs_to_process", "_lease_extension", "_sending_transfers",
    "_sending_transfers_lock", "_reg_send_inbox", "_push_writer_wake", "_evict_finished_inbox",
    "_deferred_push_inbox", "_send_failures", "_push_writer_stop", "world_size",
    "_physical_blocks_per_logical_kv_block",
)
WORKER_ATTRIBUTES: dict[Minor, tuple[str, ...]] = {
    # savings.py: a PP stage's window of a PP=1 peer's regions.
    (0, 32): (*_CONSTRUCTOR_ALL, "_remote_region_offset"),
    (0, 33): (*_CONSTRUCTOR_ALL, "_remote_region_offset"),
    # savings.py: the layers this worker holds, by which 0.34 pairs a peer's regions.
    (0, 34): (*_CONSTRUCTOR_ALL, "_regions_by_layer"),
}
# Assigned later (when KV caches are registered): checked in vLLM's source, as
# assignments `self.<name> = ...` somewhere in the worker classes.
LATER_ATTRIBUTES: dict[Minor, tuple[str, ...]] = {
    (0, 32): ("num_descs", "_transfer_layer_region_indices", "_transfer_layer_names", "region_names"),
    (0, 33): ("num_descs", "_transfer_layer_region_indices", "_transfer_layer_names", "region_names"),
    (0, 34): ("num_descs", "region_names", "region_members"),
}


def tested_minors() -> tuple[Minor, ...]:
    """Minors with an entry in every table, oldest first."""
    return tuple(sorted(set(PINNED_SOURCES) & set(WORKER_ATTRIBUTES) & set(LATER_ATTRIBUTES)))


def for_minor(table: dict[Minor, tuple[str, ...]], minor: Minor | None) -> tuple[str, ...]:
    """The table's entry for `minor`; the newest tested minor's for one CI does not run
    (the version check refuses it anyway; the other problems are then named against it)."""
    return table.get(minor) if minor in table else table[max(table)]  # type: ignore[index,return-value]
