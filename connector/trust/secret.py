"""The deployment's secret: keys read from a file, re-read when the file changes.

The file holds one key per line (blank lines and `#` comments ignored), each at least
MIN_KEY_BYTES long. The first line signs; every line verifies, and so does, for
`previous_s` after the file changed, every key the new file no longer holds. That makes
both rotations work without dropping a request:
- two steps (add the new key as a second line, wait until every pod has it, then move
  it first; later drop the old line): no peer ever sees a key it does not accept;
- one step (replace the key): peers that already read the new file accept the old key
  for `previous_s`, and a peer whose proof fails reads the file again at once (on one
  host, or once the mount updated, it then has the new key too).

Thread safety: any thread signs and verifies; the state (keys, previous keys, the
file's stamp) changes under one lock, and HMACs are computed outside it over a
snapshot of the keys.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

MIN_KEY_BYTES = 16
CHECK_EVERY_S = 1.0  # how often the file's stamp is looked at (a stat), at most


class SecretFileError(ValueError):
    """The secret file cannot be used (missing, empty, a key too short)."""


def read_keys(path: Path) -> tuple[bytes, ...]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SecretFileError(f"cannot read the secret file {path}: {exc.strerror or exc}") from None
    keys = tuple(line.strip() for line in raw.splitlines())
    keys = tuple(k for k in keys if k and not k.startswith(b"#"))
    if not keys:
        raise SecretFileError(f"the secret file {path} holds no key")
    short = [i + 1 for i, k in enumerate(keys) if len(k) < MIN_KEY_BYTES]
    if short:
        raise SecretFileError(f"the secret file {path}: key(s) {short} shorter than {MIN_KEY_BYTES} bytes "
                              "(use e.g. `openssl rand -hex 32`)")
    return keys


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)  # (follows a Kubernetes Secret mount's symlink swap)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def mac(key: bytes, parts: tuple[bytes, ...]) -> bytes:
    """HMAC-SHA256 over length-prefixed parts (no two part lists share an input)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.digest()


def load_secret(get: Callable[..., object]) -> PeerSecret | None:
    """The secret the extra config names (`side_channel_secret_file`), or None (no
    authentication: behaviour and wire format are vLLM's). Raises SecretFileError or
    ValueError for a file or window that cannot be used."""
    from connector import settings

    path = get(settings.SIDE_CHANNEL_SECRET_FILE.key, settings.SIDE_CHANNEL_SECRET_FILE.default)
    if path is None or path == "":
        return None
    if not isinstance(path, str):
        raise ValueError(f"{settings.SIDE_CHANNEL_SECRET_FILE.key} must be a file path, got {path!r}")
    window = get(settings.SIDE_CHANNEL_SECRET_PREVIOUS_S.key, settings.SIDE_CHANNEL_SECRET_PREVIOUS_S.default)
    if isinstance(window, bool) or not isinstance(window, int | float) or not 0 <= window < float("inf"):
        raise ValueError(f"{settings.SIDE_CHANNEL_SECRET_PREVIOUS_S.key} must be a number of seconds >= 0, "
                         f"got {window!r}")
    return PeerSecret(path, float(window))


class PeerSecret:
    """See module docstring."""

    def __init__(self, path: str | Path, previous_s: float, clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.previous_s = float(previous_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._keys = read_keys(self.path)
        self._stamp = _stamp(self.path)
        self._checked_at = clock()
        self._previous: dict[bytes, float] = {}  # key -> accepted until

    def sign(self, *parts: bytes) -> bytes:
        self.refresh()
        return mac(self._keys[0], parts)

    def verify(self, tag: bytes, *parts: bytes) -> bool:
        """Whether `tag` is the MAC of `parts` under a key accepted now. A miss reads the
        file again at once (a rotation this process has not seen yet) and tries again."""
        if self._matches(tag, parts):
            return True
        return self.refresh(force=True) and self._matches(tag, parts)

    def _matches(self, tag: bytes, parts: tuple[bytes, ...]) -> bool:
        return any(hmac.compare_digest(mac(key, parts), tag) for key in self.accepted())

    def accepted(self) -> tuple[bytes, ...]:
        self.refresh()
        now = self._clock()
        with self._lock:
            if self._previous:
                self._previous = {k: until for k, until in self._previous.items() if until > now}
            return self._keys + tuple(self._previous)

    def refresh(self, force: bool = False) -> bool:
        """Read the file again if it changed (looked at once a second, or now with `force`);
        returns whether the keys changed."""
        now = self._clock()
        with self._lock:
            if not force and now - self._checked_at < CHECK_EVERY_S:
                return False
            self._checked_at = now
            stamp = _stamp(self.path)
            if stamp is None or stamp == self._stamp:
                return False
        try:
            keys = read_keys(self.path)
        except SecretFileError as exc:  # (half-written, or gone during a swap: keep the keys)
            logger.warning("Keeping the current side-channel keys: %s", exc)
            return False
        with self._lock:
            if stamp == self._stamp:
                return False
            old = [k for k in self._keys if k not in keys]
            self._previous.update(dict.fromkeys(old, now + self.previous_s))
            for key in keys:
                self._previous.pop(key, None)
            self._keys, self._stamp = keys, stamp
        logger.info("Side-channel secret file %s changed: %d key(s) now, the %d it dropped still "
                       "accepted for %.0f s", self.path, len(keys), len(old), self.previous_s)
        return True
