"""KV integrity: a digest of the KV a push carries, computed on the KV's own device, and
D's check of it (docs/reliability.md, "KV integrity").

- `digest`: the digest of a run of blocks per layer (version 2: each KV byte read once).
- `check`: what P digests for one WRITE, and D's verdict from what P's ranks sent.
- `policy`: the settings; `escalation`: which receives D's scheduler checks, and why.
- `wire`: the digest notification, checked at the edge.
The push path's use of them: connector/glue/integrity.py.
"""
