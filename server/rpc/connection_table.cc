#include "server/rpc/connection_table.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/base/sys_error.h"
#include "server/ops/log.h"

namespace tensorshm {

uint64_t DaemonConnectionLimit(uint64_t open_files, uint64_t* owner_reserve) {
  const uint64_t reserve = std::max<uint64_t>(64, open_files / 16);
  const uint64_t limit = open_files > reserve ? (open_files - reserve) / 3 * 2 : 0;
  *owner_reserve = std::min<uint64_t>(256, limit / 8);
  return limit;
}

ConnectionRefusal ConnectionTable::Check(uid_t uid, bool admitted, absl::Time now) {
  if (!admitted) {
    if (count(uid) >= limits_.stranger_per_uid) SweepUid(uid, now);
    if (count(uid) >= limits_.stranger_per_uid) return ConnectionRefusal::kNotAdmitted;
    if (strangers_ >= limits_.strangers && now - last_sweep_ >= kSweepInterval) Sweep(now);
    if (strangers_ >= limits_.strangers) return ConnectionRefusal::kNotAdmitted;
  }
  const bool owner = uid == limits_.owner;
  if (!owner && limits_.per_uid > 0 && count(uid) >= limits_.per_uid) {
    SweepUid(uid, now);
    if (count(uid) >= limits_.per_uid) return ConnectionRefusal::kUidLimit;
  }
  if (limits_.total > 0) {
    const uint64_t room = owner ? limits_.total : limits_.total - limits_.owner_reserve;
    if (total() >= room) {
      if (now - last_sweep_ >= kSweepInterval) Sweep(now);
      if (total() >= room) return ConnectionRefusal::kDaemonLimit;
    }
  }
  return ConnectionRefusal::kNone;
}

absl::Status ConnectionTable::Add(int fd, uid_t uid, bool admitted) {
  struct stat st;
  if (fstat(fd, &st) != 0) return ErrnoError("fstat", absl::StrCat("accepted fd ", fd), errno);
  Forget(fd);
  entries_[fd] = Entry{uid, admitted, st.st_dev, st.st_ino};
  if (!admitted) ++strangers_;
  uids_[uid].fds.insert(fd);
  return absl::OkStatus();
}

void ConnectionTable::Remove(int fd) { Forget(fd); }

void ConnectionTable::Forget(int fd) {
  auto it = entries_.find(fd);
  if (it == entries_.end()) return;
  if (!it->second.admitted) --strangers_;
  auto uid = uids_.find(it->second.uid);
  if (uid != uids_.end()) {
    uid->second.fds.erase(fd);
    if (uid->second.fds.empty()) uids_.erase(uid);
  }
  entries_.erase(it);
}

bool ConnectionTable::StillOpen(int fd, const Entry& entry) {
  struct stat st;
  return fstat(fd, &st) == 0 && st.st_dev == entry.device && st.st_ino == entry.inode;
}

void ConnectionTable::SweepUid(uid_t uid, absl::Time now) {
  auto it = uids_.find(uid);
  if (it == uids_.end() || now - it->second.last_sweep < kSweepInterval) return;
  it->second.last_sweep = now;
  std::vector<int> closed;
  for (int fd : it->second.fds) {
    if (!StillOpen(fd, entries_.at(fd))) closed.push_back(fd);
  }
  for (int fd : closed) Forget(fd);
}

void ConnectionTable::Sweep(absl::Time now) {
  last_sweep_ = now;
  std::vector<int> closed;
  for (const auto& [fd, entry] : entries_) {
    if (!StillOpen(fd, entry)) closed.push_back(fd);
  }
  for (int fd : closed) Forget(fd);
}

uint64_t ConnectionTable::count(uid_t uid) const {
  auto it = uids_.find(uid);
  return it == uids_.end() ? 0 : it->second.fds.size();
}

void RefusalLog::Refused(uid_t uid, const std::string& line, absl::Time now) {
  auto [it, first] = uids_.try_emplace(uid);
  Uid& state = it->second;
  if (first || (state.unlogged == 0 && now - state.logged >= interval_)) {
    TSM_LOG(kWarning) << line;
    state.logged = now;
    return;
  }
  ++state.unlogged;
  state.last = line;
}

void RefusalLog::Flush(absl::Time now) {
  for (auto it = uids_.begin(); it != uids_.end();) {
    Uid& state = it->second;
    if (now - state.logged < interval_) {
      ++it;
    } else if (state.unlogged == 0) {
      it = uids_.erase(it);  // quiet for an interval: its next refusal is logged whole
    } else {
      TSM_LOG(kWarning) << state.unlogged
                        << (it->first == kNoUid
                                ? std::string(" more accept failures")
                                : absl::StrCat(" more connections of uid ", it->first, " refused"))
                        << " in the last "
                        << absl::FormatDuration(absl::Trunc(now - state.logged, absl::Seconds(1)))
                        << "; the latest: " << state.last;
      state.logged = now;
      state.unlogged = 0;
      state.last.clear();
      ++it;
    }
  }
}

absl::Time RefusalLog::NextFlush() const {
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [uid, state] : uids_) next = std::min(next, state.logged + interval_);
  return next;
}

}  // namespace tensorshm
