"""tensorshm tensors through the Arrow PyCapsule interface, against a real daemon: pyarrow and
nanoarrow read them as the canonical extension type arrow.fixed_shape_tensor, zero-copy, with the
lease held until Arrow releases the array; capsules are consumable once; put() copies Arrow
arrays of that type in, and refuses other Arrow data saying why."""

from __future__ import annotations

import ctypes
import gc
import json
import warnings

import numpy as np
import pytest

import tensorshm
from conftest import own_leases

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (make test-ecosystem)")

KDL_CPU = 1
ARROW_DEVICE_CPU = 1

DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
          "float32", "float64"]


class DeviceArray(ctypes.Structure):
    """struct ArrowDeviceArray, after its ArrowArray (10 pointer-sized fields)."""

    _fields_ = [("array", ctypes.c_int64 * 10), ("device_id", ctypes.c_int64),
                ("device_type", ctypes.c_int32), ("sync_event", ctypes.c_void_p),
                ("reserved", ctypes.c_int64 * 3)]


class Schema(ctypes.Structure):
    pass


Schema._fields_ = [("format", ctypes.c_char_p), ("name", ctypes.c_char_p),
                   ("metadata", ctypes.c_void_p), ("flags", ctypes.c_int64),
                   ("n_children", ctypes.c_int64), ("children", ctypes.POINTER(ctypes.POINTER(Schema))),
                   ("dictionary", ctypes.c_void_p), ("release", ctypes.c_void_p),
                   ("private_data", ctypes.c_void_p)]


def decode_metadata(address: int) -> dict[bytes, bytes]:
    """int32 count, then int32-length-prefixed keys and values."""
    def int32(at: int) -> int:
        return ctypes.c_int32.from_address(at).value

    out, at = {}, address + 4
    for _ in range(int32(address)):
        key = ctypes.string_at(at + 4, int32(at))
        at += 4 + len(key)
        value = ctypes.string_at(at + 4, int32(at))
        at += 4 + len(value)
        out[key] = value
    return out


def capsule_struct(capsule, name: bytes, struct):
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return struct.from_address(get(capsule, name))


class HostArrow:
    """A producer of host Arrow arrays without DLPack (put() takes its Arrow path)."""

    def __init__(self, array) -> None:
        self.array = array

    def __arrow_c_array__(self, requested_schema=None):
        return self.array.__arrow_c_array__(requested_schema)


class DeviceArrow:
    """A producer of Arrow device arrays without DLPack."""

    def __init__(self, array) -> None:
        self.array = array

    def __arrow_c_device_array__(self, requested_schema=None, **kwargs):
        return self.array.__arrow_c_device_array__(requested_schema, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pa_array_is_a_zero_copy_fixed_shape_tensor_array(client, dtype):
    data = (np.arange(24) % 100).astype(dtype).reshape(4, 2, 3)
    t = client.put(f"arrow/{dtype}", data, replace=True)
    a = pa.array(t)
    assert isinstance(a, pa.FixedShapeTensorArray)
    assert a.type.extension_name == "arrow.fixed_shape_tensor"
    assert a.type.value_type == pa.from_numpy_dtype(np.dtype(dtype))
    assert a.type.shape == [2, 3]  # the shape of one element: shape[1:]
    assert a.type.storage_type == pa.list_(pa.from_numpy_dtype(np.dtype(dtype)), 6)
    assert len(a) == 4 and a.null_count == 0
    assert a.storage.values.buffers()[1].address == t._data_ptr
    out = a.to_numpy_ndarray()
    assert out.dtype == np.dtype(dtype) and out.shape == (4, 2, 3)
    assert out.ctypes.data == t._data_ptr  # still the shared memory
    np.testing.assert_array_equal(out, data)


def test_schema_capsule_carries_the_canonical_metadata(client):
    t = client.put("arrow/schema", np.zeros((5, 2, 3, 4), dtype=np.float32), replace=True)
    ty = pa.DataType._import_from_c_capsule(t.__arrow_c_schema__())
    assert ty.extension_name == "arrow.fixed_shape_tensor"
    assert ty.shape == [2, 3, 4]
    assert ty.storage_type.list_size == 24
    # The C Data Interface's binary encoding, read as it is (pyarrow drops it on import).
    capsule = t.__arrow_c_schema__()
    raw = capsule_struct(capsule, b"arrow_schema", Schema)
    assert raw.format == b"+w:24" and raw.n_children == 1
    assert raw.children[0].contents.format == b"f" and raw.children[0].contents.name == b"item"
    assert decode_metadata(raw.metadata) == {
        b"ARROW:extension:name": b"arrow.fixed_shape_tensor",
        b"ARROW:extension:metadata": b'{"shape":[2,3,4]}'}


def test_import_from_c_capsule_and_device_capsule(client):
    data = np.arange(12, dtype=np.int64).reshape(3, 4)
    t = client.put("arrow/capsules", data, replace=True)
    a = pa.Array._import_from_c_capsule(*t.__arrow_c_array__())
    np.testing.assert_array_equal(a.to_numpy_ndarray(), data)
    schema, device_array = t.__arrow_c_device_array__()
    raw = capsule_struct(device_array, b"arrow_device_array", DeviceArray)
    assert raw.device_type == ARROW_DEVICE_CPU and raw.device_id == -1
    assert raw.sync_event is None
    d = pa.Array._import_from_c_device_capsule(schema, device_array)
    assert d.equals(a)
    assert d.storage.values.buffers()[1].address == t._data_ptr


def test_device_array_keywords_follow_the_pycapsule_interface(client):
    t = client.put("arrow/kwargs", np.ones((2, 2), dtype=np.float32), replace=True)
    schema, array = t.__arrow_c_device_array__(None, some_future_keyword=None)  # None: ignored
    assert pa.Array._import_from_c_device_capsule(schema, array).to_numpy_ndarray().sum() == 4
    with pytest.raises(NotImplementedError, match="some_future_keyword"):
        t.__arrow_c_device_array__(some_future_keyword=1)


def test_a_capsule_is_consumable_once(client):
    t = client.put("arrow/once", np.arange(6, dtype=np.int32).reshape(2, 3), replace=True)
    schema, array = t.__arrow_c_array__()
    first = pa.Array._import_from_c_capsule(schema, array)
    with pytest.raises(pa.ArrowInvalid, match="released"):
        pa.Array._import_from_c_capsule(t.__arrow_c_schema__(), array)
    with pytest.raises(pa.ArrowInvalid, match="released"):
        pa.Array._import_from_c_capsule(schema, t.__arrow_c_array__()[1])
    schema, device_array = t.__arrow_c_device_array__()
    pa.Array._import_from_c_device_capsule(schema, device_array)
    with pytest.raises(pa.ArrowInvalid, match="released"):
        pa.Array._import_from_c_device_capsule(t.__arrow_c_schema__(), device_array)
    assert first.to_numpy_ndarray().sum() == 15


def test_the_lease_is_held_until_arrow_releases_the_array(client):
    name = "arrow/lease"
    data = np.arange(1000, dtype=np.float64).reshape(100, 10)
    client.put(name, data, replace=True)
    baseline = own_leases(client)
    t = client.get(name)
    a = pa.array(t)
    device = pa.Array._import_from_c_device_capsule(*t.__arrow_c_device_array__())
    del t
    gc.collect()
    client.delete(name)
    assert name not in [e["name"] for e in client.list("arrow/")]
    assert own_leases(client) == baseline + 1  # the tensor is gone: the Arrow arrays hold its lease
    np.testing.assert_array_equal(a.to_numpy_ndarray(), data)
    del a
    gc.collect()
    assert own_leases(client) == baseline + 1
    del device
    gc.collect()
    assert own_leases(client) == baseline


def test_unconsumed_capsules_release_the_lease(client):
    name = "arrow/unconsumed"
    client.put(name, np.zeros((3, 3), dtype=np.uint8), replace=True)
    baseline = own_leases(client)
    t = client.get(name)
    host = t.__arrow_c_array__()
    device = t.__arrow_c_device_array__()
    del t
    gc.collect()
    assert own_leases(client) == baseline + 1
    del host, device
    gc.collect()
    assert own_leases(client) == baseline


def test_one_and_zero_element_shapes(client):
    v = client.put("arrow/1d", np.arange(5, dtype=np.int16), replace=True)
    a = pa.array(v)
    assert a.type.shape == [] and a.type.storage_type.list_size == 1
    np.testing.assert_array_equal(a.to_numpy_ndarray(), np.arange(5, dtype=np.int16))
    for shape in [(0, 3), (2, 0), (0,)]:
        data = np.zeros(shape, dtype=np.float32)
        t = client.put(f"arrow/empty{len(shape)}{shape[0]}", data, replace=True)
        e = pa.array(t)
        assert len(e) == shape[0] and e.type.shape == list(shape[1:])
        assert e.to_numpy_ndarray().shape == shape


def test_exports_refuse_what_arrow_cannot_describe(client):
    scalar = client.put("arrow/scalar", np.float32(3.0), replace=True)
    with pytest.raises(tensorshm.InvalidArgumentError, match=r"0-d .*reshape it to \(1,\)"):
        scalar.__arrow_c_array__()
    with pytest.raises(tensorshm.InvalidArgumentError, match="0-d"):
        pa.array(scalar)
    for dtype in ["bool", "bfloat16", "complex64", "int4", "float8_e4m3fn"]:
        t = client.create((2, 2), dtype)
        for export in (t.__arrow_c_schema__, t.__arrow_c_array__, t.__arrow_c_device_array__):
            with pytest.raises(tensorshm.InvalidArgumentError,
                               match=f"dtype = {dtype}: .*DLPack instead"):
                export()
    strided = client.create((3, 4), "float32", strides=(1, 3))
    with pytest.raises(tensorshm.InvalidArgumentError,
                       match=r"strides = \(1, 3\) for shape = \(3, 4\).*C-contiguous"):
        strided.__arrow_c_array__()
    with pytest.raises(TypeError, match="requested_schema"):
        client.put("arrow/rs", np.ones(2, np.int8), replace=True).__arrow_c_array__(42)


def test_nanoarrow_reads_the_same_values(client):
    na = pytest.importorskip("nanoarrow", reason="nanoarrow is not installed")
    data = np.arange(24, dtype=np.int32).reshape(4, 6)
    t = client.put("arrow/nanoarrow", data, replace=True)
    schema = na.c_schema(t)
    assert schema.format == "+w:6" and schema.child(0).format == "i"
    metadata = dict(schema.metadata.items())
    assert metadata[b"ARROW:extension:name"] == b"arrow.fixed_shape_tensor"
    assert json.loads(metadata[b"ARROW:extension:metadata"]) == {"shape": [6]}
    array = na.c_array(t)
    assert array.length == 4 and array.child(0).length == 24
    values = array.child(0).view().buffer(1)
    np.testing.assert_array_equal(np.frombuffer(values, dtype=np.int32).reshape(4, 6), data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nanoarrow: the extension is read as its storage
        assert na.Array(t).to_pylist()[1] == list(range(6, 12))


@pytest.mark.parametrize("wrap", [lambda a: a, DeviceArrow, HostArrow],
                         ids=["pyarrow", "arrow_c_device_array", "arrow_c_array"])
def test_put_copies_fixed_shape_tensor_arrays_in(client, wrap):
    data = np.arange(60, dtype=np.float32).reshape(5, 3, 4)
    a = pa.FixedShapeTensorArray.from_numpy_ndarray(data)
    t = client.put("arrow/put", wrap(a), replace=True)
    assert t.shape == (5, 3, 4) and t.dtype == "float32"
    np.testing.assert_array_equal(np.from_dlpack(t), data)
    sliced = client.put("arrow/put-sliced", wrap(a[1:4]), replace=True)
    assert sliced.shape == (3, 3, 4)
    np.testing.assert_array_equal(np.from_dlpack(sliced), data[1:4])


def test_put_honours_the_list_and_values_offsets(client):
    values = pa.array(np.arange(30, dtype=np.int64))[4:]  # the values' own offset: 4
    storage = pa.FixedSizeListArray.from_arrays(values, 2)  # 13 lists of 2
    a = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.int64(), [2]), storage)[3:7]
    t = client.put("arrow/offsets", HostArrow(a), replace=True)
    expected = np.arange(4, 30).reshape(13, 2)[3:7]
    np.testing.assert_array_equal(np.from_dlpack(t), expected)


def test_put_of_nanoarrow_arrays_round_trips(client):
    na = pytest.importorskip("nanoarrow", reason="nanoarrow is not installed")
    data = np.arange(20, dtype=np.uint16).reshape(4, 5)
    source = client.put("arrow/na-src", data, replace=True)
    t = client.put("arrow/na", na.c_array(source), replace=True)
    assert t.shape == (4, 5) and t.dtype == "uint16"
    np.testing.assert_array_equal(np.from_dlpack(t), data)
    a = pa.FixedShapeTensorArray.from_numpy_ndarray(data.astype(np.float64))
    back = client.put("arrow/na-pa", na.Array(a[2:]), replace=True)
    np.testing.assert_array_equal(np.from_dlpack(back), data[2:].astype(np.float64))


def test_put_refuses_other_arrow_data_saying_why(client):
    with pytest.raises(tensorshm.InvalidArgumentError,
                       match='format "l" and extension type none.*arrow.fixed_shape_tensor'):
        client.put("arrow/bad", HostArrow(pa.array([1, 2, 3])))
    tensor_type = pa.fixed_shape_tensor(pa.float64(), [2])
    rows = pa.array([[1.0, 2.0], None, [5.0, 6.0]], pa.list_(pa.float64(), 2))
    with pytest.raises(tensorshm.InvalidArgumentError, match="has 1 null"):
        client.put("arrow/bad", pa.ExtensionArray.from_storage(tensor_type, rows))
    items = pa.array([[1.0, None]], pa.list_(pa.float64(), 2))
    with pytest.raises(tensorshm.InvalidArgumentError, match="values has 1 null"):
        client.put("arrow/bad", HostArrow(pa.ExtensionArray.from_storage(tensor_type, items)))
    permuted = pa.ExtensionArray.from_storage(
        pa.fixed_shape_tensor(pa.int32(), [2, 3], permutation=[1, 0]),
        pa.array([list(range(6))], pa.list_(pa.int32(), 6)))
    with pytest.raises(tensorshm.InvalidArgumentError, match=r"permutation = \[1,0\]"):
        client.put("arrow/bad", DeviceArrow(permuted))
    chunked = pa.chunked_array([pa.FixedShapeTensorArray.from_numpy_ndarray(np.ones((2, 2)))])
    with pytest.raises(TypeError, match="Arrow stream"):
        client.put("arrow/bad", chunked)
    assert "arrow/bad" not in [e["name"] for e in client.list("arrow/")]
    schema, array = HostArrow(pa.FixedShapeTensorArray.from_numpy_ndarray(
        np.ones((2, 2)))).__arrow_c_array__()
    capsule = client._native.arrow_to_dlpack(schema, array)
    del capsule
    with pytest.raises(tensorshm.InvalidArgumentError, match="already consumed"):
        client._native.arrow_to_dlpack(schema, array)


def test_arrow_exports_outlive_release_and_a_released_tensor_refuses_them(client):
    data = np.arange(12, dtype=np.int32).reshape(4, 3)
    client.put("arrow/released", data, replace=True)
    with client.get("arrow/released") as t:
        a = pa.array(t)  # holds its own lease
        schema, array = t.__arrow_c_device_array__()
    for export in ("__arrow_c_schema__", "__arrow_c_array__", "__arrow_c_device_array__"):
        with pytest.raises(tensorshm.ReleasedError, match="'arrow/released' was released"):
            getattr(t, export)()
    np.testing.assert_array_equal(a.to_numpy_ndarray(), data)
    imported = pa.Array._import_from_c_device_capsule(schema, array)
    np.testing.assert_array_equal(imported.to_numpy_ndarray(), data)
