"""KV integrity: a digest of the KV a push carries, computed on the KV's own device.

- `digest`: the digest of a run of blocks per layer, and the layers where two differ.

Not yet wired into the push: P's digest notification, D's check before it releases a
request, the policy and the telemetry are the rest of that work (docs/reliability.md).
"""
