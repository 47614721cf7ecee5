"""``python -m tensorshm.transfer``: a node's mover as a process (tensorshm.transfer.Mover with
the command line's flags)."""

from __future__ import annotations

import sys
import threading

from . import _errors
from .transfer import _TRANSPORTS, Mover


def _size(text: str) -> int:
    """Bytes from "4Gi", "512Mi", "1000000"."""
    units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    number = text.rstrip("KMGTi")
    unit = text[len(number):]
    if not number.isdigit() or unit not in units:
        raise ValueError(f"{text!r}: a size such as 4Gi or 512Mi")
    return int(number) * units[unit]


def main(argv: list[str] | None = None) -> int:
    """``python -m tensorshm.transfer --socket SOCKET --listen HOST:PORT --token-file PATH``: a
    node's mover, serving until SIGTERM or SIGINT; prints its address once it serves."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m tensorshm.transfer", description=main.__doc__)
    parser.add_argument("--socket", help="this node's tensorshmd (default: as tensorshm.connect())")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to serve movers on")
    parser.add_argument("--advertise", action="append",
                        help="HOST:PORT peers dial this mover by, besides --listen's (repeatable; "
                        "needed for a wildcard --listen): their proofs name it")
    parser.add_argument("--token-file", help="the fleet secret: a file of this uid that no "
                        "group or other user can read; every call and answer proves it")
    parser.add_argument("--tls-cert", help="mTLS: this mover's certificate chain (PEM)")
    parser.add_argument("--tls-key", help="mTLS: its private key (PEM, mode 0600)")
    parser.add_argument("--tls-ca", help="mTLS: the CA that signs every mover's certificate")
    parser.add_argument("--insecure", action="store_true",
                        help="serve with no credentials: any process that reaches the port can "
                        "list, read and overwrite this node's tensors (logged at every start)")
    parser.add_argument("--hold-seconds", type=float, default=60.0,
                        help="the longest a peer's lease or buffer is held (default 60)")
    parser.add_argument("--offer-prefix", action="append", dest="offer_prefixes",
                        help="offer only names under this prefix (repeatable; default: all)")
    parser.add_argument("--accept-prefix", action="append", dest="accept_prefixes",
                        help="accept only names under this prefix (repeatable; default: all)")
    parser.add_argument("--peer-quota", type=_size, default=4 << 30,
                        help="the most bytes one peer may have prepared here (default 4Gi)")
    parser.add_argument("--transport", choices=_TRANSPORTS, default="auto",
                        help="auto: NIXL where both movers can, else chunks over gRPC")
    parser.add_argument("--allow-tcp-rma", action="store_true",
                        help="let NIXL use UCX's TCP transport. DANGER: its software RDMA lets "
                        "ANY peer that reaches its port (it listens on every interface) read "
                        "and write this mover process's memory, whatever it registered")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        mover = Mover(args.socket, listen=args.listen, hold_seconds=args.hold_seconds,
                      token_file=args.token_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
                      tls_ca=args.tls_ca, insecure=args.insecure, transport=args.transport,
                      allow_tcp_rma=args.allow_tcp_rma,
                      offer_prefixes=args.offer_prefixes or ("",),
                      accept_prefixes=args.accept_prefixes or ("",),
                      peer_quota_bytes=args.peer_quota, advertise=args.advertise or ())
    except _errors.Error as e:  # a flag, a file or the daemon: said in one line
        print(f"python -m tensorshm.transfer: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    with mover:
        print(f"mover {mover.name} serving on {mover.address}", flush=True)
        stop.wait()
    return 0
