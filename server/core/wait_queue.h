// WaitQueue: calls that wait for something (a name to be published, memory to be freed), in the
// order they came, each under a key (what it waits for) and its session, those with a finite
// deadline also by it. One mechanism for every kind of waiter: the Store's waiting acquires
// (keyed by name) and its creates waiting for memory (keyed by pool) are both WaitQueues.
#ifndef TENSORSHM_SERVER_CORE_WAIT_QUEUE_H_
#define TENSORSHM_SERVER_CORE_WAIT_QUEUE_H_

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "common/base/check.h"

namespace tensorshm {

// Thread-compatible: its owner's lock guards it. It holds pointers to waiters it does not own;
// a waiter is in it at most once, from Add until Remove. `Key` is hashable (absl::Hash) and
// copyable.
template <typename Key, typename T>
class WaitQueue {
 public:
  // Adds `waiter` (not in the queue) under `key` and session `session_id`, and by `deadline`
  // unless it is absl::InfiniteFuture(). Returns true if `deadline` is now the queue's earliest
  // (a timer sleeping until the earliest deadline must wake to see it).
  bool Add(T* waiter, const Key& key, uint64_t session_id, absl::Time deadline) {
    auto [it, added] = positions_.try_emplace(waiter);
    TSM_CHECK(added);
    Position& at = it->second;
    at.key = key;
    at.session_id = session_id;
    at.in_order = order_.insert(order_.end(), waiter);
    std::list<T*>& same_key = by_key_[key];
    at.by_key = same_key.insert(same_key.end(), waiter);
    std::list<T*>& same_session = by_session_[session_id];
    at.by_session = same_session.insert(same_session.end(), waiter);
    at.finite = deadline != absl::InfiniteFuture();
    if (!at.finite) return false;
    at.by_deadline = by_deadline_.emplace(deadline, waiter);
    return at.by_deadline == by_deadline_.begin();
  }

  // Takes `waiter` off the queue. REQUIRES: Contains(waiter).
  void Remove(T* waiter) {
    auto it = positions_.find(waiter);
    TSM_CHECK(it != positions_.end());
    Position& at = it->second;
    order_.erase(at.in_order);
    auto key = by_key_.find(at.key);
    key->second.erase(at.by_key);
    if (key->second.empty()) by_key_.erase(key);
    auto session = by_session_.find(at.session_id);
    session->second.erase(at.by_session);
    if (session->second.empty()) by_session_.erase(session);
    if (at.finite) by_deadline_.erase(at.by_deadline);
    positions_.erase(it);
  }

  bool Contains(const T* waiter) const { return positions_.contains(waiter); }

  // The waiters in the order they came: all of them, those under `key`, or those of session
  // `session_id`. Copies, so that the caller may Remove them as it goes.
  std::vector<T*> All() const { return {order_.begin(), order_.end()}; }
  std::vector<T*> WithKey(const Key& key) const { return Copy(by_key_, key); }
  std::vector<T*> OfSession(uint64_t session_id) const { return Copy(by_session_, session_id); }
  size_t CountWithKey(const Key& key) const { return Count(by_key_, key); }
  size_t CountOfSession(uint64_t session_id) const { return Count(by_session_, session_id); }

  // The waiter with the earliest finite deadline if that is not after `now`; nullptr otherwise.
  T* Expired(absl::Time now) const {
    if (by_deadline_.empty() || by_deadline_.begin()->first > now) return nullptr;
    return by_deadline_.begin()->second;
  }
  // The earliest finite deadline, or absl::InfiniteFuture() if none is.
  absl::Time NextDeadline() const {
    return by_deadline_.empty() ? absl::InfiniteFuture() : by_deadline_.begin()->first;
  }

  size_t size() const { return order_.size(); }
  bool empty() const { return order_.empty(); }

 private:
  using List = std::list<T*>;
  struct Position {
    Key key;
    uint64_t session_id = 0;
    bool finite = false;  // on by_deadline_
    typename List::iterator in_order;
    typename List::iterator by_key;
    typename List::iterator by_session;
    typename std::multimap<absl::Time, T*>::iterator by_deadline;
  };

  template <typename Index, typename K>
  static std::vector<T*> Copy(const Index& index, const K& k) {
    auto it = index.find(k);
    if (it == index.end()) return {};
    return {it->second.begin(), it->second.end()};
  }
  template <typename Index, typename K>
  static size_t Count(const Index& index, const K& k) {
    auto it = index.find(k);
    return it == index.end() ? 0 : it->second.size();
  }

  List order_;
  absl::flat_hash_map<Key, List> by_key_;
  absl::flat_hash_map<uint64_t, List> by_session_;
  std::multimap<absl::Time, T*> by_deadline_;
  absl::flat_hash_map<const T*, Position> positions_;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CORE_WAIT_QUEUE_H_
