// --evict: what tensorshmd may do when a create finds its pool full.
#ifndef TENSORSHM_SERVER_OPS_EVICTION_H_
#define TENSORSHM_SERVER_OPS_EVICTION_H_

namespace tensorshm {

enum class EvictPolicy {
  kNone,  // never: the create fails, or waits (CreateRequest.wait_ms)
  kLru,   // published tensors nobody leases go first, least recently acquired first
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_OPS_EVICTION_H_
