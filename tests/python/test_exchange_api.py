"""The DLPack C exchange API in both directions, with tvm-ffi as the other library."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import tvm_ffi

import tensorshm
from tensorshm import _tensorshm


def calls() -> dict[str, int]:
    return _tensorshm._exchange_api_calls()


def test_tvm_ffi_imports_through_our_exchange_api(client):
    client.put("x/a", np.arange(10, dtype=np.float32), replace=True)
    t = client.get("x/a")
    before = calls()
    imported = tvm_ffi.from_dlpack(t)
    after = calls()
    assert after["managed_tensor_from_py_object_no_sync"] == \
        before["managed_tensor_from_py_object_no_sync"] + 1
    assert imported.shape == (10,)
    # tvm-ffi's tensor views our shared memory: same address, same values.
    back = np.from_dlpack(imported)
    assert back.ctypes.data == t._data_ptr
    np.testing.assert_array_equal(back, np.arange(10, dtype=np.float32))
    # Its lease lives as long as tvm-ffi's tensor does.
    del t, back
    client.flush()  # t's own release is asynchronous; count from a settled state
    leases = client.stat()["leases"]
    del imported
    client.flush()
    assert client.stat()["leases"] == leases - 1


class ExchangeOnly(tvm_ffi.core.DLTensorTestWrapper):
    """A tvm-ffi tensor that can only be read through its exchange API."""

    def __dlpack__(self, *args, **kwargs):
        raise AssertionError("put() used __dlpack__ although an exchange API was there")


def test_put_takes_a_tvm_ffi_tensor_through_its_exchange_api(client):
    source = tvm_ffi.from_dlpack(np.arange(12, dtype=np.int64).reshape(3, 4))
    t = client.put("x/from-tvm", ExchangeOnly(source), replace=True)
    np.testing.assert_array_equal(np.from_dlpack(t), np.arange(12).reshape(3, 4))


def test_put_takes_the_older_integer_attribute(client):
    api = type(tvm_ffi.core.DLTensorTestWrapper(tvm_ffi.from_dlpack(np.zeros(1)))) \
        .__dlpack_c_exchange_api__
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

    class IntegerOnly(ExchangeOnly):
        __dlpack_c_exchange_api__ = None
        __c_dlpack_exchange_api__ = get_pointer(api, b"dlpack_exchange_api")

    source = tvm_ffi.from_dlpack(np.full(4, 7, dtype=np.uint8))
    t = client.put("x/int-attr", IntegerOnly(source), replace=True)
    np.testing.assert_array_equal(np.from_dlpack(t), np.full(4, 7))


def test_put_of_our_own_tensor_uses_our_api_without_a_copy_of_metadata(client):
    client.put("x/own", np.arange(6, dtype=np.int16), replace=True)
    source = client.get("x/own")
    before = calls()["dltensor_from_py_object_no_sync"]
    copy = client.put("x/own-copy", source, replace=True)
    assert calls()["dltensor_from_py_object_no_sync"] == before + 1
    assert copy._data_ptr != source._data_ptr
    np.testing.assert_array_equal(np.from_dlpack(copy), np.arange(6))


def test_allocator_and_to_py_object_round_trip(client):
    """Drives the two producer-side entries a consumer library calls, through ctypes."""
    api_capsule = tensorshm.Tensor.__dlpack_c_exchange_api__
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api = get_pointer(api_capsule, b"dlpack_exchange_api")
    slots = [ctypes.c_void_p.from_address(api + 16 + 8 * i).value for i in range(5)]

    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class DLDataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                    ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]

    SetError = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p)
    allocator = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(DLTensor),
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, SetError)(slots[0])
    to_py = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p,
                              ctypes.POINTER(ctypes.py_object))(slots[2])
    stream = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32,
                              ctypes.POINTER(ctypes.c_void_p))(slots[4])

    shape = (ctypes.c_int64 * 2)(2, 3)
    prototype = DLTensor(None, DLDevice(1, 0), 2, DLDataType(2, 32, 1), shape, None, 0)
    managed = ctypes.c_void_p()
    errors = []
    on_error = SetError(lambda ctx, kind, message: errors.append((kind, message)))
    before = calls()
    assert allocator(ctypes.byref(prototype), ctypes.byref(managed), None, on_error) == 0, errors
    result = ctypes.py_object()
    assert to_py(managed, ctypes.byref(result)) == 0
    tensor = result.value
    # to_py handed us a new reference that ctypes does not own: drop it once.
    ctypes.pythonapi.Py_DecRef.argtypes = [ctypes.py_object]
    ctypes.pythonapi.Py_DecRef(tensor)
    assert isinstance(tensor, tensorshm.Tensor)
    assert tensor.shape == (2, 3) and tensor.dtype == "float32" and not tensor.read_only
    np.from_dlpack(tensor)[:] = 4.0
    assert float(np.from_dlpack(tensor).sum()) == 24.0
    out_stream = ctypes.c_void_p(1)
    assert stream(1, 0, ctypes.byref(out_stream)) == 0 and out_stream.value is None
    # For CUDA (2), tensorshm's work stream is CUDA's legacy default stream (1).
    assert stream(2, 0, ctypes.byref(out_stream)) == 0 and out_stream.value == 1
    after = calls()
    for entry in ("managed_tensor_allocator", "managed_tensor_to_py_object_no_sync"):
        assert after[entry] == before[entry] + 1, entry
    assert after["current_work_stream"] == before["current_work_stream"] + 2
    # The allocated (never published) buffer goes back when the tensor does.
    used = client.stat()["pools"][0]["used_bytes"]
    del tensor, result
    client.flush()
    assert client.stat()["pools"][0]["used_bytes"] < used
