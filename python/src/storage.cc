#include "storage.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/interop.h"
#include "common/tensor/dtype.h"

namespace tensorshm::python {

Storage::~Storage() {
  if (versioned != nullptr && versioned->deleter != nullptr) versioned->deleter(versioned);
  if (legacy != nullptr && legacy->deleter != nullptr) legacy->deleter(legacy);
  writable.reset();  // frees the buffer if it was never published
}

StorageSpan SpanOf(const DLTensor& tensor, bool subbyte_padded) {
  const char* element0 = static_cast<const char*>(tensor.data) + tensor.byte_offset;
  int64_t numel = 1;
  for (int i = 0; i < tensor.ndim; ++i) numel *= tensor.shape[i];
  if (numel == 0) return {element0, 0, 0};
  const int64_t bits = ElementBits(tensor.dtype);
  if (bits % 8 != 0 && !subbyte_padded) {
    // Packed sub-byte tensors are contiguous by definition.
    return {element0, (numel * bits + 7) / 8, 0};
  }
  const int64_t item = subbyte_padded ? 1 : bits / 8;
  int64_t low = 0;
  int64_t high = 0;
  int64_t step = 1;
  for (int i = tensor.ndim - 1; i >= 0; --i) {
    const int64_t stride = tensor.strides != nullptr ? tensor.strides[i] : step;
    step *= tensor.shape[i];
    const int64_t reach = (tensor.shape[i] - 1) * stride;
    (reach < 0 ? low : high) += reach;
  }
  return {element0 + low * item, (high - low + 1) * item, -low * item};
}

namespace {

// Every export: the DLPack struct handed out, what keeps its memory alive, and, for copies,
// the private buffer.
struct Export {
  DLManagedTensorVersioned versioned{};
  DLManagedTensor legacy{};
  std::shared_ptr<Storage> storage;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  void* copy = nullptr;
};

void FreeExport(Export* e) noexcept {
  std::free(e->copy);
  delete e;  // drops the storage reference: possibly the last, which gives back the lease
}

void DeleteVersioned(DLManagedTensorVersioned* self) noexcept {
  if (self != nullptr) FreeExport(static_cast<Export*>(self->manager_ctx));
}

void DeleteLegacy(DLManagedTensor* self) noexcept {
  if (self != nullptr) FreeExport(static_cast<Export*>(self->manager_ctx));
}

absl::StatusOr<Export*> MakeExport(const std::shared_ptr<Storage>& storage, bool copy) {
  auto* e = new Export;
  e->storage = storage;
  e->shape = storage->shape;
  e->strides = storage->strides;
  DLTensor tensor = storage->tensor;
  tensor.shape = e->shape.data();
  tensor.strides = e->strides.data();
  uint64_t flags = storage->flags;
  if (copy) {
    const bool padded = (flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
    const StorageSpan span = SpanOf(storage->tensor, padded);
    // 256-byte aligned like tensorshm's own buffers; aligned_alloc wants a multiple of it.
    const size_t size = static_cast<size_t>((span.nbytes + 255) / 256 * 256);
    e->copy = std::aligned_alloc(256, size == 0 ? 256 : size);
    if (e->copy == nullptr) {
      FreeExport(e);
      return absl::ResourceExhaustedError(
          absl::StrCat("a private host copy of ", span.nbytes, " bytes: out of memory"));
    }
    if (span.nbytes > 0 && tensor.device.device_type == kDLCUDA) {
      absl::Status copied =
          storage->lease
              ? CopyToHost(storage->versioned, span.start, e->copy, span.nbytes)
              : absl::FailedPreconditionError("only acquired CUDA tensors can be copied to host");
      if (!copied.ok()) {
        FreeExport(e);
        return copied;
      }
    } else if (span.nbytes > 0) {
      std::memcpy(e->copy, span.start, span.nbytes);
    }
    // A private copy owes nothing to the source: dropping the storage here gives its lease back
    // as soon as the tensor goes, however long the consumer keeps the copy.
    e->storage.reset();
    tensor.data = e->copy;
    tensor.device = DLDevice{kDLCPU, 0};
    tensor.byte_offset = static_cast<uint64_t>(span.element0);
    flags = (flags & ~uint64_t{DLPACK_FLAG_BITMASK_READ_ONLY}) | DLPACK_FLAG_BITMASK_IS_COPIED;
  }
  e->versioned.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
  e->versioned.manager_ctx = e;
  e->versioned.deleter = DeleteVersioned;
  e->versioned.flags = flags;
  e->versioned.dl_tensor = tensor;
  e->legacy.manager_ctx = e;
  e->legacy.deleter = DeleteLegacy;
  e->legacy.dl_tensor = tensor;
  return e;
}

}  // namespace

absl::Status Storage::LeaseStatus() const {
  if (lease) return LeaseStatusOf(versioned);
  if (versioned != nullptr && versioned->deleter == DeleteVersioned) {
    // One of our exports, back through the exchange API: its storage holds what keeps it.
    // A private copy (no storage) is alive on its own.
    const Export* e = static_cast<const Export*>(versioned->manager_ctx);
    return e->storage != nullptr ? e->storage->LeaseStatus() : absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::StatusOr<DLManagedTensorVersioned*> ExportVersioned(const std::shared_ptr<Storage>& storage,
                                                          bool copy) {
  absl::StatusOr<Export*> e = MakeExport(storage, copy);
  if (!e.ok()) return e.status();
  return &(*e)->versioned;
}

absl::StatusOr<DLManagedTensor*> ExportLegacy(const std::shared_ptr<Storage>& storage, bool copy) {
  absl::StatusOr<Export*> e = MakeExport(storage, copy);
  if (!e.ok()) return e.status();
  return &(*e)->legacy;
}

std::shared_ptr<Storage> FromLease(DLManagedTensorVersioned* lease) {
  auto storage = std::make_shared<Storage>();
  storage->versioned = lease;
  storage->lease = true;
  storage->tensor = lease->dl_tensor;  // shape/strides stay owned by the lease
  storage->flags = lease->flags;
  storage->shape.assign(lease->dl_tensor.shape, lease->dl_tensor.shape + lease->dl_tensor.ndim);
  storage->strides.assign(lease->dl_tensor.strides,
                          lease->dl_tensor.strides + lease->dl_tensor.ndim);
  storage->tensor.shape = storage->shape.data();
  storage->tensor.strides = storage->strides.data();
  return storage;
}

std::shared_ptr<Storage> FromWritable(WritableTensor tensor) {
  auto storage = std::make_shared<Storage>();
  storage->tensor = tensor.dl_tensor();
  storage->shape.assign(storage->tensor.shape, storage->tensor.shape + storage->tensor.ndim);
  storage->strides.assign(storage->tensor.strides, storage->tensor.strides + storage->tensor.ndim);
  storage->tensor.shape = storage->shape.data();
  storage->tensor.strides = storage->strides.data();
  storage->flags = tensor.dlpack_flags();
  // The writable tensor stays in the storage, past publish: it keeps its segment's mapping, so
  // that views taken before publish stay valid after it.
  storage->writable.emplace(std::move(tensor));
  return storage;
}

}  // namespace tensorshm::python
