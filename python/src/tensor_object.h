// The C++ side of tensorshm.Tensor and tensorshm.WritableTensor.
#ifndef TENSORSHM_PYTHON_TENSOR_OBJECT_H_
#define TENSORSHM_PYTHON_TENSOR_OBJECT_H_

#include <memory>
#include <string>

#include "storage.h"
#include "tensorshm/client.h"

namespace tensorshm::python {

// Not thread-safe on its own: Python calls reach it with the GIL held.
struct PyTensor {
  std::shared_ptr<Storage> storage;
  std::string name;  // the published name; empty for unpublished and foreign tensors
};

// A Python client's connection, shared with the writable tensors it created (which publish
// through it). Guarded by the GIL.
struct ClientState {
  std::shared_ptr<Client> client;  // null once closed
  std::string socket;
  std::string session_id;  // kept for messages after close
  uint64_t daemon_instance = 0;
};

// A tensor being filled; publish() seals it.
struct PyWritableTensor : PyTensor {
  std::shared_ptr<ClientState> client;
};

// As nb::gil_scoped_release, counted so that interpreter exit can wait for every call that let go
// of the GIL to take it back; a no-op once the interpreter is exiting (waits.cc says why). Use
// it, not nb::gil_scoped_release, around every call that may block.
class ReleaseGil {
 public:
  ReleaseGil();
  ~ReleaseGil();
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;

 private:
  void* state_ = nullptr;  // the PyThreadState saved, or null if the GIL was kept
};

// tensorshm._tensorshm._Client.
struct PyClient {
  std::shared_ptr<ClientState> state;
};

// A client held for the duration of one call, so that a close() in another thread meanwhile
// cannot free it under the call. If close() ran meanwhile, this is the last reference, and
// ~Client closes the session over the socket: it is then dropped without the GIL. REQUIRES the
// GIL (to construct and destroy).
class ClientRef {
 public:
  explicit ClientRef(std::shared_ptr<Client> client) : client_(std::move(client)) {}
  ClientRef(ClientRef&&) = default;
  ClientRef& operator=(ClientRef&&) = delete;
  ClientRef(const ClientRef&) = delete;
  ClientRef& operator=(const ClientRef&) = delete;
  ~ClientRef() {
    if (client_ != nullptr && client_.use_count() == 1) {
      ReleaseGil release;
      client_.reset();
    }
  }
  Client* operator->() const { return client_.get(); }
  Client& operator*() const { return *client_; }

 private:
  std::shared_ptr<Client> client_;
};

// The client to make a call through (see ClientRef). Raises tensorshm.ClosedError once closed.
ClientRef Live(const ClientState& state);
// "tensorshm client of session N (tensorshmd at unix:PATH)", for messages.
std::string DescribeClient(const ClientState& state);

// `tensor`'s storage; raises tensorshm.ReleasedError naming the tensor once it was released
// (release() or the end of its with block). REQUIRES the GIL; a caller that releases the GIL
// copies the shared_ptr first (another thread may release the tensor meanwhile).
const std::shared_ptr<Storage>& Live(const PyTensor& tensor);
// As Live, for C callbacks that return -1 with a Python exception set: nullptr, and the
// ReleasedError set, if `tensor` was released.
const std::shared_ptr<Storage>* LiveOrSetError(const PyTensor& tensor);
// 'tensor "NAME"', or "tensor" for an unnamed one, for messages.
std::string Describe(const PyTensor& tensor);

// The client the DLPack exchange API's allocator creates tensors through: the last one connected
// in this process that is still alive. Thread-safe.
void SetAllocatorClient(const std::shared_ptr<Client>& client);
std::shared_ptr<Client> AllocatorClient();
// After `client` was closed: the allocator no longer creates through it (nor, until another
// client connects, through any).
void ForgetAllocatorClient(const Client* client);
// In a child of fork(), with no other thread running yet: forgets the parent's client (it cannot
// allocate here) and re-creates the lock, which a parent thread may have held at the fork.
void ForgetAllocatorClientAfterFork();

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_TENSOR_OBJECT_H_
