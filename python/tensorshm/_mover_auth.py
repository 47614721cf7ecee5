"""tensorshm.transfer's credentials: how two movers prove to each other that they belong to one
fleet, on every call and every answer, and never by sending the secret.

Two kinds, alone or together:

- **A fleet token** (``token_file``): a secret in a file only the mover's uid can read. Every call
  carries a proof, ``v1.<unix ms>.<nonce>.<HMAC>``: an HMAC-SHA256 under the token over the
  method, the mover it is meant for (the address the caller dialed, or a Ray mover's actor
  name), the time, a fresh 128-bit nonce and the SHA-256 of the request's bytes. The serving
  mover takes a proof only if it names this mover, only once (it keeps the nonces it saw for the
  time window) and only within ``WINDOW_SECONDS`` of its own clock, and answers with a proof over
  the caller's nonce and the reply's bytes, which the caller checks before it uses a byte of the
  reply. A proof meant for one mover is worthless at another, so a relay cannot turn a call to A
  into a call to B. A listener on the
  wire (or a process that took a mover's port) sees proofs it cannot replay, cannot forge an
  answer, and learns nothing that lets it act as a mover; it does see the messages, so the token
  gives integrity, not secrecy: use TLS for that.
- **mTLS** (``tls_cert``, ``tls_key``, ``tls_ca``): gRPC's own credentials; both sides present a
  certificate signed by the fleet's CA and verify the other's.

A mover with neither refuses to start unless told ``insecure``, which it logs at every start.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import _errors

# How far a call's time may be from the serving mover's clock (movers' clocks must agree within
# it: NTP) and how long a nonce is remembered.
WINDOW_SECONDS = 60.0
# The nonces remembered at most; past it calls are refused until older ones age out (a flood of
# valid proofs can only come from a holder of the token).
_MAX_NONCES = 1 << 20
_MIN_TOKEN_BYTES = 16
PROOF_KEY = "tsm-proof"  # the gRPC metadata key of a call's and of an answer's proof
_DIGITS = re.compile(r"[0-9]{1,15}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")

_log = logging.getLogger("tensorshm.transfer")


def _private_file(path: str, what: str) -> bytes:
    """The bytes of `path`, which must be a regular file of this process's uid that no group or
    other user can read or write: FailedPreconditionError naming it otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise _errors.FailedPreconditionError(f"{what} = \"{path}\": cannot open it: {e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _errors.FailedPreconditionError(f"{what} = \"{path}\": not a regular file")
        if info.st_uid != os.geteuid():
            raise _errors.FailedPreconditionError(
                f"{what} = \"{path}\": owned by uid {info.st_uid}, not by this mover's uid "
                f"{os.geteuid()}")
        if info.st_mode & 0o077:
            raise _errors.FailedPreconditionError(
                f"{what} = \"{path}\": mode {stat.S_IMODE(info.st_mode):04o} lets its group or "
                "others read or write it; the mover's uid alone may (chmod 600)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


class Token:
    """A fleet token: makes and checks the proofs of calls and answers (see the module doc).
    Thread-safe."""

    def __init__(self, secret: bytes) -> None:
        self._key = hashlib.sha256(b"tensorshm-mover-token\0" + secret).digest()
        self._seen: dict[bytes, int] = {}  # nonce -> its proof's time (ms)
        self._floor_ms = 0  # proofs older than this are refused (see check_call)
        self._next_prune = 1024
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str) -> Token:
        secret = _private_file(path, "token_file").strip()
        if len(secret) < _MIN_TOKEN_BYTES:
            raise _errors.FailedPreconditionError(
                f"token_file = \"{path}\": {len(secret)} bytes; a fleet token has at least "
                f"{_MIN_TOKEN_BYTES} (e.g. head -c 32 /dev/urandom | base64 > FILE)")
        return cls(secret)

    def _mac(self, label: bytes, method: str, when: bytes, nonce: bytes, body: bytes,
             target: str = "") -> str:
        # Fields of fixed form (the time is digits, the nonce 16 bytes, the hash 32) around
        # the free ones, each of which is NUL-free: the message splits one way only.
        message = b"\0".join((label, method.encode(), target.encode(), when, nonce,
                              hashlib.sha256(body).digest()))
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def sign_call(self, method: str, request: bytes, target: str) -> tuple[str, bytes]:
        """(proof, nonce) for one call to the mover `target` (the address dialed, or a Ray
        mover's actor name); check its answer with the nonce."""
        nonce = secrets.token_bytes(16)
        when = str(int(time.time() * 1000)).encode()
        mac = self._mac(b"call", method, when, nonce, request, target)
        return f"v1.{when.decode()}.{nonce.hex()}.{mac}", nonce

    def check_call(self, method: str, request: bytes, proof: str | None,
                   targets: tuple[str, ...]) -> bytes:
        """The call's nonce, for the answer's proof: UnauthenticatedError when `proof` is absent,
        malformed, stale, seen before, made for another mover (one not named in `targets`, the
        names this mover answers to) or not made with this token."""
        if not proof:
            raise _errors.UnauthenticatedError(
                f"{method}: no proof of the fleet token (a mover with --token-file sends one)")
        parts = proof.split(".")
        if (len(parts) != 4 or parts[0] != "v1" or not _DIGITS.fullmatch(parts[1])
                or not _HEX32.fullmatch(parts[2]) or not _HEX64.fullmatch(parts[3])):
            raise _errors.UnauthenticatedError(f"{method}: a malformed proof")
        when_ms, nonce = int(parts[1]), bytes.fromhex(parts[2])
        skew = abs(time.time() - when_ms / 1000.0)
        if skew > WINDOW_SECONDS:
            raise _errors.UnauthenticatedError(
                f"{method}: a proof made {skew:.0f} s away from this mover's clock (at most "
                f"{WINDOW_SECONDS:.0f}: are the nodes' clocks synchronised?)")
        target = next((t for t in targets if hmac.compare_digest(
            self._mac(b"call", method, parts[1].encode(), nonce, request, t), parts[3])), None)
        if target is None:
            raise _errors.UnauthenticatedError(
                f"{method}: the proof was not made with this mover's fleet token, or for "
                f"another mover (this one answers to {', '.join(targets)})")
        with self._lock:
            # Replays: a nonce is refused while it is remembered, and a proof older than the
            # newest taken less the window is refused outright, so a nonce can be forgotten
            # once its time is below that floor, whatever the clock does meanwhile.
            if when_ms < self._floor_ms:
                raise _errors.UnauthenticatedError(f"{method}: a stale proof (a replay?)")
            if nonce in self._seen:
                raise _errors.UnauthenticatedError(f"{method}: a proof used before (a replay)")
            if len(self._seen) >= self._next_prune:
                self._seen = {n: t for n, t in self._seen.items() if t >= self._floor_ms}
                self._next_prune = max(2 * len(self._seen), 1024)
            if len(self._seen) >= _MAX_NONCES:
                raise _errors.ResourceExhaustedError(
                    f"{method}: {_MAX_NONCES} proofs within {2 * WINDOW_SECONDS:.0f} s")
            self._seen[nonce] = when_ms
            self._floor_ms = max(self._floor_ms, when_ms - int(2 * WINDOW_SECONDS * 1000))
        return nonce

    def sign_chunk(self, method: str, nonce: bytes, where: str, data: bytes) -> str:
        """The proof of one chunk of a streamed call (`where`: its transfer and offset), bound
        to the call's nonce: chunks cannot be replayed into, or moved within, another call."""
        return self._mac(b"chunk", method, where.encode(), nonce, data)

    def check_chunk(self, method: str, nonce: bytes, where: str, data: bytes,
                    proof: str, peer: str) -> None:
        if not (_HEX64.fullmatch(proof)
                and hmac.compare_digest(self.sign_chunk(method, nonce, where, data), proof)):
            raise _errors.UnauthenticatedError(
                f"{method} at {peer}: the chunk at {where} was not made with the fleet token")

    def sign_reply(self, method: str, nonce: bytes, reply: bytes) -> str:
        return self._mac(b"reply", method, b"", nonce, reply)

    def check_reply(self, method: str, nonce: bytes, reply: bytes, proof: str | None,
                    peer: str) -> None:
        """UnauthenticatedError unless `proof` proves `reply` answers the call of `nonce`."""
        expected = self.sign_reply(method, nonce, reply)
        if not proof or not _HEX64.fullmatch(proof) or not hmac.compare_digest(expected, proof):
            raise _errors.UnauthenticatedError(
                f"{method} at mover {peer}: its answer "
                + ("carries no proof" if not proof else "was not made with the fleet token")
                + " (is it a mover of this fleet?)")


@dataclass(frozen=True)
class Credentials:
    """What a mover proves and asks for: a fleet token, mTLS files, both, or (``insecure``)
    nothing."""

    token: Token | None = None
    tls: tuple[bytes, bytes, bytes] | None = None  # (certificate chain, private key, CA)
    insecure: bool = False

    @classmethod
    def load(cls, *, token_file: str | None = None, tls_cert: str | None = None,
             tls_key: str | None = None, tls_ca: str | None = None,
             insecure: bool = False, what: str = "Mover") -> Credentials:
        """Reads and checks the files; FailedPreconditionError naming a file that is missing,
        readable by others or too short, InvalidArgumentError for an incomplete TLS triple, and
        FailedPreconditionError when nothing is given and not `insecure`."""
        token = Token.from_file(token_file) if token_file else None
        tls = None
        given = {"tls_cert": tls_cert, "tls_key": tls_key, "tls_ca": tls_ca}
        if any(given.values()):
            missing = [k for k, v in given.items() if not v]
            if missing:
                raise _errors.InvalidArgumentError(
                    f"{', '.join(missing)}: mTLS needs tls_cert, tls_key and tls_ca together")
            assert tls_cert and tls_key and tls_ca
            with open(tls_cert, "rb") as f:
                cert = f.read()
            with open(tls_ca, "rb") as f:
                ca = f.read()
            tls = (cert, _private_file(tls_key, "tls_key"), ca)
        if token is None and tls is None:
            if not insecure:
                raise _errors.FailedPreconditionError(
                    f"{what}: no credentials: give token_file (--token-file, a fleet secret "
                    "readable by this uid alone) and/or tls_cert, tls_key and tls_ca (--tls-*); "
                    "insecure=True (--insecure) lets any process that reaches the port ship "
                    "this node's tensors")
            _log.warning(
                "%s: INSECURE: no token and no TLS: any process that reaches this mover can "
                "list, read and overwrite this node's tensors through it", what)
        return cls(token, tls, insecure and token is None and tls is None)

    def server_credentials(self, grpc: Any) -> Any:
        """gRPC server credentials for mTLS (the client must present a certificate of the CA),
        None without TLS."""
        if self.tls is None:
            return None
        cert, key, ca = self.tls
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self, grpc: Any) -> Any:
        if self.tls is None:
            return None
        cert, key, ca = self.tls
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)
