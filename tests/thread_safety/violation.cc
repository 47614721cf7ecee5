// Must NOT compile under `make check-thread-safety`: it reads a guarded field without the lock
// and waits on a CondVar without holding its mutex. The target checks that clang refuses it,
// so that the analysis is known to be on.
#include "common/base/mutex.h"

namespace tensorshm {

class Counter {
 public:
  int Read() { return value_; }       // no lock held
  void Wait() { ready_.Wait(&mu_); }  // CondVar::Wait without mu_

 private:
  Mutex mu_;
  CondVar ready_;
  int value_ ABSL_GUARDED_BY(mu_) = 0;
};

int Use() {
  Counter counter;
  counter.Wait();
  return counter.Read();
}

}  // namespace tensorshm
