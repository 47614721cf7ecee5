// StockShelf: the buffers the daemon made ahead of this client's need (CreateRequest.stock),
// mapped writable, by buffer length; and the creates it counts to decide how many to ask for.
#ifndef TENSORSHM_CLIENT_STOCK_SHELF_H_
#define TENSORSHM_CLIENT_STOCK_SHELF_H_

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "client/mappings.h"
#include "common/base/mutex.h"
#include "tensorshm/v1/tensorshm.pb.h"

namespace tensorshm {

// Thread-safe.
class StockShelf {
 public:
  struct Stocked {
    uint64_t tensor_id = 0;
    HostBuffer buffer;  // `location.length()` bytes
    v1::Location location;
  };

  // A stocked buffer of `length` bytes, taken off the shelf; nullopt if there is none.
  std::optional<Stocked> Take(uint64_t length) ABSL_LOCKS_EXCLUDED(mu_);
  // How many buffers of `length` bytes to ask for now (0: enough on the shelf, not stockable, or
  // not created often enough yet).
  uint32_t Wanted(uint64_t length) const ABSL_LOCKS_EXCLUDED(mu_);
  // Counts a create of a tensor with a buffer of `length` bytes.
  void NoteCreate(uint64_t length) ABSL_LOCKS_EXCLUDED(mu_);
  // Puts a mapped stocked buffer on the shelf.
  void Put(Stocked stocked) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets every buffer (the session they belonged to ended, and the daemon frees them).
  void Drop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable Mutex mu_;
  std::map<uint64_t, std::vector<Stocked>> shelf_ ABSL_GUARDED_BY(mu_);  // by buffer length
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, uint64_t> creates_ ABSL_GUARDED_BY(mu_);  // by buffer length
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_STOCK_SHELF_H_
