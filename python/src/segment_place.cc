#include "segment_place.h"

#include <nanobind/stl/string.h>

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/interop.h"
#include "raise_status.h"
#include "storage.h"
#include "tensor_object.h"

namespace nb = nanobind;

namespace tensorshm::python {

nb::dict SegmentPlaceOf(const PyTensor& tensor) {
  const std::shared_ptr<Storage>& storage = Live(tensor);
  absl::StatusOr<SegmentPlace> place = absl::InvalidArgumentError(
      absl::StrCat(Describe(tensor), ": not in tensorshm memory (a foreign tensor)"));
  if (storage->writable.has_value()) {
    place = PlaceOf(*storage->writable);
  } else if (storage->lease) {
    place = PlaceOf(storage->versioned);
  }
  Check(place.status());
  // A lease a restarted daemon did not take back: its segment may be another object now.
  Check(storage->LeaseStatus());
  // Whoever asks reads the bytes outside any CUDA stream of ours (Triton, a NIXL transfer): an
  // acquired CUDA tensor's producer must be done with them first.
  if (storage->lease && storage->tensor.device.device_type == kDLCUDA) {
    Status ready;
    {
      ReleaseGil release;
      ready = WaitReady(storage->versioned, ReadySync::Host());
    }
    Check(ready);
  }
  const bool padded = (storage->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
  const StorageSpan span = SpanOf(storage->tensor, padded);
  if (place->length == 0 || span.nbytes == 0) {
    Raise(absl::InvalidArgumentError(
        absl::StrCat(Describe(tensor), ": empty (no bytes, so no segment)")));
  }
  // The span of a view taken from the tensor lies inside its segment; anything else is a bug.
  const intptr_t from = span.start - place->address;
  if (from < 0 ||
      static_cast<uint64_t>(from) + static_cast<uint64_t>(span.nbytes) > place->length) {
    Raise(absl::InternalError(absl::StrCat(Describe(tensor), ": its bytes [", from, ", +",
                                           span.nbytes, ") run past its segment's end, ",
                                           place->length, " bytes on")));
  }
  const bool cuda = storage->tensor.device.device_type == kDLCUDA;
  nb::dict out;
  out["device"] = cuda ? "cuda" : "cpu";
  out["device_id"] = cuda ? storage->tensor.device.device_id : 0;
  out["segment_instance"] = place->segment_instance;
  out["segment_id"] = place->segment_id;
  out["segment_size"] = place->segment_size;
  out["offset"] = place->offset + static_cast<uint64_t>(from);
  // The first byte's address in this process (host: in its mapping of the segment; CUDA: the
  // device pointer), so `address - offset` is where the whole segment starts.
  out["address"] = reinterpret_cast<uintptr_t>(span.start);
  out["nbytes"] = span.nbytes;
  out["shm_name"] = place->shm_name;
  out["ipc_handle"] = nb::bytes(place->cuda_ipc_handle.data(), place->cuda_ipc_handle.size());
  return out;
}

}  // namespace tensorshm::python
