"""A tiny ONNX model, y = 2 * x + 1 over a float32 vector, encoded by hand in protobuf's wire
format so that the ONNX Runtime tests need no `onnx` package (only ModelProto's field numbers,
from onnx/onnx.proto, are used)."""

from __future__ import annotations

import struct

_FLOAT = 1  # TensorProto.DataType.FLOAT
_OPSET = 13
_IR_VERSION = 7


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, value: int | str | bytes) -> bytes:
    """One field: an int as a varint, a str or bytes (or an encoded message) length-delimited."""
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _node(op_type: str, inputs: list[str], output: str) -> bytes:
    # NodeProto: input = 1, output = 2, op_type = 4.
    return b"".join(_field(1, i) for i in inputs) + _field(2, output) + _field(4, op_type)


def _float_scalar(name: str, value: float) -> bytes:
    # TensorProto: data_type = 2, name = 8, raw_data = 9 (little-endian); no dims: a scalar.
    return _field(2, _FLOAT) + _field(8, name) + _field(9, struct.pack("<f", value))


def _float_vector(name: str) -> bytes:
    # ValueInfoProto{name = 1, type = 2: TypeProto{tensor_type = 1: {elem_type = 1,
    # shape = 2: TensorShapeProto{dim = 1: Dimension{dim_param = 2}}}}}.
    shape = _field(1, _field(2, "n"))
    return _field(1, name) + _field(2, _field(1, _field(1, _FLOAT) + _field(2, shape)))


def affine_model() -> bytes:
    """The serialized ModelProto of y = 2 * x + 1: input "x" and output "y", float32 of shape
    (n,), default opset 13."""
    graph = b"".join([
        # GraphProto: node = 1, name = 2, initializer = 5, input = 11, output = 12.
        _field(1, _node("Mul", ["x", "two"], "twice")),
        _field(1, _node("Add", ["twice", "one"], "y")),
        _field(2, "affine"),
        _field(5, _float_scalar("two", 2.0)),
        _field(5, _float_scalar("one", 1.0)),
        _field(11, _float_vector("x")),
        _field(12, _float_vector("y")),
    ])
    # ModelProto: ir_version = 1, graph = 7, opset_import = 8 (OperatorSetIdProto{domain = 1,
    # version = 2}); IR version 7 is that of opset 13 (ONNX 1.8).
    return _field(1, _IR_VERSION) + _field(7, graph) + _field(8, _field(1, "") + _field(2, _OPSET))
