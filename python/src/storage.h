// What a Python tensor object and every DLPack export of it share: the memory and what keeps it
// valid (a lease, a foreign DLPack tensor, or an unpublished buffer with its writable mapping).
#ifndef TENSORSHM_PYTHON_STORAGE_H_
#define TENSORSHM_PYTHON_STORAGE_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tensorshm/client.h"

namespace tensorshm::python {

// Thread-safe to destroy from any thread, with or without the GIL: destruction queues a lease
// release, calls a foreign deleter (which takes the GIL itself if it needs it), or drops a mapping.
struct Storage {
  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage();

  // Exactly one of these owns the memory `tensor` describes (a published `writable` keeps its
  // segment's mapping, and `versioned` its lease).
  DLManagedTensorVersioned* versioned = nullptr;  // an acquired lease, or a foreign tensor
  DLManagedTensor* legacy = nullptr;              // a foreign pre-1.0 tensor
  std::optional<WritableTensor> writable;         // unpublished (or just published) buffer

  DLTensor tensor{};           // what exports describe; shape/strides point below or into
  std::vector<int64_t> shape;  // the owner above
  std::vector<int64_t> strides;
  uint64_t flags = 0;  // DLPack flags exports carry: READ_ONLY, IS_SUBBYTE_TYPE_PADDED
  bool lease = false;  // `versioned` is a tensorshm lease (WaitReady / CopyToHost apply)

  // Whether the memory is still reserved for this tensor, as tensorshm::LeaseStatus says of the
  // lease behind it (its own, or, for an export of ours that came back through the exchange API,
  // the exported storage's): OK while the daemon holds it, DATA_LOSS once a restarted daemon did
  // not take it back, FAILED_PRECONDITION in a forked child. OK when no lease is behind it
  // (unpublished buffers, foreign tensors). Takes no GIL and does no I/O.
  absl::Status LeaseStatus() const;
};

// The storage span of `tensor`: the lowest byte any element occupies, and how many bytes from
// there the elements reach. `element0` is the offset of element [0, ..., 0] from `start`.
struct StorageSpan {
  const char* start = nullptr;
  int64_t nbytes = 0;
  int64_t element0 = 0;
};
StorageSpan SpanOf(const DLTensor& tensor, bool subbyte_padded);

// A new DLManagedTensorVersioned viewing `storage` (flags as storage->flags), or a private host
// copy of its bytes when `copy` (flags IS_COPIED, writable; a CUDA lease is copied to the host
// after its ready event; the copy keeps no reference to `storage`, so holds no lease). Its deleter
// is noexcept, needs no GIL. Errors only from copying.
absl::StatusOr<DLManagedTensorVersioned*> ExportVersioned(const std::shared_ptr<Storage>& storage,
                                                          bool copy);
// The same as a pre-1.0 DLManagedTensor (no flags: the caller checks writability).
absl::StatusOr<DLManagedTensor*> ExportLegacy(const std::shared_ptr<Storage>& storage, bool copy);

// Storage owning `lease` (an acquired tensorshm lease; its deleter runs when the storage goes).
std::shared_ptr<Storage> FromLease(DLManagedTensorVersioned* lease);
// Storage owning the unpublished `tensor` (kept past publish: its mapping keeps views taken
// before publish valid).
std::shared_ptr<Storage> FromWritable(WritableTensor tensor);

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_STORAGE_H_
