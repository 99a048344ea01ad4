"""Fork-to-fork authentication with a shared secret (`side_channel_secret_file`), opt-in.

- `secret.py`: the keys, read from a file and re-read when it changes (rotation);
- `proofs.py`: what crosses the wire: the side channel's challenge and answer, and the
  MAC that wraps every NIXL notification between fork peers;
- `refusals.py`: peers refused, counted process-wide and logged once per peer.

The glue uses them in the side-channel listener (connector/glue/auth_listener.py), its
client (connector/glue/side_channel.py) and the notification router
(connector/glue/notifications.py). Nothing here imports vLLM.
"""
