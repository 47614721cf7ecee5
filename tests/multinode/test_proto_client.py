"""A client written from proto/tensorshm/v1/tensorshm.proto alone, with grpcio: no tensorshm code,
message classes built from the descriptor set protoc makes of the .proto, each call by its method
path. It does the whole handoff over gRPC (the memory channel is our clients' transport; gRPC stays
complete for everyone else): a session each for a producer and a consumer, Create, the bytes
written through the segment's POSIX shm name, Publish, Acquire, the bytes read, the lease released
on the Session stream, Delete."""

from __future__ import annotations

import mmap
import os
import pathlib
import queue
import shutil
import subprocess

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from conftest import Daemon, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO = "tensorshm/v1/tensorshm.proto"
SERVICE = "/tensorshm.v1.TensorShm/"


def _messages(tmp_path: pathlib.Path) -> dict:
    """The .proto's message classes, by name, from protoc's descriptor set."""
    protoc = shutil.which("protoc")
    if protoc is None:
        pytest.fail("protoc is not installed (scripts/setup.sh installs protobuf-compiler)")
    out = tmp_path / "tensorshm.desc"
    subprocess.run([protoc, f"--proto_path={ROOT / 'proto'}", "--include_imports",
                    f"--descriptor_set_out={out}", PROTO], check=True)
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    package = pool.FindFileByName(PROTO).package
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))
            for name in pool.FindFileByName(PROTO).message_types_by_name}


class Session:
    """A Session stream: opened at construction; release() sends a batch and returns its ack."""

    def __init__(self, channel: grpc.Channel, m: dict, name: str):
        self._m = m
        self._requests: queue.Queue = queue.Queue()
        call = channel.stream_stream(SERVICE + "Session",
                                     request_serializer=m["SessionRequest"].SerializeToString,
                                     response_deserializer=m["SessionResponse"].FromString)
        self._responses = call(iter(self._requests.get, None))
        self._requests.put(m["SessionRequest"](open=m["SessionOpen"](
            client_name=name, client_version="proto-only", pid=os.getpid())))
        opened = next(self._responses)
        assert opened.WhichOneof("kind") == "opened", opened
        self.token = opened.opened.session_id
        self.metadata = (("tensorshm-session", self.token),)

    def release(self, **batch):
        self._requests.put(self._m["SessionRequest"](release=self._m["ReleaseBatch"](**batch)))
        response = next(self._responses)
        assert response.WhichOneof("kind") == "ack", response
        return response.ack

    def close(self):
        self._requests.put(None)


def _unary(channel: grpc.Channel, m: dict, method: str, request: str, response: str):
    return channel.unary_unary(SERVICE + method,
                               request_serializer=m[request].SerializeToString,
                               response_deserializer=m[response].FromString)


def _segment(location) -> mmap.mmap:
    """The segment the location names, mapped through its POSIX shm name."""
    name = location.host.shm_name
    assert name.startswith("/"), location
    fd = os.open("/dev/shm" + name, os.O_RDWR)
    try:
        return mmap.mmap(fd, location.segment_size)
    finally:
        os.close(fd)


def test_a_grpcio_client_from_the_proto_alone_does_the_whole_handoff(tmp_path):
    m = _messages(tmp_path)
    daemon = Daemon("proto-client")
    try:
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
            create = _unary(channel, m, "Create", "CreateRequest", "CreateResponse")
            publish = _unary(channel, m, "Publish", "PublishRequest", "PublishResponse")
            acquire = _unary(channel, m, "Acquire", "AcquireRequest", "AcquireResponse")
            delete = _unary(channel, m, "Delete", "DeleteRequest", "DeleteResponse")
            stat = _unary(channel, m, "Stat", "StatRequest", "StatResponse")
            producer = Session(channel, m, "proto-producer")
            consumer = Session(channel, m, "proto-consumer")

            # float32[1024] on the host (DLPack: kDLFloat = 2, kDLCPU = 1).
            created = create(m["CreateRequest"](
                dtype=m["DataType"](code=2, bits=32, lanes=1), shape=[1024],
                device=m["Device"](type=1, id=0)), metadata=producer.metadata, timeout=30)
            where = created.location
            assert where.length >= 4096, created
            payload = bytes(range(256)) * 16
            segment = _segment(where)
            segment[where.offset:where.offset + len(payload)] = payload
            segment.close()
            publish(m["PublishRequest"](tensor_id=created.tensor_id, name="proto/x"),
                    metadata=producer.metadata, timeout=30)

            # The name is published: answered at once, with a lease (it could wait 1 s).
            acquired = acquire(m["AcquireRequest"](name="proto/x", wait_ms=1000, request_id=1),
                               metadata=consumer.metadata, timeout=30)
            assert acquired.tensor_id == created.tensor_id
            assert acquired.lease_id != 0
            assert list(acquired.desc.shape) == [1024]
            seen = _segment(acquired.location)
            got = seen[acquired.location.offset:acquired.location.offset + len(payload)]
            seen.close()
            assert got == payload
            assert stat(m["StatRequest"](), timeout=30).leases == 1

            ack = consumer.release(sequence=1, lease_ids=[acquired.lease_id])
            assert ack.sequence == 1 and len(ack.rejected) == 0, ack
            assert wait_for(lambda: stat(m["StatRequest"](), timeout=30).leases == 0)
            delete(m["DeleteRequest"](name="proto/x"), metadata=producer.metadata, timeout=30)
            assert stat(m["StatRequest"](), timeout=30).tensors == 0
            producer.close()
            consumer.close()
    finally:
        assert daemon.stop() == 0
