"""The movers trust nobody they have not checked (issue 35): every call and every answer proves
the fleet token or mTLS; a peer's holds, sizes, names and devices are bounded by the receiving
mover; nothing a peer sends is unpickled; the bytes go over transports the kernel checks or the
authenticated channel; a mover listens on no port but its gRPC one."""

from __future__ import annotations

import json
import math
import os
import pathlib
import pickle
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

import tensorshm
from conftest import ROOT, TOKEN_FILE, Node, wait_for, write_secret
from tensorshm._mover_auth import PROOF_KEY, Token
from tensorshm._mover_service import SERVICE, messages
from test_ship import consume, nothing_held, publish

M = messages()
NOBODY = 65534
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def token(path: str = TOKEN_FILE) -> Token:
    return Token.from_file(path)


def call(address: str, method: str, request, *, proof_token: Token | None = None,
         proof: str | None = None, credentials=None):
    """One raw Mover call from this process: (status code, reply or details, answer proof)."""
    data = request.SerializeToString() if hasattr(request, "SerializeToString") else request
    if proof_token is not None:
        proof, _ = proof_token.sign_call(method, data, address)
    channel = (grpc.secure_channel(address, credentials) if credentials is not None
               else grpc.insecure_channel(address))
    with channel:
        stub = channel.unary_unary(f"/{SERVICE}/{method}")
        try:
            reply, c = stub.with_call(data, timeout=10,
                                      metadata=((PROOF_KEY, proof),) if proof else None)
        except grpc.RpcError as e:
            return e.code(), e.details(), None
    reply_type = {"Offer": "OfferReply", "Prepare": "PrepareReply", "Finish": "FinishReply",
                  "List": "ListReply", "Read": "ReadReply", "Write": "WriteReply"}[method]
    return grpc.StatusCode.OK, M[reply_type].FromString(reply), dict(c.trailing_metadata())


LAYOUT = M["TensorLayout"](dtype="uint8", shape=[1 << 20], device="cpu", nbytes=1 << 20)


def every_call() -> list[tuple[str, object]]:
    return [("Offer", M["OfferRequest"](name="secret/api-key", hold_seconds=1e300, nixl=True)),
            ("Prepare", M["PrepareRequest"](name="secret/api-key", layout=LAYOUT, replace=True,
                                            hold_seconds=1e300)),
            ("List", M["ListRequest"](prefix="")),
            ("Finish", M["FinishRequest"](transfer_id="00" * 16, commit=True)),
            ("Read", M["ReadRequest"](transfer_id="00" * 16, offset=0, length=16)),
            ("Write", M["WriteRequest"](transfer_id="00" * 16, offset=0, data=b"x" * 16))]


# Run as uid 65534 (setpriv), which may not even reach the daemon's socket: every Mover call, with
# no proof and with a proof of another fleet's token, then a proof a mover sent before (a replay).
NOBODY_SCRIPT = """
import json, sys, grpc
from tensorshm._mover_auth import PROOF_KEY, Token
address, calls, replayed = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
other = Token(b"a token of another fleet, 32 bytes")
answers = []
def send(method, data, proof):
    with grpc.insecure_channel(address) as channel:
        stub = channel.unary_unary(f"/tensorshm.v1.Mover/{method}")
        try:
            stub(data, timeout=10, metadata=((PROOF_KEY, proof),) if proof else None)
            return "OK", ""
        except grpc.RpcError as e:
            return e.code().name, e.details()
for method, request in calls:
    data = bytes.fromhex(request)
    for how, proof in (("none", None), ("other", other.sign_call(method, data, address)[0])):
        answers.append([method, how, *send(method, data, proof)])
answers.append(["List", "replay", *send("List", bytes.fromhex(replayed["request"]),
                                        replayed["proof"])])
print(json.dumps(answers))
"""


def test_unauthenticated_calls_touch_nothing(daemons):
    a, _ = daemons
    node_a = Node(a.socket)
    try:
        with tensorshm.connect(a.socket) as ca:
            ca.put("secret/api-key", np.frombuffer(b"hunter2" * 100, dtype=np.uint8)).release()
            before = ca.stat()
            # A mover's own call, seen on the wire: its proof and bytes, to replay.
            request = M["ListRequest"](prefix="").SerializeToString()
            proof, _ = token().sign_call("List", request, node_a.address)
            code, reply, _ = call(node_a.address, "List", request, proof=proof)
            assert code == grpc.StatusCode.OK and list(reply.names) == ["secret/api-key"]
            run = subprocess.run(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                 sys.executable, "-c", NOBODY_SCRIPT, node_a.address,
                 json.dumps([[m, r.SerializeToString().hex()] for m, r in every_call()]),
                 json.dumps({"request": request.hex(), "proof": proof})],
                capture_output=True, text=True, timeout=120, cwd="/")
            assert run.returncode == 0, run.stderr
            answers = json.loads(run.stdout)
            assert len(answers) == 13
            for method, how, code_name, details in answers:
                print(f"uid {NOBODY}, {method}, proof {how}: {code_name}: {details}")
                assert code_name == "UNAUTHENTICATED", (method, how, details)
                assert "secret" not in details and "hunter2" not in details
            assert "a replay" in answers[-1][3]
            after = ca.stat()
            assert (after["leases"], after["tensors"], after["names"]) == \
                (before["leases"], before["tensors"], before["names"])
            assert after["pools"][0]["used_bytes"] == before["pools"][0]["used_bytes"]
            assert np.from_dlpack(ca.get("secret/api-key")).tobytes() == b"hunter2" * 100
            assert node_a.state() == {"holds": 0, "registrations": 0, "nixl": True}
    finally:
        node_a.stop()


class FakeMover:
    """A gRPC server in this process answering Mover calls with `answer(method, request)`
    (reply bytes), signed with `signer` (None: no proof)."""

    def __init__(self, answer, signer: Token | None) -> None:
        self.calls: list[str] = []

        def handler(method: str):
            def handle(request: bytes, context) -> bytes:
                self.calls.append(method)
                reply = answer(method, request)
                if signer is not None:
                    proof = dict(context.invocation_metadata())[PROOF_KEY]
                    nonce = bytes.fromhex(proof.split(".")[2])
                    context.set_trailing_metadata(
                        ((PROOF_KEY, signer.sign_reply(method, nonce, reply)),))
                return reply
            return grpc.unary_unary_rpc_method_handler(handle)

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {m: handler(m) for m in ("Offer", "Prepare", "Finish", "List", "Read",
                                              "Write")}),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    length, varint = len(payload), b""
    while True:
        byte = length & 0x7F
        length >>= 7
        varint += bytes([byte | (0x80 if length else 0)])
        if not length:
            return bytes([number << 3 | 2]) + varint + payload


class _CreatesAFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def offer_with_pickle(path: str) -> bytes:
    """An OfferReply whose source endpoint carries, in the field where a pickled NIXL descriptor
    list once was, a pickle that creates `path` when loaded."""
    endpoint = (M["Endpoint"](agent_name="fake-agent", agent_metadata=b"not metadata")
                .SerializeToString() + _field(3, pickle.dumps(_CreatesAFile(path))))
    reply = M["OfferReply"](transfer_id="ab" * 16, layout=LAYOUT).SerializeToString()
    return reply + _field(3, endpoint)


@pytest.mark.parametrize("signed", [False, True], ids=["impostor", "fleet-member"])
def test_a_peer_answering_with_a_pickle_is_refused_and_nothing_runs(daemons, nodes, tmp_path,
                                                                    signed):
    (_, b), (_, node_b) = daemons, nodes
    marker = tmp_path / "pwned"
    prepare = (M["PrepareReply"](transfer_id="cd" * 16).SerializeToString()
               + _field(2, M["Endpoint"](agent_name="fake-agent").SerializeToString()
                        + _field(3, pickle.dumps(_CreatesAFile(str(marker))))))

    def answer(method: str, request: bytes) -> bytes:
        if method == "Offer":
            return offer_with_pickle(str(marker))
        return prepare if method == "Prepare" else b""

    fake = FakeMover(answer, token() if signed else None)
    try:
        with tensorshm.connect(b.socket) as cb:
            cb.put("mine", np.arange(1 << 18, dtype=np.uint32)).release()
            pulled = node_b.run(op="pull", peer=fake.address, name="x", timeout=10)
            pushed = node_b.run(op="push", peer=fake.address, name="mine", timeout=10)
            for answer_ in (pulled, pushed):
                print(answer_)
                assert answer_["ok"] is False, answer_
                if signed:  # a fleet member's answer: its spans are refused
                    assert answer_["error"] == "InvalidArgumentError", answer_
                    assert "span.length = 0" in answer_["message"], answer_
                else:  # not a fleet member: its answer is not even read
                    assert answer_["error"] == "UnauthenticatedError", answer_
            assert not marker.exists()
            assert "x" not in cb
            assert wait_for(lambda: nothing_held(cb)), cb.stat()
    finally:
        fake.close()
    source = "".join(p.read_text() for p in (ROOT / "python/tensorshm").glob("*.py"))
    assert "deserialize_descs" not in source and "import pickle" not in source


def test_pull_prefix_refuses_names_outside_its_prefix(daemons, nodes):
    (_, b), (_, node_b) = daemons, nodes

    def answer(method: str, request: bytes) -> bytes:
        assert method == "List", method
        return M["ListReply"](names=["batch/0", "etc/passwd"]).SerializeToString()

    fake = FakeMover(answer, token())
    try:
        got = node_b.run(op="pull_prefix", peer=fake.address, prefix="batch/", timeout=10)
        assert got["ok"] is False and got["error"] == "PermissionError", got
        assert 'name = "etc/passwd" is not under prefix "batch/"' in got["message"], got
        assert fake.calls == ["List"]  # nothing was asked for, nothing shipped
    finally:
        fake.close()


def test_a_mover_of_another_fleet_is_refused_both_ways(daemons, nodes, tmp_path):
    (a, b), (node_a, node_b) = daemons, nodes
    other = write_secret(str(tmp_path / "other.token"), "another fleet's secret, long enough")
    node_c = Node(b.socket, token_file=other)
    try:
        with tensorshm.connect(a.socket) as ca:
            publish(ca, "x", "bytes:4096")
        got = node_c.run(op="pull", peer=node_a.address, name="x", timeout=10)
        assert got["ok"] is False and got["error"] == "UnauthenticatedError", got
        assert "not made with this mover's fleet token" in got["message"], got
        got = node_a.run(op="push", peer=node_c.address, name="x", timeout=10)
        assert got["ok"] is False and got["error"] == "UnauthenticatedError", got
        with tensorshm.connect(b.socket) as cb:
            assert "x" not in cb and nothing_held(cb)
    finally:
        node_c.stop()


def run_mover(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """python -m tensorshm.transfer ARGS, expected to refuse to start."""
    return subprocess.run([sys.executable, "-m", "tensorshm.transfer", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def test_a_mover_refuses_to_start_without_credentials_or_with_a_readable_token(daemons, tmp_path):
    a, _ = daemons
    run = run_mover("--socket", a.socket)
    assert run.returncode != 0 and "no credentials" in run.stderr, run.stderr
    for mode in (0o640, 0o604):
        loose = write_secret(str(tmp_path / f"loose-{mode:o}.token"), "x" * 40, mode)
        run = run_mover("--socket", a.socket, "--token-file", loose)
        assert run.returncode != 0, run.stderr
        assert f'token_file = "{loose}": mode 0{mode:o}' in run.stderr, run.stderr
    short = write_secret(str(tmp_path / "short.token"), "tooshort")
    run = run_mover("--socket", a.socket, "--token-file", short)
    assert run.returncode != 0 and "at least 16" in run.stderr, run.stderr
    run = run_mover("--socket", a.socket, "--token-file", TOKEN_FILE,
                    env={"UCX_TLS": "tcp,self"})
    assert run.returncode != 0 and 'UCX_TLS = "tcp,self" lets UCX use TCP' in run.stderr
    assert "--allow-tcp-rma" in run.stderr
    run = run_mover("--socket", a.socket, "--token-file", TOKEN_FILE,
                    env={"UCX_PROTO_EMULATION_ENABLE": "y"})
    assert run.returncode != 0 and "UCX_PROTO_EMULATION_ENABLE" in run.stderr, run.stderr
    # Without mTLS the worker address crosses the wire readable: no transports between hosts.
    run = run_mover("--socket", a.socket, "--token-file", TOKEN_FILE, env={"UCX_TLS": "^tcp"})
    assert run.returncode != 0 and "names transports between hosts" in run.stderr, run.stderr
    run = run_mover("--socket", a.socket, "--token-file", TOKEN_FILE, "--listen", "0.0.0.0:0")
    assert run.returncode != 0 and "a wildcard address needs advertise" in run.stderr
    help_text = run_mover("--help").stdout
    assert "ANY peer that reaches its port" in help_text.replace("\n", " ").replace("  ", " ")
    # --insecure starts, and says so loudly.
    process = subprocess.Popen([sys.executable, "-m", "tensorshm.transfer", "--socket", a.socket,
                                "--insecure"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        line = process.stdout.readline()
        assert "serving on 127.0.0.1:" in line, line
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert "INSECURE" in err, err


def test_holds_are_capped_and_bounded_by_the_mover(daemons):
    a, _ = daemons
    node_a = Node(a.socket, hold_seconds=1.0)
    tok = token()
    try:
        with tensorshm.connect(a.socket) as ca:
            publish(ca, "x", "bytes:4096")
            for bad in (math.inf, -math.inf, math.nan, -1.0):
                code, details, _ = call(node_a.address, "Offer", M["OfferRequest"](
                    name="x", hold_seconds=bad), proof_token=tok)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (bad, details)
                assert f"hold_seconds = {bad}" in details, details
            assert ca.stat()["leases"] == 0
            # A peer asking for 1e300 s gets the mover's 1 s: its lease goes (after the second
            # in which the memory is still kept from other tensors) without any Finish.
            code, reply, _ = call(node_a.address, "Offer", M["OfferRequest"](
                name="x", hold_seconds=1e300, nixl=True), proof_token=tok)
            assert code == grpc.StatusCode.OK, reply
            assert ca.stat()["leases"] == 1
            assert node_a.state()["registrations"] == 1  # the span, for this transfer alone
            assert wait_for(lambda: node_a.state()["registrations"] == 0, timeout=10)
            code, details, _ = call(node_a.address, "Read", M["ReadRequest"](
                transfer_id=reply.transfer_id, offset=0, length=16), proof_token=tok)
            assert code == grpc.StatusCode.NOT_FOUND, details  # its time passed
            assert wait_for(lambda: ca.stat()["leases"] == 0, timeout=10)
            assert node_a.state() == {"holds": 0, "registrations": 0, "nixl": True}
    finally:
        node_a.stop()


def test_prepare_is_bounded_by_a_quota_per_peer_prefixes_and_devices(daemons):
    a, _ = daemons
    node_a = Node(a.socket, peer_quota_bytes=1 << 20, offer_prefixes=["pub/"],
                  accept_prefixes=["in/"])
    tok = token()

    def prepare(name: str, nbytes: int, device: str = "cpu", peer: str = "peer-1",
                claimed: int | None = None):
        return call(node_a.address, "Prepare", M["PrepareRequest"](
            name=name, requester_agent=peer, layout=M["TensorLayout"](
                dtype="uint8", shape=[nbytes], device=device,
                nbytes=nbytes if claimed is None else claimed)), proof_token=tok)

    try:
        with tensorshm.connect(a.socket) as ca:
            before = ca.stat()["pools"][0]["used_bytes"]
            code, first, _ = prepare("in/a", 768 << 10)
            assert code == grpc.StatusCode.OK, first
            code, details, _ = prepare("in/b", 512 << 10)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
            assert "layout.nbytes = 524288" in details and "786432 bytes prepared" in details
            # The quota is the caller's (its address here), not the name it gives itself.
            code, details, _ = prepare("in/b", 512 << 10, peer="peer-2")
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
            # Claiming fewer bytes than the layout spans is refused before anything is made.
            code, details, _ = prepare("in/c", 48 << 20, claimed=1)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert "layout.nbytes = 1: uint8[50331648]" in details, details
            assert ca.stat()["pools"][0]["used_bytes"] <= before + (1 << 20)
            code, details, _ = prepare("in/c", 4096, device="cuda:3")
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert 'layout.device = "cuda:3"' in details and "cpu" in details
            code, details, _ = prepare("etc/c", 4096)
            assert code == grpc.StatusCode.PERMISSION_DENIED, details
            assert 'name = "etc/c"' in details and '"in/"' in details
            assert call(node_a.address, "Finish", M["FinishRequest"](
                transfer_id=first.transfer_id), proof_token=tok)[0] == grpc.StatusCode.OK
            code, second, _ = prepare("in/b", 512 << 10)  # room again
            assert code == grpc.StatusCode.OK, second
            assert call(node_a.address, "Finish", M["FinishRequest"](
                transfer_id=second.transfer_id), proof_token=tok)[0] == grpc.StatusCode.OK
            publish(ca, "pub/x", "bytes:100")
            publish(ca, "secret/x", "bytes:100")
            code, listed, _ = call(node_a.address, "List", M["ListRequest"](), proof_token=tok)
            assert list(listed.names) == ["pub/x"]
            code, details, _ = call(node_a.address, "Offer", M["OfferRequest"](name="secret/x"),
                                    proof_token=tok)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "pub/" in details, details
            assert wait_for(lambda: nothing_held(ca)), ca.stat()
    finally:
        node_a.stop()


def test_a_proof_for_one_mover_is_refused_by_another(daemons, nodes):
    (a, b), (node_a, node_b) = daemons, nodes
    with tensorshm.connect(b.socket) as cb:
        cb.put("b-only/payroll", np.arange(10)).release()
    request = M["ListRequest"](prefix="").SerializeToString()
    proof, _ = token().sign_call("List", request, node_a.address)  # meant for A
    code, details, _ = call(node_b.address, "List", request, proof=proof)  # relayed to B
    assert code == UNAUTHENTICATED and "for another mover" in details, details
    assert "payroll" not in details


def test_a_commit_publishes_only_what_was_written(daemons):
    a, _ = daemons
    node_a = Node(a.socket, transport="grpc")
    tok = token()
    nbytes = (2 << 20) * 4 + 4096  # three chunks, the last short
    layout = M["TensorLayout"](dtype="uint8", shape=[nbytes], device="cpu", nbytes=nbytes)
    try:
        with tensorshm.connect(a.socket) as ca:
            # Freed memory with something in it: a later buffer may be made there.
            ca.put("secret/gone", np.full(nbytes, 0x5A, dtype=np.uint8)).release()
            ca.delete("secret/gone")
            # A commit with no write publishes zeros, never the freed bytes.
            code, prepared, _ = call(node_a.address, "Prepare", M["PrepareRequest"](
                name="in/empty", layout=layout), proof_token=tok)
            assert code == grpc.StatusCode.OK, prepared
            code, done, _ = call(node_a.address, "Finish", M["FinishRequest"](
                transfer_id=prepared.transfer_id, commit=True), proof_token=tok)
            assert code == grpc.StatusCode.FAILED_PRECONDITION, done
            assert "0 of its 3 chunks were written" in done, done
            # A Write stream that lost a chunk (a relay dropped it): the commit is refused.
            code, prepared, _ = call(node_a.address, "Prepare", M["PrepareRequest"](
                name="in/holed", layout=layout), proof_token=tok)
            assert code == grpc.StatusCode.OK, prepared
            tid = prepared.transfer_id
            proof, nonce = tok.sign_call("Write", b"", node_a.address)
            chunks = []
            for offset in (0, 8 << 20):  # the middle chunk is missing
                data = b"\x01" * min(4 << 20, nbytes - offset)
                chunks.append(M["WriteRequest"](
                    transfer_id=tid, offset=offset, data=data,
                    proof=tok.sign_chunk("Write", nonce, f"{tid}:{offset}", data)
                ).SerializeToString())
            with grpc.insecure_channel(node_a.address) as channel:
                channel.stream_unary(f"/{SERVICE}/Write")(iter(chunks), timeout=10,
                                                         metadata=((PROOF_KEY, proof),))
            code, done, _ = call(node_a.address, "Finish", M["FinishRequest"](
                transfer_id=tid, commit=True, chunks=3), proof_token=tok)
            assert code == grpc.StatusCode.FAILED_PRECONDITION, done
            assert "2 of its 3 chunks were written (the caller says it sent 3); nothing " \
                "published" in done, done
            # A Write stream with no chunk at all is refused as such.
            code, prepared, _ = call(node_a.address, "Prepare", M["PrepareRequest"](
                name="in/none", layout=layout), proof_token=tok)
            proof, _ = tok.sign_call("Write", b"", node_a.address)
            with grpc.insecure_channel(node_a.address) as channel, \
                    pytest.raises(grpc.RpcError) as refused:
                channel.stream_unary(f"/{SERVICE}/Write")(iter([]), timeout=10,
                                                         metadata=((PROOF_KEY, proof),))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "a stream with no chunk" in refused.value.details()
            assert call(node_a.address, "Finish", M["FinishRequest"](
                transfer_id=prepared.transfer_id), proof_token=tok)[0] == grpc.StatusCode.OK
            assert "in/holed" not in ca and "in/empty" not in ca
            assert wait_for(lambda: nothing_held(ca)), ca.stat()
    finally:
        node_a.stop()


def test_a_nixl_commit_without_the_write_publishes_zeros(daemons):
    a, _ = daemons
    node_a = Node(a.socket)
    tok = token()
    nbytes = 1 << 20
    try:
        with tensorshm.connect(a.socket) as ca:
            ca.put("secret/gone", np.full(nbytes, 0x5A, dtype=np.uint8)).release()
            ca.delete("secret/gone")
            code, prepared, _ = call(node_a.address, "Prepare", M["PrepareRequest"](
                name="in/x", nixl=True, layout=M["TensorLayout"](
                    dtype="uint8", shape=[nbytes], device="cpu", nbytes=nbytes)),
                proof_token=tok)
            assert code == grpc.StatusCode.OK and prepared.destination.agent_name, prepared
            code, done, _ = call(node_a.address, "Finish", M["FinishRequest"](
                transfer_id=prepared.transfer_id, commit=True), proof_token=tok)
            assert code == grpc.StatusCode.OK, done
            got = np.from_dlpack(ca.get("in/x"))
            assert not got.any(), np.count_nonzero(got)  # zeros, not the deleted tensor's 0x5A
            # A pusher that fell back to Write calls says how many it sent: a relay that
            # dropped them all gets nothing published, NIXL registration or not.
            code, prepared, _ = call(node_a.address, "Prepare", M["PrepareRequest"](
                name="in/y", nixl=True, layout=M["TensorLayout"](
                    dtype="uint8", shape=[nbytes], device="cpu", nbytes=nbytes)),
                proof_token=tok)
            code, done, _ = call(node_a.address, "Finish", M["FinishRequest"](
                transfer_id=prepared.transfer_id, commit=True, chunks=1), proof_token=tok)
            assert code == grpc.StatusCode.FAILED_PRECONDITION, done
            assert "0 of its 1 chunks were written (the caller says it sent 1)" in done, done
            assert "in/y" not in ca
    finally:
        node_a.stop()


def listening_tcp_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (its sockets in /proc/net/tcp{,6} in state 0A)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_mover_listens_on_no_port_but_its_grpc_one(daemons):
    (a, b) = daemons
    # UCX on every interface, as on a real node (conftest keeps it on lo otherwise).
    every = {"UCX_NET_DEVICES": "all"}
    node_a, node_b = Node(a.socket, env=every), Node(b.socket, env=every)
    try:
        with tensorshm.connect(a.socket) as ca:
            publish(ca, "x", f"f32:{1 << 20}")
        assert node_b.run(op="pull", peer=node_a.address, name="x", timeout=30)["ok"]
        consume(b, "x", f"f32:{1 << 20}")
        for node in (node_a, node_b):
            port = int(node.address.rsplit(":", 1)[1])
            assert listening_tcp_ports(node.process.pid) == {port}
            assert node.state() == {"holds": 0, "registrations": 0, "nixl": True}
    finally:
        node_a.stop()
        node_b.stop()


SHIPS = [("tiny", "bytes:1024"), ("big", f"f32:{16 << 20}"), ("strided", "strided")]


@pytest.mark.parametrize("name,kind", SHIPS, ids=["1KiB", "64MiB", "strided"])
def test_bytes_go_over_the_authenticated_channel_where_no_safe_transport_is_shared(
        daemons, name, kind):
    a, b = daemons
    # B's UCX may use shared memory alone, which does no RDMA for real: with UCX's emulation of
    # it off, no transport moves the span, so the bytes go in Read and Write streams. C has no
    # NIXL at all (transport "grpc").
    node_a = Node(a.socket)
    node_b = Node(b.socket, env={"UCX_TLS": "posix,sysv,self"})
    node_c = Node(b.socket, transport="grpc")
    try:
        with tensorshm.connect(a.socket) as ca, tensorshm.connect(b.socket) as cb:
            publish(ca, name, kind)
            assert node_b.run(op="pull", peer=node_a.address, name=name, timeout=60) == \
                {"ok": True, "result": name}
            consume(b, name, kind)
            assert node_c.run(op="push", peer=node_a.address, name=name, timeout=60,
                              **{"as": f"back/{name}"})["ok"]
            consume(a, f"back/{name}", kind)
            assert node_c.state()["nixl"] is False
            for node in (node_a, node_b, node_c):
                assert node.state()["holds"] == 0 and node.state()["registrations"] == 0
            assert wait_for(lambda: nothing_held(ca)) and wait_for(lambda: nothing_held(cb))
    finally:
        for node in (node_a, node_b, node_c):
            node.stop()


def make_certificates(directory: pathlib.Path, ca_name: str, names: list[str]) -> dict:
    """A CA and a certificate per name (SAN 127.0.0.1 and localhost), by openssl."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            f"/CN={ca_name}", "-keyout", f"{ca_name}.key", "-out", f"{ca_name}.pem")
    made = {"ca": str(directory / f"{ca_name}.pem")}
    for name in names:
        (directory / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca_name}.pem", "-CAkey",
                f"{ca_name}.key", "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
                "-out", f"{name}.pem")
        os.chmod(directory / f"{name}.key", 0o600)
        made[name] = (str(directory / f"{name}.pem"), str(directory / f"{name}.key"))
    return made


def test_mtls_movers_verify_each_other(daemons, tmp_path):
    a, b = daemons
    fleet = make_certificates(tmp_path, "fleet-ca", ["mover-a", "mover-b"])
    stranger = make_certificates(tmp_path, "other-ca", ["stranger"])

    def tls(who: str, certs: dict = fleet) -> dict:
        return {"tls_cert": certs[who][0], "tls_key": certs[who][1], "tls_ca": certs["ca"]}

    node_a, node_b = Node(a.socket, **tls("mover-a")), Node(b.socket, **tls("mover-b"))
    node_s = Node(b.socket, **tls("stranger", stranger))
    try:
        with tensorshm.connect(a.socket) as ca:
            publish(ca, "x", "bytes:100000")
        assert node_b.run(op="pull", peer=node_a.address, name="x", timeout=30) == \
            {"ok": True, "result": "x"}
        consume(b, "x", "bytes:100000")
        got = node_s.run(op="pull", peer=node_a.address, name="x", as_name=None, timeout=10,
                         **{"as": "stolen"})
        assert got["ok"] is False and got["error"] in ("ConnectionError", "TimeoutError"), got
        # Without a certificate, or over plaintext: refused by the TLS handshake.
        request = M["ListRequest"](prefix="")
        assert call(node_a.address, "List", request)[0] == grpc.StatusCode.UNAVAILABLE
        no_cert = grpc.ssl_channel_credentials(root_certificates=open(fleet["ca"], "rb").read())
        assert call(node_a.address, "List", request, credentials=no_cert)[0] == \
            grpc.StatusCode.UNAVAILABLE
        with tensorshm.connect(b.socket) as cb:
            assert "stolen" not in cb
    finally:
        for node in (node_a, node_b, node_s):
            node.stop()


def test_concurrent_ships_from_one_peer_each_register_their_own_span(daemons, nodes):
    (a, b), (node_a, node_b) = daemons, nodes
    with tensorshm.connect(a.socket) as ca:
        for i in range(3):
            publish(ca, f"c/{i}", f"bytes:{(1 << 20) + i}")
    # Three movers pull from one source at once: each transfer registers its own span there,
    # and each puller loads the source's metadata with that span.
    pullers = [node_b, Node(b.socket), Node(b.socket)]
    try:
        results: dict[int, dict] = {}

        def pull(i: int) -> None:
            results[i] = pullers[i].run(op="pull", peer=node_a.address, name=f"c/{i}",
                                        timeout=60)

        threads = [threading.Thread(target=pull, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r["ok"] for r in results.values()), results
        for i in range(3):
            consume(b, f"c/{i}", f"bytes:{(1 << 20) + i}")
        # And one puller again and again: its loads of the source's metadata pile up nothing.
        for i in range(3):
            assert node_b.run(op="pull", peer=node_a.address, name=f"c/{i}", timeout=60,
                              **{"as": f"again/{i}"})["ok"]
        assert node_a.state() == {"holds": 0, "registrations": 0, "nixl": True}
    finally:
        for node in pullers[1:]:
            node.stop()


class _DirectPeer:
    """Another Mover in this process reached through its serve(), as tensorshm.ray's actors
    reach each other: the Peer path, with its proofs."""

    def __init__(self, mover) -> None:
        self.mover = mover
        self.calls: list[str] = []

    def __str__(self) -> str:
        return "direct-peer"

    def call(self, method: str, request: bytes, proof: str, timeout: float):
        self.calls.append(method)
        return self.mover.serve(method, request, proof)


def test_a_peer_path_moves_chunks_with_proofs_both_ways(daemons):
    from tensorshm.transfer import Mover

    a, b = daemons
    with Mover(a.socket, listen=None, token_file=TOKEN_FILE, transport="grpc",
               advertise=["direct-peer"]) as ma, \
            Mover(b.socket, listen=None, token_file=TOKEN_FILE, transport="grpc",
                  advertise=["direct-peer-b"]) as mb, \
            tensorshm.connect(a.socket) as ca, tensorshm.connect(b.socket) as cb:
        kind = f"bytes:{(9 << 20) + 5}"  # three chunks, the last one short
        publish(ca, "p/x", kind)
        peer = _DirectPeer(ma)
        assert mb.pull(peer, "p/x") == "p/x"
        consume(b, "p/x", kind)
        assert peer.calls == ["Offer", "Read", "Read", "Read", "Finish"]
        back = _DirectPeer(ma)
        assert mb.push(back, "p/x", "p/back") == "p/back"
        consume(a, "p/back", kind)
        assert back.calls == ["Prepare", "Write", "Write", "Write", "Finish"]
        # Without a proof, through the same door: refused before anything is done.
        request = M["OfferRequest"](name="p/x").SerializeToString()
        with pytest.raises(tensorshm.UnauthenticatedError, match="no proof"):
            ma.serve("Offer", request, "")
        assert ma.holds == 0 and wait_for(lambda: nothing_held(ca) and nothing_held(cb))


def test_a_streamed_chunk_without_its_proof_is_refused(daemons, nodes):
    (_, b), (_, node_b) = daemons, nodes
    signer = token()
    nbytes = 1 << 20

    def offer(request: bytes, context):
        proof = dict(context.invocation_metadata())[PROOF_KEY]
        reply = M["OfferReply"](transfer_id="ef" * 16, layout=M["TensorLayout"](
            dtype="uint8", shape=[nbytes], device="cpu", nbytes=nbytes),
            source=M["Endpoint"](span=M["Span"](length=nbytes, device="cpu"))
        ).SerializeToString()
        context.set_trailing_metadata(((PROOF_KEY, signer.sign_reply(
            "Offer", bytes.fromhex(proof.split(".")[2]), reply)),))
        return reply

    def read(request: bytes, context):  # the bytes of a tampering relay: a proof of others
        yield M["ReadReply"](data=b"\xee" * nbytes, offset=0, proof="00" * 32).SerializeToString()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Offer": grpc.unary_unary_rpc_method_handler(offer),
        "Read": grpc.unary_stream_rpc_method_handler(read),
        "Finish": grpc.unary_unary_rpc_method_handler(lambda r, c: b"")}),))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        got = node_b.run(op="pull", peer=address, name="t", timeout=10)
        assert got["ok"] is False and got["error"] == "UnauthenticatedError", got
        assert "chunk at" in got["message"], got
        with tensorshm.connect(b.socket) as cb:
            assert "t" not in cb and wait_for(lambda: nothing_held(cb))
    finally:
        server.stop(grace=None)
