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

// A tensor being filled; publish() seals it.
struct PyWritableTensor : PyTensor {
  std::shared_ptr<Client> client;
};

// tensorshm._tensorshm._Client. Thread-safe (Client is).
struct PyClient {
  std::shared_ptr<Client> client;
};

// The client the DLPack exchange API's allocator creates tensors through: the last one connected
// in this process that is still alive. Thread-safe.
void SetAllocatorClient(const std::shared_ptr<Client>& client);
std::shared_ptr<Client> AllocatorClient();
// In a child of fork(), with no other thread running yet: forgets the parent's client (it cannot
// allocate here) and re-creates the lock, which a parent thread may have held at the fork.
void ForgetAllocatorClientAfterFork();

}  // namespace tensorshm::python

#endif  // TENSORSHM_PYTHON_TENSOR_OBJECT_H_
