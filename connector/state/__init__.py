"""The push state and its owners: one object per kind of state, one lock each.

- `leases.LeaseLedger` (P): KV leases, the PUSH_REG that claims each, its WRITEs, and
  the PUSH_FAILs owed to decoders.
- `receives.ReceiveLedger` (D): each receive from its registration until its KV landed
  or it failed, and when a given-up receive's blocks are safe to free.
- `connections.ConnectionTable` (both): each remote engine and this worker's connection
  to it: agents, flavor, the handshake being made, drop state, last contact, suspects,
  and the work parked for its next connection. Its lock is vLLM's `_handshake_lock`, and
  it writes vLLM's maps of the remote engines itself.

Every thread (the engine's main thread, vLLM's writer, the handshake pool, the retry
timers) changes this state only through these objects' methods, which take the object's
lock, decide, and return what the caller must do; none calls into vLLM, NIXL or
another of these objects while holding its lock. Where vLLM's own maps are changed,
and by which thread, is the table in docs/architecture.md ("vLLM's maps").
Nothing here imports vLLM: the rules are tested on their own (tests/test_push_state.py).
"""


def agent_name(agent: object) -> str:
    """One spelling of a NIXL agent name: vLLM keeps them as bytes in `_remote_agents`,
    NIXL hands them back as str with received notifications."""
    return agent.decode("utf-8", "replace") if isinstance(agent, bytes | bytearray) else str(agent)
