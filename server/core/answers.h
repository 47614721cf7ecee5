// Answers: the calls the Store's parts finished under its lock, kept until the lock is released
// (a transport may re-enter the Store from an answer: gRPC may run a reactor's OnCancel and OnDone
// inline).
#ifndef TENSORSHM_SERVER_CORE_ANSWERS_H_
#define TENSORSHM_SERVER_CORE_ANSWERS_H_

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "server/core/waiters.h"

namespace tensorshm {

// Thread-compatible: the Store's lock guards it.
class Answers {
 public:
  struct Queued {
    PendingCall* call;
    absl::Status status;
    bool granted = false;  // it carries a grant of a call with a request id (PendingCall::Answer)
  };

  // Queues `call` to be answered with `status` once the lock is released.
  void Later(PendingCall* call, absl::Status status, bool granted = false) {
    queued_.push_back({call, std::move(status), granted});
  }
  // What was queued, taken: the owner answers each with its lock released.
  std::vector<Queued> Take() { return std::exchange(queued_, {}); }

 private:
  std::vector<Queued> queued_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_ANSWERS_H_
