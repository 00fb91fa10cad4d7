"""The relay's handshake: a sandbox host's relay and a session's gateway prove to each other that
they hold the session's relay key before a byte of a request crosses (issue 32, item 4).

The gateway's relay listener is on the worker node's routable address, where anyone on the
cluster network can connect; a connection that has not answered the challenge is never read
past its 64-byte answer. The key is derived from the session's credential (so it is the
session's, and one session's key opens no other's), and never crosses the wire: each side sends
an HMAC-SHA256 over both sides' fresh nonces.

    gateway -> relay:   MAGIC + nonce_g                      (46 bytes)
    relay   -> gateway: nonce_r + HMAC(key, "relay" + nonce_g + nonce_r)     (64 bytes)
    gateway -> relay:   HMAC(key, "gateway" + nonce_g + nonce_r)             (32 bytes)

then HTTP, piped as is. Either side closes on a wrong proof."""
from __future__ import annotations

import hashlib
import hmac
import secrets

MAGIC = b"PRORL-RELAY/1\n"
NONCE = 32
MAC = 32
CHALLENGE = len(MAGIC) + NONCE
ANSWER = NONCE + MAC
PROOF = MAC


def relay_key(token: str) -> str:
    """The session's relay key (hex) from its credential: what the worker gives the host."""
    return hmac.new(token.encode(), b"prorl-celery relay key", hashlib.sha256).hexdigest()


def _mac(key: bytes, role: bytes, nonce_g: bytes, nonce_r: bytes) -> bytes:
    return hmac.new(key, role + nonce_g + nonce_r, hashlib.sha256).digest()


def challenge() -> tuple[bytes, bytes]:
    """The gateway's opening: (bytes to send, its nonce)."""
    nonce = secrets.token_bytes(NONCE)
    return MAGIC + nonce, nonce


def check_answer(key: bytes, nonce_g: bytes, answer: bytes) -> bytes | None:
    """The gateway's check of the relay's 64 bytes: its proof to send back, or None (refused)."""
    if len(answer) != ANSWER:
        return None
    nonce_r, mac = answer[:NONCE], answer[NONCE:]
    if not hmac.compare_digest(mac, _mac(key, b"relay", nonce_g, nonce_r)):
        return None
    return _mac(key, b"gateway", nonce_g, nonce_r)


def answer(key: bytes, opening: bytes) -> tuple[bytes, bytes] | None:
    """The relay's answer to the gateway's opening: (bytes to send, the proof the gateway must
    send back), or None when the opening is not a gateway's."""
    if len(opening) != CHALLENGE or not opening.startswith(MAGIC):
        return None
    nonce_g, nonce_r = opening[len(MAGIC):], secrets.token_bytes(NONCE)
    return nonce_r + _mac(key, b"relay", nonce_g, nonce_r), _mac(key, b"gateway", nonce_g, nonce_r)
