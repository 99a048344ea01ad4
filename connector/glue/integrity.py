"""KV integrity on the push path: P digests what each WRITE carries, D checks it.

- D (scheduler, connector/glue/scheduler.py): which receives are checked and why
  (connector/integrity/escalation.py), one decision per request in its registration,
  the same for every rank. D (main, `start_load_kv`): a receive to check asks for a
  digest of this version in its PUSH_REG (`PUSH_REG_KV_DIGEST_KEY`; a stock P ignores
  it, and D then counts the receive `skipped`).
- P (writer, `_xfer_blocks` in push.py, before vLLM posts each WRITE): for a request
  whose PUSH_REG asked (`_digest_wanted`, writer-owned, with the version asked), the digest of the KV this
  WRITE carries (its blocks after vLLM's prefix-cache trim, the heads that D rank
  holds, every layer of this rank) goes in a notification to that D rank's agent, ahead
  of the WRITE. A digest that cannot be computed sends a `skip`; the WRITE goes anyway.
  Another digest version: an older fork decoder asks for version 1 (`true`); this
  prefill answers with a `skip` (`digest_version`), so that receive is counted skipped,
  not checked with a definition it does not compute. An older fork prefill does not
  answer a version-2 ask at all: the decoder counts it skipped as a stock prefill.
- D (writer, from the notification router): each digest into the inbox
  (connector/state/digests.py).
- D (main, after vLLM's step reported the KV landed, before the request's first decode
  step): D's own digest of its blocks against the sum of what P's ranks sent. A
  mismatch is counted, logged at ERROR, put on the receive span and, with
  `kv_verify_action=fail`, fails the receive the way vLLM fails a load (the request's
  blocks reported invalid): `kv_load_failure_policy` then recomputes or fails it.

The check is data path, not telemetry: it runs outside every telemetry guard, and a
check that raises fails the receive like a mismatch would (with `fail`), counted as an
internal error.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from connector.glue.flow import Flow
from connector.integrity.check import (
    Verdict,
    heads_of,
    layer_views,
    verdict,
    write_digest,
)
from connector.integrity.digest import DIGEST_VERSION, Digest, digest
from connector.integrity.policy import VerifyPolicy
from connector.integrity.wire import KvDigestNotif, decode_kv_digest, encode_kv_digest
from connector.state.digests import DigestInbox
from connector.telemetry import errors
from connector.telemetry.tracing import peer_str
from connector.vocabulary import (
    PUSH_REG_KV_DIGEST_KEY,
    REGISTRATION_VERIFY_KEY,
    Attr,
    InternalStep,
    KvVerifyAction,
    KvVerifyOutcome,
    KvVerifyReason,
    KvVerifySkip,
    ReceiveFailure,
    SpanEvent,
    TelemetryError,
)

logger = logging.getLogger(__name__)


class IntegrityFlow(Flow):
    """Mixin for `NixlPushConnectorWorker`: the KV digest and its check."""

    def _init_integrity(self, extra: Any) -> None:
        self._verify = VerifyPolicy.from_config(extra)
        self._kv_views: dict[int, Any] | None = None  # set once at register_kv_caches
        self._local_heads = 0
        self._pp_rank = _pp_rank()
        self._digests = DigestInbox()  # D: writer puts, main takes
        # P (writer-owned): requests whose WRITEs being posted carry a digest -> the
        # digest version their PUSH_REG asked for.
        self._digest_wanted: dict[str, int] = {}
        # D (main-owned): receives to check -> (their kernel block ids, None when not
        # checkable; the prefill engine id; why it is checked).
        self._verify_wanted: dict[str, tuple[list[int] | None, str, KvVerifyReason]] = {}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        views = None if getattr(self, "use_mla", False) else layer_views(kv_caches)
        self._kv_views = views
        self._local_heads = int(next(iter(views.values())).shape[1]) if views else 0
        if self._verify.enabled and views is None:
            logger.warning("KV verification: this model's KV cache layout is not covered by the "
                           "digest (MLA, state-space or unnamed layers); sampled receives count as "
                           "skipped")

    def _sender_rank(self) -> int:
        return self._pp_rank * self.world_size + self.tp_rank

    # ------------------------------------------------------------------ D: asking
    def _digest_asked(self, reg: dict[str, Any]) -> int | None:
        """P: the digest version the PUSH_REG asked for (an older fork asks `true`:
        version 1), or None; P answers unless its own ratio is 0."""
        asked = reg.get(PUSH_REG_KV_DIGEST_KEY)
        if not self._verify.enabled or asked is None or asked is False:
            return None
        if asked is True:
            return 1
        return asked if type(asked) is int and asked > 0 else None

    def _verify_reason(self, req_id: str, reg: dict[str, Any]) -> KvVerifyReason | None:
        """D: why this receive is checked: our scheduler's decision (the same on every
        rank), or the ratio's draw for a registration it did not stage."""
        decided = reg.get(REGISTRATION_VERIFY_KEY)
        if decided is None:
            return KvVerifyReason.SAMPLED if self._verify.sampled(req_id) else None
        if not decided:
            return None
        try:
            return KvVerifyReason(decided)
        except ValueError:  # (not a value our scheduler writes: check it rather than guess)
            return KvVerifyReason.SAMPLED

    def _note_verify_wanted(self, registrations: dict[str, dict[str, Any]]) -> None:
        """D (main, the receives handed over this step, before vLLM queues them for the
        writer): which are checked, and on what; their PUSH_REGs ask for a digest."""
        if not self._verify.enabled:
            return
        for req_id, reg in registrations.items():
            reason = self._verify_reason(req_id, reg)
            if reason is None:
                continue
            reg[PUSH_REG_KV_DIGEST_KEY] = DIGEST_VERSION
            try:
                blocks = self._kernel_blocks(reg.get("local_block_ids"))
            except Exception:
                self._internal_error(InternalStep.KV_DIGEST, f"the blocks of request {req_id} to "
                                     "check (counted skipped)")
                blocks = None
            self._verify_wanted[req_id] = (blocks, str(reg.get("remote_engine_id", "")), reason)

    def _kernel_blocks(self, grouped: Any) -> list[int] | None:
        if not grouped or self._kv_views is None:
            return None
        if isinstance(grouped[0], list | tuple):
            if len(grouped) != 1:
                return None  # (several KV cache groups: not covered)
            grouped = grouped[0]
        kernel = self._logical_to_kernel_block_ids([list(grouped)],
                                                    self._physical_blocks_per_logical_kv_block)
        return list(kernel[0])

    # ------------------------------------------------------------ P: the digest
    def _send_kv_digest(self, read_spec: Any, dst_engine_id: str, remote_request_id: str,
                        version: int) -> None:
        """P (writer, before vLLM posts this WRITE): its digest to the D rank it targets
        (a `skip` when the decoder asked for a version other than ours)."""
        rank = read_spec.remote_rank
        try:
            notif = (self._write_digest(read_spec, dst_engine_id, remote_request_id)
                     if version == DIGEST_VERSION else
                     KvDigestNotif(remote_request_id, self._sender_rank(), skip=KvVerifySkip.VERSION.value,
                                   version=DIGEST_VERSION))
        except Exception:
            self._internal_error(InternalStep.KV_DIGEST, f"the KV digest of request "
                                 f"{peer_str(remote_request_id)}'s WRITE (sent as skipped)")
            notif = KvDigestNotif(remote_request_id, self._sender_rank(), skip=KvVerifySkip.SHAPE.value)
        # (vLLM keeps a remote engine's agents by (pp rank, tp rank); D has one PP stage.)
        agents = [a for key, a in self._connections.targets(dst_engine_id).agents.items()
                  if (key[-1] if isinstance(key, tuple) else key) == rank]
        if len(agents) != 1:
            logger.debug("KV digest of request %s: no single agent of %s rank %s (not checked)",
                         peer_str(remote_request_id), peer_str(dst_engine_id), rank)
            return  # (D counts the receive skipped: incomplete)
        agent = agents[0]
        try:
            self.nixl_wrapper.send_notif(agent, notif_msg=encode_kv_digest(notif))
        except Exception:
            logger.warning("KV digest of request %s to %s could not be sent (its receive is not "
                           "checked)", peer_str(remote_request_id), peer_str(dst_engine_id),
                           exc_info=True)

    def _write_digest(self, read_spec: Any, dst_engine_id: str, remote_request_id: str) -> KvDigestNotif:
        sender = self._sender_rank()
        views = self._kv_views
        info = self.transfer_topo.get_engine_info(dst_engine_id)
        skip = KvDigestNotif(remote_request_id, sender, skip=KvVerifySkip.SHAPE.value)
        if views is None or self.transfer_topo.block_size_ratio(info.remote_block_size) > 1:
            return skip
        local, remote = read_spec.local_block_ids, read_spec.remote_block_ids
        if len(local) != 1:
            return skip  # (several KV cache groups)
        remote, local = self._apply_prefix_caching(
            decode_block_ids=[list(g) for g in remote], prefill_block_ids=[list(g) for g in local],
            decode_physical_per_logical=info.remote_physical_blocks_per_logical,
            prefill_physical_per_logical=self._physical_blocks_per_logical_kv_block)
        blocks = list(local[0])
        p_tp, d_tp = self.world_size, int(info.remote_tp_size)
        total = self._local_heads * p_tp
        if total % d_tp:
            return skip  # (heads replicated across D's ranks)
        own = heads_of(self.tp_rank, self._local_heads)
        carried = own & heads_of(read_spec.remote_rank, total // d_tp)
        if not carried or not blocks:
            return skip
        started = time.perf_counter()
        result = write_digest(views, blocks, own, carried)
        self._count_digest_time(time.perf_counter() - started)
        slots = int(next(iter(views.values())).shape[2])
        return KvDigestNotif(remote_request_id, sender, list(result.layers), list(result.values),
                             tokens=len(blocks) * slots, writers=max(1, p_tp // d_tp),
                             version=DIGEST_VERSION)

    # ------------------------------------------------------------- D: the check
    def _kv_digest_from(self, agent: Any, message: bytes) -> None:
        """D (writer, from the router): a P rank's digest, kept for the check. A
        malformed one is logged and dropped (its receive is then not checked)."""
        try:
            notif = decode_kv_digest(message)
        except ValueError as exc:
            logger.warning("Dropped a KV digest notification from NIXL agent %r: %s", agent, exc)
            return
        self._digests.put(notif.request_id, notif.sender, notif, self._connections.engine_of(agent))

    def _verify_landed(self, results: Any) -> dict[str, ReceiveFailure]:
        """D (main, after vLLM's step): check each sampled receive whose KV landed;
        returns those it failed, with why."""
        wanted = self._verify_wanted
        mismatched: dict[str, ReceiveFailure] = {}
        if not wanted:
            return mismatched
        failed = results.failed_recving
        for req_id in results.finished_recving:
            if req_id not in wanted:
                continue
            blocks, prefill, reason = wanted.pop(req_id)
            if req_id in failed:
                self._digests.forget((req_id,))
                continue
            try:
                outcome = self._check(req_id, blocks, prefill)
            except Exception:
                self._internal_error(InternalStep.KV_DIGEST, f"checking request {req_id}'s KV "
                                     "(failed, as a mismatch would be, with kv_verify_action=fail)")
                outcome = Verdict(KvVerifyOutcome.MISMATCH)
            if outcome.fails and self._verify.action is KvVerifyAction.FAIL:
                failed.add(req_id)
                mismatched[req_id] = (ReceiveFailure.KV_MISMATCH
                                      if outcome.outcome is KvVerifyOutcome.MISMATCH
                                      else ReceiveFailure.KV_UNVERIFIED)
                if blocks:
                    self._invalid_block_ids.put(set(blocks))
            if outcome.outcome is KvVerifyOutcome.MISMATCH and prefill:
                # (to the scheduler, for its escalation rules: data, not telemetry)
                self.xfer_stats.record_kv_mismatch_from(prefill)
            self._observe_verdict(req_id, prefill, blocks, outcome, reason)
        return mismatched

    def _check(self, req_id: str, blocks: list[int] | None, prefill: str) -> Verdict:
        received = self._digests.take(req_id)
        views = self._kv_views
        if blocks is None or views is None:
            return Verdict(KvVerifyOutcome.SKIPPED, KvVerifySkip.SHAPE)
        if not received:  # (nothing to compare: no digest of D's own is computed)
            return verdict(Digest((), ()), received, prefill_sends=self._digests.sends_digests(prefill))
        tokens = {n.tokens for n in received if not n.skip}
        slots = int(next(iter(views.values())).shape[2])
        if len(tokens) > 1 or (tokens and next(iter(tokens)) % slots):
            return Verdict(KvVerifyOutcome.SKIPPED, KvVerifySkip.SHAPE)
        count = next(iter(tokens)) // slots if tokens else len(blocks)
        if count > len(blocks):
            return Verdict(KvVerifyOutcome.SKIPPED, KvVerifySkip.SHAPE)
        started = time.perf_counter()
        own = digest(list(views.items()), blocks[len(blocks) - count:],
                     head0=self.tp_rank * self._local_heads)
        self._count_digest_time(time.perf_counter() - started)
        return verdict(own, received)

    # ------------------------------------------------------------ telemetry
    def _count_digest_time(self, seconds: float) -> None:
        try:
            self.xfer_stats.record_kv_digest(seconds)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    def _observe_verdict(self, req_id: str, prefill: str, blocks: list[int] | None,
                         outcome: Verdict, reason: KvVerifyReason) -> None:
        if outcome.outcome is KvVerifyOutcome.MISMATCH:
            logger.error("KV integrity: request %s decodes from KV that is not what its prefill %s "
                         "sent: layers %s differ over blocks %s (%s)", req_id,
                         peer_str(prefill), list(outcome.layers) or "(check failed)",
                         _block_range(blocks), "failed: kv_load_failure_policy decides"
                         if self._verify.action is KvVerifyAction.FAIL else "kv_verify_action=observe: "
                         "decoding anyway")
        elif outcome.fails:
            logger.warning("KV integrity: request %s could not be checked: the digest of prefill %s "
                           "was lost (%s)%s", req_id, peer_str(prefill), outcome.skipped_because.value,
                           "; failed, kv_load_failure_policy decides"
                           if self._verify.action is KvVerifyAction.FAIL else "")
        elif outcome.outcome is KvVerifyOutcome.SKIPPED:
            logger.debug("KV integrity: request %s not checked (%s)", req_id,
                         outcome.skipped_because.value if outcome.skipped_because else "")
        try:
            self.xfer_stats.record_kv_verify(outcome.outcome.value, reason.value)
            span = self._receive_spans.get(req_id) if self._spans.enabled else None
            if span is not None and span.is_recording():
                span.set_attribute(Attr.KV_VERIFY, outcome.outcome.value)
                span.set_attribute(Attr.KV_VERIFY_REASON, reason.value)
                if outcome.skipped_because is not None:
                    span.set_attribute(Attr.KV_VERIFY_SKIPPED, outcome.skipped_because.value)
                if outcome.outcome is KvVerifyOutcome.MISMATCH:
                    span.add_event(SpanEvent.KV_MISMATCH, {Attr.KV_VERIFY_LAYERS: list(outcome.layers),
                                                           Attr.KV_VERIFY_BLOCKS: _block_range(blocks)})
        except Exception as exc:
            errors.note(TelemetryError.SPAN, exc)


def _block_range(blocks: list[int] | None) -> str:
    if not blocks:
        return "?"
    return f"{blocks[0]}..{blocks[-1]} ({len(blocks)} blocks)"


def _pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except Exception:
        return 0

