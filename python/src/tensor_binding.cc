#include "tensor_binding.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "arrow/export.h"
#include "buffer_protocol.h"
#include "common/tensor/dtype.h"
#include "common/tensor/wire.h"
#include "dlpack_export.h"
#include "exchange_api.h"
#include "raise_status.h"
#include "segment_place.h"
#include "storage.h"
#include "tensor_object.h"
#include "waits.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace tensorshm::python {

std::string Describe(const PyTensor& t) {
  return t.name.empty() ? std::string("tensor") : absl::StrCat("tensor \"", t.name, "\"");
}

namespace {

std::string ReleasedMessage(const PyTensor& t) {
  return absl::StrCat(
      t.name.empty() ? std::string("tensor") : absl::StrCat("tensor '", t.name, "'"),
      " was released (release() or the end of its with block): get it again");
}

}  // namespace

const std::shared_ptr<Storage>* LiveOrSetError(const PyTensor& tensor) {
  if (tensor.storage != nullptr) return &tensor.storage;
  SetError("ReleasedError", ReleasedMessage(tensor));
  return nullptr;
}

const std::shared_ptr<Storage>& Live(const PyTensor& tensor) {
  const std::shared_ptr<Storage>* storage = LiveOrSetError(tensor);
  if (storage == nullptr) throw nb::python_error();
  return *storage;
}

namespace {

// Publishes `tensor` and returns the sealed tensor holding a lease on it.
void PublishWritable(PyWritableTensor& self, const std::string& name, bool replace) {
  const std::shared_ptr<Storage> pinned = Live(self);
  Storage& storage = *pinned;
  if (!storage.writable.has_value() || storage.writable->published()) {
    Raise(absl::FailedPreconditionError(absl::StrCat(Describe(self), ": already published")));
  }
  ClientRef client = Live(*self.client);
  tensorshm::StatusOr<DLManagedTensorVersioned*> lease;
  {
    ReleaseGil release;
    lease = client->PublishAndAcquire(*storage.writable, name, replace);
  }
  DLManagedTensorVersioned* held = Check(std::move(lease));
  // Sealed: views taken while writing stay valid (the lease keeps the buffer) but read-only: a
  // write through one faults rather than change what consumers read. Without such views (only
  // this tensor object and `pinned` hold the storage), the buffer stays as it is, and costs no
  // mprotect now or when it is handed out again.
  if (pinned.use_count() > 2) {
    if (tensorshm::Status s = storage.writable->SealViews(); !s.ok()) {
      held->deleter(held);
      Raise(s);
    }
  }
  storage.versioned = held;
  storage.lease = true;
  storage.flags |= DLPACK_FLAG_BITMASK_READ_ONLY;
  self.name = name;
}

nb::tuple ShapeOf(const PyTensor& t) { return nb::tuple(nb::cast(Live(t)->shape)); }

}  // namespace

std::tuple<int, int, int> DtypeFields(const std::string& name) {
  DLDataType dtype = Check(ParseDataType(name));
  return std::make_tuple(static_cast<int>(dtype.code), static_cast<int>(dtype.bits),
                         static_cast<int>(dtype.lanes));
}

std::string DtypeName(int code, int bits, int lanes) {
  return DataTypeName(Check(MakeDataType(code, bits, lanes)));
}

std::map<std::string, std::string> TritonDatatypes() {
  std::map<std::string, std::string> names;
  for (const DataTypeNames& type : AllDataTypeNames()) {
    if (type.triton_datatype != nullptr) names.emplace(type.name, type.triton_datatype);
  }
  return names;
}

void DefineTensors(nb::module_& m) {
  nb::class_<RawStorage>(m, "_RawStorage", nb::type_slots(RawStorageBufferSlots()));

  nb::class_<PyTensor> tensor(m, "Tensor", nb::type_slots(TensorBufferSlots()),
                              "A tensor in tensorshm shared memory (read-only once published, "
                              "host and VMM CUDA tensors by their mapping; on a legacy CUDA pool, "
                              "--cuda-pool-kind ipc, the read-only flag is advisory, as CUDA IPC "
                              "maps device memory writable).");
  tensor
      .def(
          "__dlpack__",
          [](const PyTensor& t, nb::handle stream, nb::handle max_version, nb::handle dl_device,
             nb::handle copy) {
            // A copy holding the storage: a release() in another thread while DLPack waits
            // without the GIL cannot free it.
            PyTensor pinned{Live(t), t.name};
            return DLPack(pinned, stream, max_version, dl_device, copy);
          },
          nb::kw_only(), "stream"_a = nb::none(), "max_version"_a = nb::none(),
          "dl_device"_a = nb::none(), "copy"_a = nb::none(),
          // The stub's signature: the DLPack protocol's types (nb::handle would say `object`).
          nb::sig("def __dlpack__(self, *, stream: typing.Any = None, max_version: tuple[int, int] "
                  "| None = None, dl_device: tuple[int, int] | None = None, copy: bool | None = "
                  "None) -> typing.Any"),
          "The tensor as a DLPack capsule. With max_version >= (1, 0): a zero-copy view "
          "flagged read-only when the tensor is (numpy, torch, tvm-ffi). Without it (JAX, "
          "pre-1.0 consumers), a legacy capsule cannot say read-only: a published host "
          "tensor is then handed over as a private copy the consumer owns (copy=False "
          "refuses), and a published CUDA tensor is refused unless dl_device=(1, 0) asks for "
          "a host copy. copy=True always copies to host memory.")
      .def("__dlpack_device__",
           [](const PyTensor& t) {
             return std::make_pair(static_cast<int>(Live(t)->tensor.device.device_type),
                                   static_cast<int>(Live(t)->tensor.device.device_id));
           })
      .def_prop_ro("shape", &ShapeOf,
                   nb::for_getter(nb::sig("def shape(self, /) -> tuple[int, ...]")))
      .def_prop_ro(
          "strides", [](const PyTensor& t) { return nb::tuple(nb::cast(Live(t)->strides)); },
          nb::for_getter(nb::sig("def strides(self, /) -> tuple[int, ...]")))
      .def_prop_ro("dtype", [](const PyTensor& t) { return DataTypeName(Live(t)->tensor.dtype); })
      .def_prop_ro("device", [](const PyTensor& t) { return DeviceName(Live(t)->tensor.device); })
      .def_prop_ro("nbytes",
                   [](const PyTensor& t) {
                     const bool padded =
                         (Live(t)->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
                     return SpanOf(Live(t)->tensor, padded).nbytes;
                   })
      .def_prop_ro("name",
                   [](const PyTensor& t) -> std::optional<std::string> {
                     if (t.name.empty()) return std::nullopt;
                     return t.name;
                   })
      .def_prop_ro(
          "read_only",
          [](const PyTensor& t) { return (Live(t)->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0; })
      .def_prop_ro("subbyte_padded",
                   [](const PyTensor& t) {
                     return (Live(t)->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
                   })
      .def_prop_ro(
          "alive", [](const PyTensor& t) { return Live(t)->LeaseStatus().ok(); },
          "Whether tensorshmd still reserves this tensor's memory for it. False once a restarted "
          "daemon did not take the tensor's lease back (the memory stays mapped and readable, but "
          "its bytes are no longer guaranteed), and in a process forked from the one that "
          "acquired it (the lease is the parent's); check() raises saying which. True for "
          "tensors that hold no lease: foreign tensors, and unpublished writable tensors (a "
          "restarted daemon that did not take one back makes its publish() raise DataLossError).")
      .def(
          "check", [](const PyTensor& t) { Check(Live(t)->LeaseStatus()); },
          "Returns None while the tensor is alive; otherwise raises DataLossError (a restarted "
          "daemon did not take its lease back) or FailedPreconditionError (in a forked child: "
          "connect and get it again there).")
      .def_prop_ro("_data_ptr",
                   [](const PyTensor& t) {
                     return reinterpret_cast<uintptr_t>(Live(t)->tensor.data) +
                            Live(t)->tensor.byte_offset;
                   })
      .def("segment_place", &SegmentPlaceOf,
           nb::sig("def segment_place(self) -> dict[str, typing.Any]"),
           "Where the tensor's bytes lie in tensorshmd's memory, for code that hands them to a "
           "server or engine mapping that memory itself (tensorshm.triton, tensorshm.transfer): "
           "a dict of device, device_id, segment_instance, segment_id, segment_size, offset and "
           "nbytes (of the bytes the tensor spans), address (of the first in this process), "
           "shm_name (host; empty for a memfd segment) and ipc_handle (CUDA: the segment's "
           "cudaIpcMemHandle on a legacy pool, empty on a VMM pool). An acquired CUDA tensor's "
           "place is given once its producer's ready event has completed. Valid while the "
           "tensor's lease is held.")
      .def("_raw_storage",
           [](const PyTensor& t) {
             const std::shared_ptr<Storage>& storage = Live(t);
             const bool padded = (storage->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
             const StorageSpan span = SpanOf(storage->tensor, padded);
             return std::make_pair(RawStorage{storage}, span.element0);
           })
      .def(
          "release",
          [](PyTensor& t) {
            std::shared_ptr<Storage> storage = std::move(t.storage);
            // Views exported before (DLPack, the buffer protocol, to_numpy) hold their own
            // reference: the lease goes back with the last of them.
            storage.reset();
          },
          "Gives the tensor's lease back now (idempotent), instead of when the object is "
          "garbage collected; an unpublished WritableTensor's buffer is freed. Views already "
          "exported (np.from_dlpack, torch.from_dlpack, memoryview, np.asarray, "
          "tensorshm.to_numpy) stay valid and hold the lease until they go. Any later use of "
          "this object raises ReleasedError. The one exception: a non-owning DLTensor view "
          "taken through the C exchange API's dltensor_from_py_object_no_sync is valid only "
          "while the object is alive and not released, so don't release a tensor in one thread "
          "while a C consumer works on such a view of it in another.")
      .def_prop_ro(
          "released", [](const PyTensor& t) { return t.storage == nullptr; },
          "Whether release() was called (or the tensor's with block ended).")
      // numpy swallows a buffer protocol error and makes an object array instead; an error
      // from __array_interface__ (tried next) it raises. So a released tensor raises
      // ReleasedError from np.asarray too; a live one has no such attribute (AttributeError).
      .def_prop_ro("__array_interface__",
                   [](const PyTensor& t) -> nb::object {
                     Live(t);
                     throw nb::attribute_error("__array_interface__");
                   })
      .def(
          "__enter__", [](nb::handle self) { return nb::borrow(self); },
          nb::sig("def __enter__(self) -> typing_extensions.Self"))
      .def(
          "__exit__", [](PyTensor& t, nb::handle, nb::handle, nb::handle) { t.storage.reset(); },
          nb::arg().none(), nb::arg().none(), nb::arg().none())
      .def("__repr__", [](nb::handle self) {
        const PyTensor& t = nb::cast<const PyTensor&>(self);
        if (t.storage == nullptr) {
          return absl::StrCat(
              "tensorshm.", nb::isinstance<PyWritableTensor>(self) ? "WritableTensor" : "Tensor",
              "(", t.name.empty() ? "" : absl::StrCat("name='", t.name, "', "), "released)");
        }
        const Storage& s = *t.storage;
        return absl::StrCat(
            "tensorshm.",
            s.writable.has_value() && !s.writable->published() ? "WritableTensor" : "Tensor", "(",
            t.name.empty() ? "" : absl::StrCat("name='", t.name, "', "), "shape=(",
            absl::StrJoin(s.shape, ", "), s.shape.size() == 1 ? ",)" : ")", ", dtype='",
            DataTypeName(s.tensor.dtype), "', device='", DeviceName(s.tensor.device),
            "', read_only=", (s.flags & DLPACK_FLAG_BITMASK_READ_ONLY) ? "True" : "False", ")");
      });
  // The DLPack 1.3 C exchange API, on the type (consumers look it up on type(obj)).
  tensor.attr("__dlpack_c_exchange_api__") = nb::steal(
      PyCapsule_New(const_cast<DLPackExchangeAPI*>(ExchangeApi()), "dlpack_exchange_api", nullptr));
  DefineArrowExports(tensor);

  nb::class_<PyWritableTensor, PyTensor>(m, "WritableTensor",
                                         "A tensor being filled; publish() seals it.")
      .def("publish", &PublishWritable, "name"_a, "replace"_a = false)
      .def_prop_ro("published", [](const PyWritableTensor& t) {
        const std::shared_ptr<Storage>& storage = Live(t);
        return !storage->writable.has_value() || storage->writable->published();
      });
}

}  // namespace tensorshm::python
