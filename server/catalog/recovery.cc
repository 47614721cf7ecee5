// Catalog recovery: a restarted daemon's catalog from the control segment its predecessor left
// (Recover, Restore), and what its clients take back in the grace period (ReattachLease,
// Readopt) or nobody does (ExpireUnbound).
#include <algorithm>
#include <optional>
#include <string>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/shm/fast_path_layout.h"
#include "common/shm/tensor_record.h"
#include "common/tensor/dtype.h"
#include "common/tensor/layout.h"
#include "common/tensor/name.h"
#include "server/catalog/catalog.h"
#include "server/ops/log.h"

namespace tensorshm {

absl::StatusOr<std::unique_ptr<Catalog>> Catalog::Recover(const CatalogOptions& options) {
  if (options.backing != SegmentBacking::kNamed) {
    return absl::FailedPreconditionError("recovery needs named segments (--segments shm)");
  }
  absl::StatusOr<ControlSegment> control = ControlSegment::Open(options.shm_prefix);
  if (!control.ok()) return control.status();
  absl::StatusOr<CatalogIndex> index =
      CatalogIndex::Create(control->record_count(), options.instance_id);
  if (!index.ok()) {
    control->Keep();
    return index.status();
  }
  std::unique_ptr<Catalog> catalog(new Catalog(*std::move(control), *std::move(index),
                                               options.instance_id, /*all_slots_free=*/false));
  absl::StatusOr<HostPool> pool = HostPool::Recover(HostPoolOptionsOf(options), &catalog->control_);
  if (!pool.ok()) {
    catalog->control_.Keep();  // a failed recovery leaves the objects in place (see HostPool)
    return pool.status();
  }
  catalog->pool_.emplace(*std::move(pool));

  const uint32_t count = catalog->control_.record_count();
  // Published records, by name: the highest publish_seq wins (a replace that was cut short
  // leaves two); the others are unbound.
  std::unordered_map<std::string, uint64_t> winners;  // name -> tensor id
  uint64_t highest_id = 0;
  uint64_t highest_seq = 0;
  TensorRecord copy;
  for (uint32_t slot = count; slot-- > 0;) {
    TensorRecord& record = catalog->control_.record(slot);
    record.state.load(std::memory_order_acquire);  // orders the copy after the commit
    CopyRecord(record, copy);
    const auto state = static_cast<RecordState>(copy.state.load(std::memory_order_relaxed));
    if (state != RecordState::kPublished && state != RecordState::kUnbound &&
        state != RecordState::kWriting) {
      catalog->free_slots_.push_back(slot);
      continue;
    }
    // Unpublished buffers are kept too: their producer may reconnect and publish them.
    if (!catalog->Restore(slot, copy, state)) {
      record.state.store(static_cast<uint32_t>(RecordState::kFree), std::memory_order_release);
      catalog->free_slots_.push_back(slot);
      continue;
    }
    Tensor& tensor = catalog->tensors_.at(copy.tensor_id);
    highest_id = std::max(highest_id, tensor.id);
    highest_seq = std::max(highest_seq, tensor.publish_seq);
    if (state != RecordState::kPublished) continue;
    auto [it, inserted] = winners.emplace(tensor.record_name, tensor.id);
    if (!inserted) {
      Tensor& other = catalog->tensors_.at(it->second);
      Tensor* loser = &tensor;
      if (tensor.publish_seq > other.publish_seq) {
        loser = &other;
        it->second = tensor.id;
      }
      catalog->WriteRecordState(*loser, RecordState::kUnbound);
    }
  }
  for (const auto& [name, id] : winners) {
    Tensor& tensor = catalog->tensors_.at(id);
    tensor.name = name;
    catalog->names_.emplace(name, id);
    catalog->index_.Bind(NameHash(name.data(), name.size()), tensor.slot, id, std::nullopt);
  }
  // The counters go on from the larger of the header's word (tensors freed before the restart
  // had ids up to it) and what the records hold; a header word no daemon could have reached was
  // written by something else and is ignored.
  ControlHeader& header = catalog->control_.header();
  const uint64_t header_id = header.next_tensor_id.load(std::memory_order_relaxed);
  const uint64_t header_seq = header.next_publish_seq.load(std::memory_order_relaxed);
  catalog->next_tensor_id_ = highest_id + 1;
  catalog->next_publish_seq_ = highest_seq + 1;
  if (header_id <= kMaxRecordCounter) {
    catalog->next_tensor_id_ = std::max(catalog->next_tensor_id_, header_id);
  } else {
    TSM_LOG(kWarning) << "recovery: " << catalog->control_.name() << " header next_tensor_id "
                      << header_id << " is past any id a daemon hands out; continuing from "
                      << catalog->next_tensor_id_;
  }
  if (header_seq <= kMaxRecordCounter) {
    catalog->next_publish_seq_ = std::max(catalog->next_publish_seq_, header_seq);
  } else {
    TSM_LOG(kWarning) << "recovery: " << catalog->control_.name() << " header next_publish_seq "
                      << header_seq << " is past any sequence a daemon hands out; continuing from "
                      << catalog->next_publish_seq_;
  }
  header.next_tensor_id.store(catalog->next_tensor_id_, std::memory_order_relaxed);
  header.next_publish_seq.store(catalog->next_publish_seq_, std::memory_order_relaxed);
  catalog->in_grace_ = true;
  return catalog;
}

bool Catalog::Restore(uint32_t slot, const TensorRecord& record, RecordState state) {
  const bool unpublished = state == RecordState::kWriting;
  if (record.device_type == kDLCUDA) {
    // Device memory belongs to the process that allocated it: it ended with the old daemon.
    TSM_LOG(kWarning) << "recovery: record " << slot << " (tensor " << record.tensor_id
                      << ") was on cuda:" << record.device_id
                      << ", whose memory ended with the old daemon; dropped";
    return false;
  }
  const std::string name(record.name, std::min<size_t>(record.name_length, sizeof(record.name)));
  if (record.device_type != kDLCPU || record.device_id != 0 || record.tensor_id == 0 ||
      record.tensor_id > kMaxRecordCounter || record.publish_seq > kMaxRecordCounter ||
      (record.name_length == 0) != unpublished ||
      (!unpublished && (record.name_length > kMaxNameLength || !ValidateName(name).ok())) ||
      tensors_.count(record.tensor_id) > 0) {
    TSM_LOG(kWarning) << "recovery: record " << slot << " is not a valid tensor; dropped";
    return false;
  }
  absl::StatusOr<RecordLayout> decoded = DecodeRecordLayout(record);
  if (!decoded.ok()) {
    TSM_LOG(kWarning) << "recovery: record " << slot << " (tensor " << record.tensor_id
                      << ") is not a valid tensor (" << decoded.status().message() << "); dropped";
    return false;
  }
  Tensor tensor;
  tensor.id = record.tensor_id;
  tensor.slot = slot;
  tensor.device = DLDevice{kDLCPU, 0};
  tensor.buffer = Buffer{record.segment_id, record.offset, record.length};
  if (record.owner_uid != pool_->owner_uid()) {
    // Another uid's buffers are in segments reserved to it, sealed memfds that nothing outlives.
    TSM_LOG(kWarning) << "recovery: record " << slot << " (tensor " << record.tensor_id
                      << (unpublished ? "" : absl::StrCat(", \"", LogEscape(name), "\""))
                      << ") was uid " << record.owner_uid
                      << "'s, in a memfd segment reserved to that uid, whose memory ended with the "
                         "old daemon (only the daemon's own uid's tensors survive a restart); "
                         "dropped";
    return false;
  }
  const uint64_t page = HostPool::PageSize();
  if (tensor.buffer.offset % page != 0 || tensor.buffer.length % page != 0 ||
      (tensor.buffer.length > 0 && !pool_->Reserve(tensor.buffer))) {
    TSM_LOG(kWarning) << "recovery: record " << slot << " (tensor " << record.tensor_id
                      << ") does not fit its buffer or overlaps another; dropped";
    return false;
  }
  SetLayout(tensor, decoded->dtype, decoded->shape, std::move(decoded->layout),
            decoded->subbyte_padded);
  tensor.sealed = !unpublished;
  tensor.owner_uid = record.owner_uid;
  tensor.recovered = true;
  tensor.publish_seq = record.publish_seq;
  tensor.last_use = absl::Now();  // use_seq 0: older than anything this daemon saw used
  // Shown to operators only; a time past now (a wrong clock, a scribbled record) is unknown.
  if (!unpublished && record.published_unix_ms > 0 &&
      record.published_unix_ms <= absl::ToUnixMillis(absl::Now())) {
    tensor.published_unix_ms = record.published_unix_ms;
  }
  tensor.record_state = state;
  tensor.record_name = name;
  const uint32_t uid = tensor.owner_uid;
  if (tensors_.emplace(tensor.id, std::move(tensor)).second) CountRecord(uid, 1);
  return true;
}

int Catalog::ExpireUnbound() {
  in_grace_ = false;
  int freed = 0;
  for (auto it = tensors_.begin(); it != tensors_.end();) {
    auto next = std::next(it);
    Tensor& tensor = it->second;
    tensor.recovered = false;
    const bool orphaned = !tensor.sealed && tensor.owner_session == 0;
    if (orphaned) {
      Free(it);
      ++freed;
    } else if (tensor.sealed && tensor.name.empty()) {
      const size_t before = tensors_.size();
      FreeIfUnheld(it);
      freed += static_cast<int>(before - tensors_.size());
    }
    it = next;
  }
  return freed;
}

absl::Status Catalog::ReattachLease(uint64_t tensor_id) {
  if (!in_grace_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor_id = ", tensor_id, ": leases are re-registered only in a restart's grace period"));
  }
  auto it = tensors_.find(tensor_id);
  if (it == tensors_.end() || !it->second.sealed) {
    return absl::NotFoundError(
        absl::StrCat("tensor_id = ", tensor_id, ": no such published tensor"));
  }
  ++it->second.leases;
  return absl::OkStatus();
}

absl::Status Catalog::Readopt(uint64_t session, uint32_t uid, uint64_t tensor_id) {
  if (!in_grace_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor_id = ", tensor_id, ": tensors are taken back only in a restart's grace period"));
  }
  auto it = tensors_.find(tensor_id);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor_id = ", tensor_id, ": no such tensor"));
  }
  Tensor& tensor = it->second;
  if (tensor.sealed || tensor.owner_session != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("tensor_id = ", tensor_id, ": published or already taken back"));
  }
  if (tensor.owner_uid != uid) {
    return absl::PermissionDeniedError(absl::StrCat("tensor_id = ", tensor_id, ": created by uid ",
                                                    tensor.owner_uid, ", not uid ", uid));
  }
  tensor.owner_session = session;
  return absl::OkStatus();
}

}  // namespace tensorshm
