// The client library's way into what Client and WaitCanceller hide. Private to the client
// library.
#ifndef TENSORSHM_CLIENT_CLIENT_ACCESS_H_
#define TENSORSHM_CLIENT_CLIENT_ACCESS_H_

#include <memory>
#include <utility>

#include "tensorshm/client.h"

namespace tensorshm {

class ClientAccess {
 public:
  // A Client of the session `core` opened (its sender thread started).
  static std::shared_ptr<Client> Make(std::shared_ptr<ClientCore> core) {
    return std::shared_ptr<Client>(new Client(std::move(core)));
  }
  static const std::shared_ptr<ClientCore>& Core(const Client& client) { return client.core_; }
  static CancelState* State(const WaitCanceller& cancel) { return cancel.state_.get(); }
};

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_CLIENT_ACCESS_H_
