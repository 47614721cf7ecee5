"""The DLPack Python protocol of tensorshm tensors: __dlpack__'s arguments, capsules, the buffer
protocol, and zero-copy, read-only numpy views."""

from __future__ import annotations

import numpy as np
import pytest

import tensorshm
from tensorshm import _tensorshm

KDLCPU, KDLCUDA = 1, 2
READ_ONLY, IS_COPIED = 1, 2


@pytest.fixture
def sealed(client):
    client.put("proto/sealed", np.arange(24, dtype=np.int32).reshape(4, 6), replace=True)
    return client.get("proto/sealed")


def capsule_name(capsule) -> str:
    import ctypes

    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = [ctypes.py_object]
    return get_name(capsule).decode()


def capsule_flags(capsule) -> int:
    """flags of the DLManagedTensorVersioned in a "dltensor_versioned" capsule."""
    import ctypes

    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    address = get_pointer(capsule, b"dltensor_versioned")
    # DLManagedTensorVersioned: version (8 bytes), manager_ctx, deleter, flags (uint64).
    return ctypes.c_uint64.from_address(address + 24).value


def legacy_data_ptr(capsule) -> int:
    """dl_tensor.data of the DLManagedTensor in a "dltensor" capsule (plus its byte_offset)."""
    import ctypes

    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    address = get_pointer(capsule, b"dltensor")
    # DLTensor: data, device (8), ndim (4) + dtype (4), shape, strides, byte_offset (uint64).
    data = ctypes.c_void_p.from_address(address).value or 0
    return data + ctypes.c_uint64.from_address(address + 40).value


def shm_mapping_of(address: int) -> tuple[str, str]:
    """(permissions, path) of the mapping of this process that holds `address`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[1], fields[5] if len(fields) > 5 else ""
    return "", ""


def test_numpy_view_is_zero_copy_and_read_only(daemon, sealed):
    array = np.from_dlpack(sealed)
    assert array.ctypes.data == sealed._data_ptr
    # The very pages of the daemon's pool segment, mapped read-only and shared.
    permissions, path = shm_mapping_of(array.ctypes.data)
    assert path.startswith(f"/dev/shm/{daemon.prefix}.cpu."), path
    assert permissions == "r--s"
    assert not array.flags.writeable
    with pytest.raises(ValueError):
        array[0, 0] = 1
    np.testing.assert_array_equal(array, np.arange(24).reshape(4, 6))
    # The buffer protocol gives the same memory, read-only too.
    buffer_view = np.asarray(sealed)
    assert buffer_view.ctypes.data == sealed._data_ptr
    assert not buffer_view.flags.writeable
    assert memoryview(sealed).readonly
    import ctypes

    get_buffer = ctypes.pythonapi.PyObject_GetBuffer
    get_buffer.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.c_int]
    py_buffer = (ctypes.c_byte * 128)()
    PYBUF_WRITABLE = 0x1
    with pytest.raises(BufferError, match="read-only"):
        get_buffer(sealed, ctypes.addressof(py_buffer), PYBUF_WRITABLE)


def test_writable_tensor_fills_through_numpy_then_seals(client):
    w = client.create((3, 4), "float64")
    assert not w.read_only and not w.published
    view = np.from_dlpack(w)
    assert view.flags.writeable and view.ctypes.data == w._data_ptr
    view[:] = 2.5
    w.publish("proto/filled", replace=True)
    assert w.read_only and w.published and w.name == "proto/filled"
    # The view stays valid after publish (the tensor holds a lease on the sealed buffer).
    assert float(view.sum()) == 30.0
    np.testing.assert_array_equal(np.from_dlpack(client.get("proto/filled")), view)
    with pytest.raises(tensorshm.FailedPreconditionError):
        w.publish("proto/again")


def test_versioned_capsule_carries_read_only(sealed):
    capsule = sealed.__dlpack__(max_version=(1, 3))
    assert capsule_name(capsule) == "dltensor_versioned"
    assert capsule_flags(capsule) & READ_ONLY


def test_legacy_capsule_of_a_sealed_tensor_is_a_private_copy(client, sealed):
    # A pre-1.0 capsule cannot say read-only: copy=None gets a copy, copy=False is refused.
    for capsule in (sealed.__dlpack__(), sealed.__dlpack__(max_version=(0, 8))):
        assert capsule_name(capsule) == "dltensor"
        assert legacy_data_ptr(capsule) != sealed._data_ptr
    with pytest.raises(BufferError, match="copy=False"):
        sealed.__dlpack__(copy=False)
    with pytest.raises(BufferError, match=r"max_version=\(0, 8\)"):
        sealed.__dlpack__(max_version=(0, 8), copy=False)
    # A writable tensor has nothing to protect: its legacy capsule is zero-copy.
    w = client.create((2,), "int8")
    capsule = w.__dlpack__()
    assert capsule_name(capsule) == "dltensor"
    assert legacy_data_ptr(capsule) == w._data_ptr


def test_copy_true_gives_a_private_writable_copy(sealed):
    capsule = sealed.__dlpack__(max_version=(1, 3), copy=True)
    flags = capsule_flags(capsule)
    assert flags & IS_COPIED and not flags & READ_ONLY
    copied = np.from_dlpack(sealed, copy=True)
    assert copied.ctypes.data != sealed._data_ptr
    copied[0, 0] = 99
    assert np.from_dlpack(sealed)[0, 0] == 0
    # A legacy capsule of a sealed tensor is fine once it is a private copy.
    assert capsule_name(sealed.__dlpack__(copy=True)) == "dltensor"


def test_dl_device_and_stream_rules(sealed):
    assert sealed.__dlpack_device__() == (KDLCPU, 0)
    assert capsule_name(sealed.__dlpack__(max_version=(1, 0), dl_device=(KDLCPU, 0))) == \
        "dltensor_versioned"
    with pytest.raises(BufferError, match="copy=False"):
        sealed.__dlpack__(max_version=(1, 0), dl_device=(KDLCUDA, 0), copy=False)
    with pytest.raises(BufferError, match="cannot copy"):
        sealed.__dlpack__(max_version=(1, 0), dl_device=(KDLCUDA, 0))
    with pytest.raises(ValueError, match="stream"):
        sealed.__dlpack__(max_version=(1, 0), stream=1)
    with pytest.raises(TypeError):
        sealed.__dlpack__((1, 0))  # keyword-only


def test_exchange_api_is_a_type_attribute_capsule(sealed):
    api = type(sealed).__dlpack_c_exchange_api__
    assert capsule_name(api) == "dlpack_exchange_api"
    assert "__dlpack_c_exchange_api__" in vars(_tensorshm.Tensor)
    assert "__dlpack_c_exchange_api__" not in getattr(sealed, "__dict__", {})
    assert tensorshm.WritableTensor.__dlpack_c_exchange_api__ is api
    import ctypes

    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    address = get_pointer(api, b"dlpack_exchange_api")
    major, minor = ctypes.c_uint32.from_address(address).value, ctypes.c_uint32.from_address(
        address + 4).value
    assert (major, minor) == (1, 3)
    pointers = [ctypes.c_void_p.from_address(address + 16 + 8 * i).value for i in range(5)]
    assert all(pointers), pointers


def test_attributes_and_repr(sealed):
    assert sealed.shape == (4, 6)
    assert sealed.strides == (6, 1)
    assert sealed.dtype == "int32"
    assert sealed.device == "cpu"
    assert sealed.nbytes == 96
    assert sealed.name == "proto/sealed"
    assert repr(sealed) == ("tensorshm.Tensor(name='proto/sealed', shape=(4, 6), dtype='int32', "
                            "device='cpu', read_only=True)")


def test_put_accepts_strided_and_fortran_inputs(client):
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    for name, array in {"s": base[::2, 1::3], "f": np.asfortranarray(base), "r": base[::-1]}.items():
        t = client.put(f"proto/in/{name}", array, replace=True)
        rows, cols = array.shape
        assert t.strides == (cols, 1)  # copied into a C-contiguous buffer
        np.testing.assert_array_equal(np.from_dlpack(t), array)


def test_put_consumes_a_capsule_once(client):
    capsule = np.arange(5, dtype=np.int16).__dlpack__(max_version=(1, 3))
    client.put("proto/capsule", capsule, replace=True)
    assert capsule_name(capsule) == "used_dltensor_versioned"
    with pytest.raises(ValueError, match="already consumed"):
        client.put("proto/capsule2", capsule)
    np.testing.assert_array_equal(np.from_dlpack(client.get("proto/capsule")), np.arange(5))


def test_put_of_something_else_is_a_type_error(client):
    with pytest.raises(TypeError, match="not a DLPack producer"):
        client.put("proto/dict", {"a": 1})
    # A list is told what to pass instead (tests/python/test_put_refusals.py).
    with pytest.raises(TypeError, match="a list is not a tensor"):
        client.put("proto/list", [1, 2, 3])
