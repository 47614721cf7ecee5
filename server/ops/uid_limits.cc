#include "server/ops/uid_limits.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace tensorshm {

uint64_t FairTensorShare(uint64_t max_tensors, uint32_t owner_uid,
                         const std::set<uint32_t>& allow_uids, size_t allow_gids) {
  std::set<uint32_t> uids = allow_uids;
  uids.insert(owner_uid);
  const uint64_t sharing = uids.size() + allow_gids;
  return std::max<uint64_t>(1, max_tensors / sharing);
}

absl::Status TensorRecordsExhausted(uint32_t uid, uint64_t records, uint64_t limit) {
  return absl::ResourceExhaustedError(
      absl::StrCat("uid ", uid, ": ", records,
                   " tensor records held (published tensors, empty ones included, and unpublished "
                   "creates), limit ",
                   limit, " (--uid-tensors); delete some of this uid's tensors first"));
}

uint64_t* UidLimits::Counter(UidUsage& usage, Kind kind) {
  switch (kind) {
    case Kind::kSession:
      return &usage.sessions;
    case Kind::kLease:
      return &usage.leases;
    case Kind::kWaiter:
      return &usage.waiters;
    case Kind::kCreating:
      return &usage.creating_sessions;
    case Kind::kBytes:
      break;
  }
  return &usage.unpublished_bytes;
}

uint64_t UidLimits::Limit(Kind kind) const {
  switch (kind) {
    case Kind::kSession:
      return config_.sessions;
    case Kind::kLease:
      return config_.leases;
    case Kind::kWaiter:
      return config_.waiters;
    case Kind::kCreating:
      return 0;
    case Kind::kBytes:
      break;
  }
  return config_.unpublished_bytes;
}

UidLimits::~UidLimits() {
  MutexLock lock(&mu_);
  TSM_CHECK(usage_.empty());
}

absl::StatusOr<UidLimits::SessionCharge> UidLimits::OpenSession(uint32_t uid) {
  if (absl::Status s = Add(uid, Kind::kSession, 1); !s.ok()) return s;
  return SessionCharge(this, uid);
}

absl::StatusOr<UidLimits::WaitCharge> UidLimits::StartWait(uint32_t uid) {
  if (absl::Status s = Add(uid, Kind::kWaiter, 1); !s.ok()) return s;
  return WaitCharge(this, uid);
}

absl::Status UidLimits::CheckHeldList(uint64_t entries) const {
  if (config_.leases == 0 || entries <= config_.leases) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "open.held_tensor_ids: ", entries, " entries, more leases than one uid may hold (limit ",
      config_.leases, ", --uid-leases); reconnect holding fewer"));
}

UidUsage UidLimits::Usage(uint32_t uid) const {
  MutexLock lock(&mu_);
  auto it = usage_.find(uid);
  return it == usage_.end() ? UidUsage{} : it->second;
}

std::set<uint32_t> UidLimits::CreatingUids() const {
  MutexLock lock(&mu_);
  std::set<uint32_t> uids;
  for (const auto& [uid, usage] : usage_) {
    if (usage.creating_sessions > 0) uids.insert(uid);
  }
  return uids;
}

size_t UidLimits::uid_count() const {
  MutexLock lock(&mu_);
  return usage_.size();
}

absl::Status UidLimits::Add(uint32_t uid, Kind kind, uint64_t amount) {
  MutexLock lock(&mu_);
  UidUsage& usage = usage_[uid];
  uint64_t* used = Counter(usage, kind);
  const uint64_t limit = Limit(kind);
  // Under a limit, *used <= limit always holds, so the subtraction cannot wrap.
  if (limit == 0 || amount <= limit - *used) {
    *used += amount;
    return absl::OkStatus();
  }
  const uint64_t current = *used;
  if (usage.empty()) usage_.erase(uid);
  const std::string who = absl::StrCat("uid ", uid, ": ");
  switch (kind) {
    case Kind::kSession:
      return absl::ResourceExhaustedError(
          absl::StrCat(who, current, " sessions open, limit ", limit,
                       " (--uid-sessions); end some of this uid's clients first"));
    case Kind::kLease:
      return absl::ResourceExhaustedError(absl::StrCat(
          who, current, " leases held", amount > 1 ? absl::StrCat(", ", amount, " more asked") : "",
          ", limit ", limit, " (--uid-leases); release some acquired tensors first"));
    case Kind::kWaiter:
      return absl::ResourceExhaustedError(
          absl::StrCat(who, current, " acquires waiting, limit ", limit,
                       " (--uid-waiters); wait for fewer names at once, or acquire without "
                       "waiting"));
    case Kind::kBytes:
      return absl::ResourceExhaustedError(absl::StrCat(
          who, current, " bytes of unpublished tensors held, ", amount, " more requested, limit ",
          limit, " bytes (--uid-quota); publish or drop some first"));
    case Kind::kCreating:
      break;  // not limited
  }
  return absl::InternalError("unreachable");
}

void UidLimits::Drop(uint32_t uid, Kind kind, uint64_t amount) {
  if (amount == 0) return;
  MutexLock lock(&mu_);
  auto it = usage_.find(uid);
  TSM_CHECK(it != usage_.end());
  UidUsage& usage = it->second;
  uint64_t& used = *Counter(usage, kind);
  TSM_CHECK(used >= amount);
  used -= amount;
  if (usage.empty()) usage_.erase(it);
}

// ---- SessionCharge ----

UidLimits::SessionCharge::SessionCharge(SessionCharge&& other) noexcept
    : limits_(std::exchange(other.limits_, nullptr)),
      uid_(other.uid_),
      leases_(std::exchange(other.leases_, 0)),
      bytes_(std::exchange(other.bytes_, 0)),
      creating_(std::exchange(other.creating_, false)) {}

UidLimits::SessionCharge& UidLimits::SessionCharge::operator=(SessionCharge&& other) noexcept {
  if (this != &other) {
    Release();
    limits_ = std::exchange(other.limits_, nullptr);
    uid_ = other.uid_;
    leases_ = std::exchange(other.leases_, 0);
    bytes_ = std::exchange(other.bytes_, 0);
    creating_ = std::exchange(other.creating_, false);
  }
  return *this;
}

UidLimits::SessionCharge::~SessionCharge() { Release(); }

void UidLimits::SessionCharge::Release() {
  if (limits_ != nullptr) {
    limits_->Drop(uid_, Kind::kLease, leases_);
    limits_->Drop(uid_, Kind::kBytes, bytes_);
    if (creating_) limits_->Drop(uid_, Kind::kCreating, 1);
    limits_->Drop(uid_, Kind::kSession, 1);
  }
  limits_ = nullptr;
  leases_ = 0;
  bytes_ = 0;
  creating_ = false;
}

absl::Status UidLimits::SessionCharge::AddLeases(uint64_t count) {
  if (limits_ != nullptr) {
    if (absl::Status s = limits_->Add(uid_, Kind::kLease, count); !s.ok()) return s;
  }
  leases_ += count;
  return absl::OkStatus();
}

void UidLimits::SessionCharge::DropLeases(uint64_t count) {
  TSM_CHECK(count <= leases_);
  leases_ -= count;
  if (limits_ != nullptr) limits_->Drop(uid_, Kind::kLease, count);
}

absl::Status UidLimits::SessionCharge::AddUnpublished(uint64_t bytes) {
  if (limits_ != nullptr) {
    if (absl::Status s = limits_->Add(uid_, Kind::kBytes, bytes); !s.ok()) return s;
  }
  bytes_ += bytes;
  return absl::OkStatus();
}

void UidLimits::SessionCharge::DropUnpublished(uint64_t bytes) {
  TSM_CHECK(bytes <= bytes_);
  bytes_ -= bytes;
  if (limits_ != nullptr) limits_->Drop(uid_, Kind::kBytes, bytes);
}

void UidLimits::SessionCharge::MarkCreating() {
  if (creating_ || limits_ == nullptr) return;
  TSM_CHECK(limits_->Add(uid_, Kind::kCreating, 1).ok());  // never limited
  creating_ = true;
}

// ---- WaitCharge ----

UidLimits::WaitCharge::WaitCharge(WaitCharge&& other) noexcept
    : limits_(std::exchange(other.limits_, nullptr)), uid_(other.uid_) {}

UidLimits::WaitCharge& UidLimits::WaitCharge::operator=(WaitCharge&& other) noexcept {
  if (this != &other) {
    Release();
    limits_ = std::exchange(other.limits_, nullptr);
    uid_ = other.uid_;
  }
  return *this;
}

UidLimits::WaitCharge::~WaitCharge() { Release(); }

void UidLimits::WaitCharge::Release() {
  if (limits_ != nullptr) limits_->Drop(uid_, Kind::kWaiter, 1);
  limits_ = nullptr;
}

}  // namespace tensorshm
