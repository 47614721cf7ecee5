#include "server/session.h"

#include <random>

#include "absl/strings/str_format.h"
#include "common/check.h"

namespace tensorshm {
namespace {

std::string RandomToken() {
  std::random_device device;  // the kernel's entropy pool
  std::string token;
  for (int i = 0; i < 4; ++i) absl::StrAppendFormat(&token, "%08x", device());
  return token;
}

}  // namespace

Session& SessionTable::Open(int64_t pid, std::string client_name, std::string peer) {
  auto session = std::make_unique<Session>();
  session->id = next_session_id_++;
  session->token = RandomToken();
  session->pid = pid;
  session->client_name = std::move(client_name);
  session->peer = std::move(peer);
  Session& ref = *session;
  by_token_.emplace(ref.token, &ref);
  by_id_.emplace(ref.id, std::move(session));
  return ref;
}

Session* SessionTable::Find(const std::string& token) {
  auto it = by_token_.find(token);
  return it == by_token_.end() ? nullptr : it->second;
}

void SessionTable::Close(uint64_t id) {
  auto it = by_id_.find(id);
  TSM_CHECK(it != by_id_.end());
  TSM_CHECK(it->second->leases.empty() && it->second->unpublished.empty());
  by_token_.erase(it->second->token);
  by_id_.erase(it);
}

int64_t SessionTable::lease_count() const {
  int64_t count = 0;
  for (const auto& [id, session] : by_id_) count += static_cast<int64_t>(session->leases.size());
  return count;
}

}  // namespace tensorshm
