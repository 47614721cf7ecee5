#include "arrow/export.h"

#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "arrow/abi.h"
#include "arrow/metadata.h"
#include "client/interop.h"
#include "common/tensor/dtype.h"
#include "common/tensor/wire.h"
#include "raise_status.h"
#include "storage.h"

namespace nb = nanobind;

namespace tensorshm::python {
namespace {

constexpr char kUseDLPack[] =
    "; share it through DLPack instead (np.from_dlpack(t), torch.from_dlpack(t))";

// What an exported ArrowSchema's private_data owns: the strings its fields point at and its one
// child (whose strings are static, so that a consumer may move the child out on its own).
struct SchemaPrivate {
  std::string format;    // "+w:N"
  std::string metadata;  // the encoded extension name and parameters
  ArrowSchema child{};
  ArrowSchema* children[1] = {&child};
};

void ReleaseChildSchema(ArrowSchema* schema) noexcept { schema->release = nullptr; }

void ReleaseSchema(ArrowSchema* schema) noexcept {
  auto* owned = static_cast<SchemaPrivate*>(schema->private_data);
  if (owned->child.release != nullptr) owned->child.release(&owned->child);
  delete owned;
  schema->release = nullptr;
}

// An exported ArrowArray's private_data: its buffer pointers and the storage that keeps the
// memory (and the lease) alive. The parent's and the child's are separate, so that either may
// be moved out and released on its own. Freed in the release callback, on any thread, without
// the GIL: Storage is safe to destroy there.
struct ArrayPrivate {
  std::shared_ptr<Storage> storage;
  const void* buffers[2] = {nullptr, nullptr};
  ArrowArray child{};
  ArrowArray* children[1] = {&child};
};

void ReleaseArray(ArrowArray* array) noexcept {
  auto* owned = static_cast<ArrayPrivate*>(array->private_data);
  if (array->n_children == 1 && owned->child.release != nullptr) {
    owned->child.release(&owned->child);
  }
  delete owned;
  array->release = nullptr;
}

// The checks every export makes. `what` names the tensor in messages.
absl::Status CheckExportable(const Storage& storage, absl::string_view what) {
  const DLTensor& t = storage.tensor;
  if (ArrowFormat(t.dtype) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has dtype = ", DataTypeName(t.dtype),
                                                   ": ", WhyNoArrowType(t.dtype), kUseDLPack));
  }
  if (t.ndim == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     " is 0-d (shape = ()): arrow.fixed_shape_tensor arrays have a first dimension "
                     "(the array's length); reshape it to (1,)",
                     kUseDLPack));
  }
  int64_t numel = 1;
  for (int i = 0; i < t.ndim; ++i) numel *= t.shape[i];
  if (numel == 0) return absl::OkStatus();
  int64_t step = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != step) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has strides = (", absl::StrJoin(storage.strides, ", "), ") for shape = (",
          absl::StrJoin(storage.shape, ", "),
          "): Arrow arrays are C-contiguous; copy it into a contiguous tensor first", kUseDLPack));
    }
    step *= t.shape[i];
  }
  return absl::OkStatus();
}

// The ArrowSchema of `storage`'s tensor (checked by CheckExportable).
ArrowSchema* NewSchema(const Storage& storage) {
  const std::vector<int64_t>& shape = storage.shape;
  int64_t list_size = 1;
  for (size_t i = 1; i < shape.size(); ++i) list_size *= shape[i];
  auto* owned = new SchemaPrivate;
  owned->format = absl::StrCat("+w:", list_size);
  // Per the canonical extension, "shape" is the shape of one element: the tensor's shape[1:].
  const std::string params =
      FormatExtensionParams(std::vector<int64_t>(shape.begin() + 1, shape.end()));
  owned->metadata = EncodeMetadata({{kNameKey, kExtensionName}, {kMetadataKey, params}});
  ArrowSchema& child = owned->child;
  child.format = ArrowFormat(storage.tensor.dtype);
  child.name = "item";
  child.flags = ARROW_FLAG_NULLABLE;
  child.release = ReleaseChildSchema;
  auto* schema = new ArrowSchema{};
  schema->format = owned->format.c_str();
  schema->name = "";
  schema->metadata = owned->metadata.c_str();
  schema->flags = ARROW_FLAG_NULLABLE;
  schema->n_children = 1;
  schema->children = owned->children;
  schema->release = ReleaseSchema;
  schema->private_data = owned;
  return schema;
}

// Fills `array` with a view of `storage`'s tensor that holds `storage` until released.
void FillArray(const std::shared_ptr<Storage>& storage, ArrowArray* array) {
  const DLTensor& t = storage->tensor;
  int64_t list_size = 1;
  for (int i = 1; i < t.ndim; ++i) list_size *= t.shape[i];
  auto* child_owned = new ArrayPrivate;
  child_owned->storage = storage;
  child_owned->buffers[1] = static_cast<const char*>(t.data) + t.byte_offset;  // element [0,..]
  auto* owned = new ArrayPrivate;
  owned->storage = storage;
  ArrowArray& child = owned->child;
  child.length = t.shape[0] * list_size;
  child.n_buffers = 2;  // validity (none), values
  child.buffers = child_owned->buffers;
  child.release = ReleaseArray;
  child.private_data = child_owned;
  *array = ArrowArray{};
  array->length = t.shape[0];
  array->n_buffers = 1;  // validity (none)
  array->buffers = owned->buffers;
  array->n_children = 1;
  array->children = owned->children;
  array->release = ReleaseArray;
  array->private_data = owned;
}

// Capsule destructors: release what the consumer did not move out (release != NULL), then free
// the struct the capsule points at.
void DestroySchemaCapsule(PyObject* capsule) {
  auto* schema = static_cast<ArrowSchema*>(PyCapsule_GetPointer(capsule, kSchemaCapsule));
  if (schema == nullptr) {
    PyErr_WriteUnraisable(capsule);
    return;
  }
  if (schema->release != nullptr) schema->release(schema);
  delete schema;
}

void DestroyArrayCapsule(PyObject* capsule) {
  auto* array = static_cast<ArrowArray*>(PyCapsule_GetPointer(capsule, kArrayCapsule));
  if (array == nullptr) {
    PyErr_WriteUnraisable(capsule);
    return;
  }
  if (array->release != nullptr) array->release(array);
  delete array;
}

void DestroyDeviceArrayCapsule(PyObject* capsule) {
  auto* array = static_cast<ArrowDeviceArray*>(PyCapsule_GetPointer(capsule, kDeviceArrayCapsule));
  if (array == nullptr) {
    PyErr_WriteUnraisable(capsule);
    return;
  }
  if (array->array.release != nullptr) array->array.release(&array->array);
  delete array;
}

nb::object SchemaCapsule(const Storage& storage) {
  ArrowSchema* schema = NewSchema(storage);
  PyObject* capsule = PyCapsule_New(schema, kSchemaCapsule, DestroySchemaCapsule);
  if (capsule == nullptr) {
    schema->release(schema);
    delete schema;
    throw nb::python_error();
  }
  return nb::steal(capsule);
}

// requested_schema: conversion to it is best-effort per the PyCapsule interface; a tensor has
// one Arrow type, so any request gets that type (the consumer checks what it got).
void CheckRequestedSchema(nb::handle requested_schema) {
  if (!requested_schema.is_none() && !PyCapsule_IsValid(requested_schema.ptr(), kSchemaCapsule)) {
    throw nb::type_error("requested_schema must be None or a PyCapsule named \"arrow_schema\"");
  }
}

nb::object ArrowCSchema(const PyTensor& self) {
  const Storage& storage = *Live(self);
  Check(CheckExportable(storage, Describe(self)));
  return SchemaCapsule(storage);
}

nb::tuple ArrowCArray(const PyTensor& self, nb::handle requested_schema) {
  CheckRequestedSchema(requested_schema);
  // A copy holding the storage: a release() in another thread while the GIL is let go cannot
  // free it.
  const std::shared_ptr<Storage> pinned = Live(self);
  const Storage& storage = *pinned;
  Check(CheckExportable(storage, Describe(self)));
  if (storage.tensor.device.device_type != kDLCPU) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat(Describe(self), " is on ", DeviceName(storage.tensor.device),
                     ": __arrow_c_array__ exports host memory only; use "
                     "__arrow_c_device_array__ (e.g. pyarrow.cuda, or a consumer of the C Device "
                     "Data Interface), or copy it to the host first")));
  }
  nb::object schema = SchemaCapsule(storage);
  auto* array = new ArrowArray{};
  FillArray(pinned, array);
  PyObject* capsule = PyCapsule_New(array, kArrayCapsule, DestroyArrayCapsule);
  if (capsule == nullptr) {
    array->release(array);
    delete array;
    throw nb::python_error();
  }
  return nb::make_tuple(schema, nb::steal(capsule));
}

nb::tuple ArrowCDeviceArray(const PyTensor& self, nb::handle requested_schema, nb::kwargs kwargs) {
  // The PyCapsule interface: keywords a later version of it adds default to None, and a producer
  // that does not know one must refuse any other value.
  std::vector<std::string> unknown;
  for (auto [key, value] : kwargs) {
    if (!value.is_none()) unknown.push_back(nb::cast<std::string>(nb::str(key)));
  }
  if (!unknown.empty()) {
    PyErr_SetString(PyExc_NotImplementedError,
                    absl::StrCat("__arrow_c_device_array__: unsupported keyword argument(s) ",
                                 absl::StrJoin(unknown, ", "), " (only None is accepted for them)")
                        .c_str());
    throw nb::python_error();
  }
  CheckRequestedSchema(requested_schema);
  // A copy holding the storage: a release() in another thread while the GIL is let go cannot
  // free it.
  const std::shared_ptr<Storage> pinned = Live(self);
  const Storage& storage = *pinned;
  Check(CheckExportable(storage, Describe(self)));
  const DLDevice device = storage.tensor.device;
  const void* sync_event = nullptr;
  if (device.device_type == kDLCUDA && storage.lease) {
    // The ready event the producer recorded at publish: the consumer waits on it (a CUevent*).
    absl::StatusOr<const void*> event;
    {
      ReleaseGil release;
      event = ReadyEvent(storage.versioned);
    }
    sync_event = Check(std::move(event));
  } else if (device.device_type != kDLCPU && device.device_type != kDLCUDA) {
    Raise(absl::InvalidArgumentError(absl::StrCat(Describe(self), " is on ", DeviceName(device),
                                                  ", which Arrow's device types do not name")));
  }
  nb::object schema = SchemaCapsule(storage);
  auto* array = new ArrowDeviceArray{};
  FillArray(pinned, &array->array);
  if (device.device_type == kDLCUDA) {
    array->device_type = ARROW_DEVICE_CUDA;
    array->device_id = device.device_id;
  } else {
    array->device_type = ARROW_DEVICE_CPU;
    array->device_id = -1;  // the spec's convention for devices without ids
  }
  array->sync_event = const_cast<void*>(sync_event);
  PyObject* capsule = PyCapsule_New(array, kDeviceArrayCapsule, DestroyDeviceArrayCapsule);
  if (capsule == nullptr) {
    array->array.release(&array->array);
    delete array;
    throw nb::python_error();
  }
  return nb::make_tuple(schema, nb::steal(capsule));
}

}  // namespace

void DefineArrowExports(nb::class_<PyTensor>& tensor) {
  using namespace nb::literals;
  tensor
      .def("__arrow_c_schema__", &ArrowCSchema,
           "The Arrow type of this tensor, an \"arrow_schema\" PyCapsule: the canonical extension "
           "type arrow.fixed_shape_tensor (storage FixedSizeList<T>[prod(shape[1:])], extension "
           "metadata {\"shape\": shape[1:]}).")
      .def("__arrow_c_array__", &ArrowCArray, "requested_schema"_a = nb::none(),
           nb::sig("def __arrow_c_array__(self, requested_schema: object | None = None) -> "
                   "tuple[object, object]"),
           "This host tensor as an Arrow array of arrow.fixed_shape_tensor of length shape[0] "
           "(\"arrow_schema\", \"arrow_array\" PyCapsules), zero-copy: the array holds the "
           "tensor's lease until Arrow releases it. C-contiguous tensors of int, uint and float "
           "dtypes of 8 to 64 bits with at least one dimension; CUDA tensors export through "
           "__arrow_c_device_array__. requested_schema is best-effort and ignored.")
      .def("__arrow_c_device_array__", &ArrowCDeviceArray, "requested_schema"_a = nb::none(),
           "kwargs"_a,
           nb::sig("def __arrow_c_device_array__(self, requested_schema: object | None = None, "
                   "**kwargs: object) -> tuple[object, object]"),
           "As __arrow_c_array__, as an Arrow C Device Data Interface array (\"arrow_schema\", "
           "\"arrow_device_array\" PyCapsules): host tensors as ARROW_DEVICE_CPU, CUDA tensors as "
           "ARROW_DEVICE_CUDA with this process's device id and sync_event pointing at the "
           "producer's ready event (a CUevent*), which consumers wait on before reading. Other "
           "keywords: None only (NotImplementedError otherwise), as the PyCapsule interface "
           "says.");
}

}  // namespace tensorshm::python
