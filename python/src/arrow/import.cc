#include "arrow/import.h"

#include <nanobind/stl/string.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "arrow/abi.h"
#include "arrow/metadata.h"
#include "client/interop.h"
#include "dlpack_export.h"
#include "raise_status.h"

namespace nb = nanobind;

namespace tensorshm::python {
namespace {

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
  absl::StatusOr<ExtensionParams> parsed = ParseExtensionParams(params);
  if (!parsed.ok()) return fail(parsed.status());
  const ExtensionParams& parser = *parsed;
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

void DefineArrowImport(nb::class_<PyClient>& client) {
  using namespace nb::literals;
  client.def("arrow_to_dlpack", &ArrowToDLPack, "schema"_a, "array"_a);
}

}  // namespace tensorshm::python
