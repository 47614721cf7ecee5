#include "arrow.h"

#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "arrow_abi.h"
#include "client/interop.h"
#include "common/tensor/dtype.h"
#include "common/tensor/wire.h"
#include "raise_status.h"
#include "storage.h"

namespace nb = nanobind;

namespace tensorshm::python {
namespace {

constexpr char kSchemaCapsule[] = "arrow_schema";
constexpr char kArrayCapsule[] = "arrow_array";
constexpr char kDeviceArrayCapsule[] = "arrow_device_array";
constexpr char kVersioned[] = "dltensor_versioned";
constexpr char kExtensionName[] = "arrow.fixed_shape_tensor";
constexpr char kNameKey[] = "ARROW:extension:name";
constexpr char kMetadataKey[] = "ARROW:extension:metadata";
constexpr char kUseDLPack[] =
    "; share it through DLPack instead (np.from_dlpack(t), torch.from_dlpack(t))";

// ---- the type: arrow.fixed_shape_tensor over FixedSizeList<T> ----

// The Arrow format string of a tensorshm element type, or nullptr when Arrow has no primitive
// with the same bytes.
const char* ArrowFormat(const DLDataType& dtype) {
  if (dtype.lanes != 1) return nullptr;
  switch (dtype.code) {
    case kDLInt:
      switch (dtype.bits) {
        case 8:
          return "c";
        case 16:
          return "s";
        case 32:
          return "i";
        case 64:
          return "l";
      }
      return nullptr;
    case kDLUInt:
      switch (dtype.bits) {
        case 8:
          return "C";
        case 16:
          return "S";
        case 32:
          return "I";
        case 64:
          return "L";
      }
      return nullptr;
    case kDLFloat:
      switch (dtype.bits) {
        case 16:
          return "e";
        case 32:
          return "f";
        case 64:
          return "g";
      }
      return nullptr;
  }
  return nullptr;
}

// The tensorshm element type of an Arrow primitive format string.
absl::StatusOr<DLDataType> DataTypeOfFormat(absl::string_view format) {
  static constexpr struct {
    const char* format;
    uint8_t code;
    uint8_t bits;
  } kTypes[] = {{"c", kDLInt, 8},    {"s", kDLInt, 16},   {"i", kDLInt, 32},  {"l", kDLInt, 64},
                {"C", kDLUInt, 8},   {"S", kDLUInt, 16},  {"I", kDLUInt, 32}, {"L", kDLUInt, 64},
                {"e", kDLFloat, 16}, {"f", kDLFloat, 32}, {"g", kDLFloat, 64}};
  for (const auto& type : kTypes) {
    if (format == type.format) return DLDataType{type.code, type.bits, 1};
  }
  return absl::InvalidArgumentError(
      absl::StrCat("the tensor's value type has Arrow format \"", format,
                   "\": put() takes int8..int64, uint8..uint64 and float16/32/64 values"));
}

// Why `dtype` has no Arrow export, for the error message.
std::string WhyNoArrowType(const DLDataType& dtype) {
  if (dtype.lanes != 1) return "vector elements (lanes != 1) have no Arrow primitive type";
  if (dtype.code == kDLBool) {
    return "Arrow booleans are bit-packed, tensorshm's take a byte each, so no zero-copy view "
           "exists";
  }
  if (dtype.code == kDLComplex) return "Arrow has no complex type";
  if (ElementBits(dtype) < 8) return "Arrow has no sub-byte numeric type";
  return "Arrow has no primitive type with these bytes";
}

// The Arrow C Data Interface's metadata encoding: int32 count, then int32-length-prefixed keys
// and values, in native byte order.
std::string EncodeMetadata(const std::vector<std::pair<std::string, std::string>>& pairs) {
  std::string out;
  auto put_int = [&out](int32_t value) {
    out.append(reinterpret_cast<const char*>(&value), sizeof(value));
  };
  put_int(static_cast<int32_t>(pairs.size()));
  for (const auto& [key, value] : pairs) {
    put_int(static_cast<int32_t>(key.size()));
    out += key;
    put_int(static_cast<int32_t>(value.size()));
    out += value;
  }
  return out;
}

// The metadata's pairs; an empty list for NULL. INVALID_ARGUMENT if it overruns itself (the
// encoding carries no total length: a producer's bad count is caught by negative lengths only).
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> DecodeMetadata(
    const char* metadata) {
  std::vector<std::pair<std::string, std::string>> pairs;
  if (metadata == nullptr) return pairs;
  auto get_int = [&metadata]() {
    int32_t value;
    std::memcpy(&value, metadata, sizeof(value));
    metadata += sizeof(value);
    return value;
  };
  const int32_t count = get_int();
  if (count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("schema metadata: count = ", count));
  }
  for (int32_t i = 0; i < count; ++i) {
    std::string parts[2];
    for (std::string& part : parts) {
      const int32_t length = get_int();
      if (length < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("schema metadata: pair ", i, " has length ", length));
      }
      part.assign(metadata, static_cast<size_t>(length));
      metadata += length;
    }
    pairs.emplace_back(std::move(parts[0]), std::move(parts[1]));
  }
  return pairs;
}

// ---- the extension metadata's JSON: {"shape": [...], "dim_names": [...], "permutation": [...]}

// Just enough JSON for the extension's parameters: an object whose values are read when they
// are arrays of integers, skipped otherwise.
class ParamsParser {
 public:
  explicit ParamsParser(absl::string_view text) : text_(text) {}

  // Reads the object; `shape` and `permutation` get the arrays of those keys (`has_*` say
  // whether they were there).
  absl::Status Parse() {
    Skip();
    if (!Eat('{')) return Error("expected '{'");
    Skip();
    if (Eat('}')) return absl::OkStatus();
    while (true) {
      Skip();
      std::string key;
      if (absl::Status s = String(&key); !s.ok()) return s;
      Skip();
      if (!Eat(':')) return Error("expected ':'");
      Skip();
      if (key == "shape" || key == "permutation") {
        std::vector<int64_t>& out = key == "shape" ? shape : permutation;
        (key == "shape" ? has_shape : has_permutation) = true;
        if (absl::Status s = Integers(&out, key); !s.ok()) return s;
      } else if (absl::Status s = SkipValue(0); !s.ok()) {
        return s;
      }
      Skip();
      if (Eat('}')) break;
      if (!Eat(',')) return Error("expected ',' or '}'");
    }
    Skip();
    if (pos_ != text_.size()) return Error("text after the object");
    return absl::OkStatus();
  }

  std::vector<int64_t> shape;
  std::vector<int64_t> permutation;
  bool has_shape = false;
  bool has_permutation = false;

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("ARROW:extension:metadata = '", text_, "': ", what, " at offset ", pos_));
  }
  void Skip() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool Eat(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  absl::Status String(std::string* out) {
    if (!Eat('"')) return Error("expected a string");
    while (pos_ < text_.size() && text_[pos_] != '"') {
      if (text_[pos_] == '\\') ++pos_;  // escapes: kept raw, only keys we know are compared
      if (pos_ < text_.size()) out->push_back(text_[pos_++]);
    }
    if (!Eat('"')) return Error("unterminated string");
    return absl::OkStatus();
  }
  absl::Status Integers(std::vector<int64_t>* out, absl::string_view key) {
    if (!Eat('[')) return Error(absl::StrCat("\"", key, "\" must be an array of integers"));
    Skip();
    if (Eat(']')) return absl::OkStatus();
    while (true) {
      Skip();
      const size_t start = pos_;
      while (pos_ < text_.size() &&
             (text_[pos_] == '-' || (text_[pos_] >= '0' && text_[pos_] <= '9'))) {
        ++pos_;
      }
      int64_t value;
      if (!absl::SimpleAtoi(text_.substr(start, pos_ - start), &value)) {
        return Error(absl::StrCat("\"", key, "\" must be an array of integers"));
      }
      out->push_back(value);
      Skip();
      if (Eat(']')) return absl::OkStatus();
      if (!Eat(',')) return Error("expected ',' or ']'");
    }
  }
  absl::Status SkipValue(int depth) {
    if (depth > 16) return Error("nested too deep");
    Skip();
    if (pos_ >= text_.size()) return Error("expected a value");
    const char c = text_[pos_];
    if (c == '"') {
      std::string ignored;
      return String(&ignored);
    }
    if (c == '[' || c == '{') {
      const char close = c == '[' ? ']' : '}';
      ++pos_;
      Skip();
      if (Eat(close)) return absl::OkStatus();
      while (true) {
        if (c == '{') {
          std::string ignored;
          Skip();
          if (absl::Status s = String(&ignored); !s.ok()) return s;
          Skip();
          if (!Eat(':')) return Error("expected ':'");
        }
        if (absl::Status s = SkipValue(depth + 1); !s.ok()) return s;
        Skip();
        if (Eat(close)) return absl::OkStatus();
        if (!Eat(',')) return Error("expected ','");
      }
    }
    // A number or a literal.
    const size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] != ',' && text_[pos_] != '}' && text_[pos_] != ']' &&
           text_[pos_] != ' ') {
      ++pos_;
    }
    if (pos_ == start) return Error("expected a value");
    return absl::OkStatus();
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

// ---- export ----

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
      absl::StrCat("{\"shape\":[", absl::StrJoin(shape.begin() + 1, shape.end(), ","), "]}");
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

std::string Describe(const PyTensor& t) {
  return t.name.empty() ? std::string("tensor") : absl::StrCat("tensor \"", t.name, "\"");
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

// ---- import ----

// What the DLPack view of an imported Arrow array owns: the array (moved out of its capsule),
// released with the view.
struct ImportedArray {
  DLManagedTensorVersioned managed{};
  ArrowArray array{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

void DeleteImported(DLManagedTensorVersioned* self) noexcept {
  if (self == nullptr) return;
  auto* imported = static_cast<ImportedArray*>(self->manager_ctx);
  if (imported->array.release != nullptr) imported->array.release(&imported->array);
  delete imported;
}

void DestroyVersionedCapsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kVersioned)) {
    auto* managed =
        static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, kVersioned));
    if (managed->deleter != nullptr) managed->deleter(managed);
  }
}

// How many of `length` validity bits from bit `offset` are 0 (nulls).
int64_t CountNulls(const void* bitmap, int64_t offset, int64_t length) {
  const auto* bytes = static_cast<const uint8_t*>(bitmap);
  int64_t nulls = 0;
  for (int64_t i = offset; i < offset + length; ++i) {
    if ((bytes[i / 8] & (1u << (i % 8))) == 0) ++nulls;
  }
  return nulls;
}

// Nulls in `array` (`what` names it), counted from its validity bitmap when the producer did not
// say (null_count -1); host memory only.
absl::Status CheckNoNulls(const ArrowArray& array, bool host, absl::string_view what) {
  if (array.n_buffers < 1 || array.buffers[0] == nullptr || array.null_count == 0) {
    return absl::OkStatus();
  }
  int64_t nulls = array.null_count;
  if (nulls < 0) {
    if (!host) {
      return absl::InvalidArgumentError(
          absl::StrCat(what,
                       " has a validity bitmap in device memory and an unknown null count: put() "
                       "takes arrays without nulls"));
    }
    nulls = CountNulls(array.buffers[0], array.offset, array.length);
    if (nulls == 0) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(what, " has ", nulls,
                                                 " null(s): a tensor has no nulls; fill them first "
                                                 "(e.g. pyarrow.compute.fill_null) or drop them"));
}

// The DLPack view of the Arrow array `array` (owned from here: released on every path) with
// schema `schema`, on `device`.
absl::StatusOr<DLManagedTensorVersioned*> ImportArray(const ArrowSchema& schema, ArrowArray array,
                                                      DLDevice device) {
  auto imported = std::make_unique<ImportedArray>();
  imported->array = array;  // released by DeleteImported from here
  imported->managed.manager_ctx = imported.get();
  imported->managed.deleter = DeleteImported;
  auto fail = [&](absl::Status status) -> absl::StatusOr<DLManagedTensorVersioned*> {
    DeleteImported(&imported.release()->managed);
    return status;
  };
  // The type.
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> metadata =
      DecodeMetadata(schema.metadata);
  if (!metadata.ok()) return fail(metadata.status());
  std::string extension = "none";
  std::string params;
  for (const auto& [key, value] : *metadata) {
    if (key == kNameKey) extension = absl::StrCat("\"", value, "\"");
    if (key == kMetadataKey) params = value;
  }
  const absl::string_view format = schema.format != nullptr ? schema.format : "";
  if (extension != absl::StrCat("\"", kExtensionName, "\"") || format.rfind("+w:", 0) != 0) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "the Arrow array has format \"", format, "\" and extension type ", extension,
        ": put() takes arrays of the canonical extension type arrow.fixed_shape_tensor "
        "(e.g. pyarrow.FixedShapeTensorArray.from_numpy_ndarray), or any DLPack producer")));
  }
  int64_t list_size = 0;
  if (!absl::SimpleAtoi(format.substr(3), &list_size) || list_size < 0) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("Arrow format \"", format, "\": not a fixed-size list's")));
  }
  if (schema.n_children != 1 || schema.children == nullptr || schema.children[0] == nullptr) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "Arrow schema of format \"", format, "\" has ", schema.n_children, " children, not 1")));
  }
  if (schema.children[0]->dictionary != nullptr || schema.dictionary != nullptr) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "Arrow schema of format \"", format,
        "\" is dictionary-encoded (a non-null dictionary): put() takes plain values; decode it "
        "first (e.g. pyarrow's dictionary_decode)")));
  }
  const char* child_format = schema.children[0]->format;
  absl::StatusOr<DLDataType> dtype = DataTypeOfFormat(child_format != nullptr ? child_format : "");
  if (!dtype.ok()) return fail(dtype.status());
  ParamsParser parser(params);
  if (absl::Status s = parser.Parse(); !s.ok()) return fail(s);
  if (!parser.has_shape) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("ARROW:extension:metadata = '", params, "': no \"shape\"")));
  }
  int64_t numel = 1;
  for (int64_t d : parser.shape) {
    if (d < 0) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "ARROW:extension:metadata shape = [", absl::StrJoin(parser.shape, ","), "]: negative")));
    }
    numel *= d;
  }
  if (numel != list_size) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "ARROW:extension:metadata shape = [", absl::StrJoin(parser.shape, ","), "] holds ", numel,
        " values, but the list size (format \"", format, "\") is ", list_size)));
  }
  if (parser.has_permutation) {
    for (size_t i = 0; i < parser.permutation.size(); ++i) {
      if (parser.permutation[i] != static_cast<int64_t>(i)) {
        return fail(absl::InvalidArgumentError(absl::StrCat(
            "ARROW:extension:metadata permutation = [", absl::StrJoin(parser.permutation, ","),
            "]: put() takes the identity permutation only (row-major values in logical order); "
            "permute the tensor first")));
      }
    }
  }
  // The data.
  const ArrowArray& list = imported->array;
  if (list.n_children != 1 || list.children == nullptr || list.children[0] == nullptr) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "Arrow array of format \"", format, "\" has ", list.n_children, " children, not 1")));
  }
  const ArrowArray& values = *list.children[0];
  const bool host = device.device_type != kDLCUDA;
  if (absl::Status s = CheckNoNulls(list, host, "the Arrow array"); !s.ok()) return fail(s);
  if (absl::Status s = CheckNoNulls(values, host, "the Arrow array's values"); !s.ok()) {
    return fail(s);
  }
  if (list.length < 0 || list.offset < 0 || values.offset < 0) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("Arrow array length = ", list.length, ", offset = ", list.offset,
                     ", values offset = ", values.offset, ": each must be >= 0")));
  }
  if (list.dictionary != nullptr || values.dictionary != nullptr) {
    return fail(absl::InvalidArgumentError(
        "the Arrow array has a dictionary (dictionary-encoded values): put() takes plain values"));
  }
  if (values.n_buffers != 2 || (values.buffers[1] == nullptr && list.length * list_size > 0)) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("the Arrow array's values have ", values.n_buffers,
                     " buffers (or no data buffer); a primitive array has 2")));
  }
  if ((list.offset + list.length) * list_size > values.length) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "Arrow array offset = ", list.offset, ", length = ", list.length, " of lists of ",
        list_size, " reaches past its values (length ", values.length, ")")));
  }
  const int64_t item = dtype->bits / 8;
  imported->shape.push_back(list.length);
  imported->shape.insert(imported->shape.end(), parser.shape.begin(), parser.shape.end());
  imported->strides.assign(imported->shape.size(), 1);
  for (size_t i = imported->shape.size() - 1; i > 0; --i) {
    imported->strides[i - 1] = imported->strides[i] * imported->shape[i];
  }
  DLTensor& tensor = imported->managed.dl_tensor;
  tensor.data = const_cast<void*>(values.buffers[1]);
  tensor.device = device;
  tensor.ndim = static_cast<int32_t>(imported->shape.size());
  tensor.dtype = *dtype;
  tensor.shape = imported->shape.data();
  tensor.strides = imported->strides.data();
  tensor.byte_offset = static_cast<uint64_t>((values.offset + list.offset * list_size) * item);
  imported->managed.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
  imported->managed.flags = DLPACK_FLAG_BITMASK_READ_ONLY;
  return &imported.release()->managed;
}

nb::object ArrowToDLPack(PyClient& self, nb::handle schema_capsule, nb::handle array_capsule) {
  const ClientRef client = Live(*self.state);
  if (!PyCapsule_IsValid(schema_capsule.ptr(), kSchemaCapsule)) {
    throw nb::type_error("schema: expected a PyCapsule named \"arrow_schema\"");
  }
  const auto* schema =
      static_cast<ArrowSchema*>(PyCapsule_GetPointer(schema_capsule.ptr(), kSchemaCapsule));
  ArrowArray* source = nullptr;
  DLDevice device{kDLCPU, 0};
  void* sync_event = nullptr;
  if (PyCapsule_IsValid(array_capsule.ptr(), kArrayCapsule)) {
    source = static_cast<ArrowArray*>(PyCapsule_GetPointer(array_capsule.ptr(), kArrayCapsule));
  } else if (PyCapsule_IsValid(array_capsule.ptr(), kDeviceArrayCapsule)) {
    auto* device_array = static_cast<ArrowDeviceArray*>(
        PyCapsule_GetPointer(array_capsule.ptr(), kDeviceArrayCapsule));
    source = &device_array->array;
    switch (device_array->device_type) {
      case ARROW_DEVICE_CPU:
        break;
      case ARROW_DEVICE_CUDA_HOST:
        device = DLDevice{kDLCUDAHost, 0};
        break;
      case ARROW_DEVICE_CUDA:
        device = DLDevice{kDLCUDA, static_cast<int32_t>(device_array->device_id)};
        sync_event = device_array->sync_event;
        break;
      default:
        Raise(absl::InvalidArgumentError(
            absl::StrCat("the Arrow device array has device_type = ", device_array->device_type,
                         ": put() takes CPU, CUDA host and CUDA arrays")));
    }
  } else {
    throw nb::type_error(
        "array: expected a PyCapsule named \"arrow_array\" or \"arrow_device_array\"");
  }
  if (schema->release == nullptr || source->release == nullptr) {
    Raise(absl::InvalidArgumentError(
        "the Arrow capsules were already consumed (released or moved out): export them again"));
  }
  // Moved out: the capsule's destructor leaves it alone; ImportArray releases it on every path.
  ArrowArray moved = *source;
  source->release = nullptr;
  if (sync_event != nullptr) {
    // put() copies on the legacy default stream: order it after the producer's writes.
    void* event = *static_cast<void**>(sync_event);
    absl::Status waited;
    {
      ReleaseGil release;
      waited = StreamWaitEvent(*client, device.device_id, kLegacyDefaultStream, event);
    }
    if (!waited.ok()) {
      moved.release(&moved);
      Raise(waited);
    }
  }
  DLManagedTensorVersioned* managed = Check(ImportArray(*schema, moved, device));
  PyObject* capsule = PyCapsule_New(managed, kVersioned, DestroyVersionedCapsule);
  if (capsule == nullptr) {
    managed->deleter(managed);
    throw nb::python_error();
  }
  return nb::steal(capsule);
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
           "This host tensor as an Arrow array of arrow.fixed_shape_tensor of length shape[0] "
           "(\"arrow_schema\", \"arrow_array\" PyCapsules), zero-copy: the array holds the "
           "tensor's lease until Arrow releases it. C-contiguous tensors of int, uint and float "
           "dtypes of 8 to 64 bits with at least one dimension; CUDA tensors export through "
           "__arrow_c_device_array__. requested_schema is best-effort and ignored.")
      .def("__arrow_c_device_array__", &ArrowCDeviceArray, "requested_schema"_a = nb::none(),
           "kwargs"_a,
           "As __arrow_c_array__, as an Arrow C Device Data Interface array (\"arrow_schema\", "
           "\"arrow_device_array\" PyCapsules): host tensors as ARROW_DEVICE_CPU, CUDA tensors as "
           "ARROW_DEVICE_CUDA with this process's device id and sync_event pointing at the "
           "producer's ready event (a CUevent*), which consumers wait on before reading. Other "
           "keywords: None only (NotImplementedError otherwise), as the PyCapsule interface "
           "says.");
}

void DefineArrowImport(nb::class_<PyClient>& client) {
  using namespace nb::literals;
  client.def("arrow_to_dlpack", &ArrowToDLPack, "schema"_a, "array"_a);
}

}  // namespace tensorshm::python
