// The catalog's record store: each tensor's record in the control segment (written as the
// catalog's own state changes), the counters stored into its header, and the damage checks that
// compare the records, which other processes can write, with the catalog's own copies.
#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/shm/fast_path_layout.h"
#include "common/shm/tensor_record.h"
#include "common/tensor/dtype.h"
#include "common/tensor/layout.h"
#include "server/catalog/catalog.h"
#include "server/ops/log.h"

namespace tensorshm {

void Catalog::WriteRecordLayout(const Tensor& tensor, TensorRecord& record) {
  record.dtype_code = tensor.dtype.code;
  record.dtype_bits = tensor.dtype.bits;
  record.dtype_lanes = tensor.dtype.lanes;
  record.ndim = static_cast<int32_t>(tensor.shape.size());
  record.byte_offset = tensor.byte_offset;
  record.nbytes = tensor.nbytes;
  record.dlpack_flags = tensor.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : 0;
  std::copy(tensor.shape.begin(), tensor.shape.end(), record.shape);
  std::copy(tensor.strides.begin(), tensor.strides.end(), record.strides);
}

void Catalog::WriteRecordState(Tensor& tensor, RecordState state) {
  tensor.record_state = state;
  control_.record(tensor.slot).state.store(static_cast<uint32_t>(state), std::memory_order_release);
}

void Catalog::WriteNewRecord(Tensor& tensor) {
  TensorRecord& record = control_.record(tensor.slot);
  // Whatever the slot held (a freed tensor's fields, or another process's bytes) goes: free
  // first, then every byte after the state word, then the fields, then the state.
  record.state.store(static_cast<uint32_t>(RecordState::kFree), std::memory_order_release);
  static_assert(offsetof(TensorRecord, state) == 0);
  std::memset(reinterpret_cast<char*>(&record) + sizeof(record.state), 0,
              sizeof(TensorRecord) - sizeof(record.state));
  record.name_length = 0;
  record.tensor_id = tensor.id;
  record.publish_seq = 0;
  record.segment_id = tensor.buffer.segment_id;
  record.offset = tensor.buffer.offset;
  record.length = tensor.buffer.length;
  record.device_type = tensor.device.device_type;
  record.device_id = tensor.device.device_id;
  record.owner_uid = tensor.owner_uid;
  if (tensor.device.device_type == kDLCUDA) {
    const DeviceUuid& uuid = cuda_pools_.at(tensor.device.device_id)->uuid();
    std::memcpy(record.device_uuid, uuid.data(), sizeof(record.device_uuid));
  }
  WriteRecordLayout(tensor, record);
  tensor.publish_seq = 0;
  tensor.record_name.clear();
  WriteRecordState(tensor, RecordState::kWriting);
}

uint64_t Catalog::TakeTensorId() {
  const uint64_t id = next_tensor_id_++;
  control_.header().next_tensor_id.store(next_tensor_id_, std::memory_order_relaxed);
  return id;
}

uint64_t Catalog::TakePublishSeq() {
  const uint64_t seq = next_publish_seq_++;
  control_.header().next_publish_seq.store(next_publish_seq_, std::memory_order_relaxed);
  return seq;
}

std::string Catalog::RecordMismatch(const Tensor& tensor) const {
  TensorRecord found;
  CopyRecord(control_.record(tensor.slot), found);
  auto differs = [](absl::string_view field, auto value, auto expected) {
    return absl::StrCat(field, " ", value, " (the daemon wrote ", expected, ")");
  };
  const uint32_t state = found.state.load(std::memory_order_relaxed);
  if (state != static_cast<uint32_t>(tensor.record_state)) {
    return differs("state", state, static_cast<uint32_t>(tensor.record_state));
  }
  if (found.tensor_id != tensor.id) return differs("tensor_id", found.tensor_id, tensor.id);
  if (found.publish_seq != tensor.publish_seq) {
    return differs("publish_seq", found.publish_seq, tensor.publish_seq);
  }
  if (found.name_length != tensor.record_name.size()) {
    return differs("name_length", found.name_length, tensor.record_name.size());
  }
  if (std::memcmp(found.name, tensor.record_name.data(), tensor.record_name.size()) != 0) {
    return absl::StrCat("name \"",
                        absl::CHexEscape(absl::string_view(found.name, tensor.record_name.size())),
                        "\" (the daemon wrote \"", tensor.record_name, "\")");
  }
  if (found.segment_id != tensor.buffer.segment_id) {
    return differs("segment_id", found.segment_id, tensor.buffer.segment_id);
  }
  if (found.offset != tensor.buffer.offset) {
    return differs("offset", found.offset, tensor.buffer.offset);
  }
  if (found.length != tensor.buffer.length) {
    return differs("length", found.length, tensor.buffer.length);
  }
  if (found.device_type != tensor.device.device_type ||
      found.device_id != tensor.device.device_id) {
    return differs("device", absl::StrCat(found.device_type, ":", found.device_id),
                   DeviceName(tensor.device));
  }
  if (tensor.device.device_type == kDLCUDA) {
    const DeviceUuid& uuid = cuda_pools_.at(tensor.device.device_id)->uuid();
    if (std::memcmp(found.device_uuid, uuid.data(), sizeof(found.device_uuid)) != 0) {
      return absl::StrCat("device_uuid (the daemon wrote ", FormatUuid(uuid), ")");
    }
    char event[sizeof(found.ready_event)] = {};
    if (tensor.ready_event.size() == sizeof(event)) {
      std::memcpy(event, tensor.ready_event.data(), sizeof(event));
    }
    if (std::memcmp(found.ready_event, event, sizeof(event)) != 0) {
      return "ready_event (not the handle the producer published)";
    }
  }
  if (found.dtype_code != tensor.dtype.code || found.dtype_bits != tensor.dtype.bits ||
      found.dtype_lanes != tensor.dtype.lanes) {
    return differs("dtype",
                   absl::StrCat("(code ", found.dtype_code, ", bits ", found.dtype_bits, ", lanes ",
                                found.dtype_lanes, ")"),
                   DataTypeName(tensor.dtype));
  }
  const auto ndim = static_cast<int32_t>(tensor.shape.size());
  if (found.ndim != ndim) return differs("ndim", found.ndim, ndim);
  for (int32_t i = 0; i < ndim; ++i) {
    if (found.shape[i] != tensor.shape[i]) {
      return differs(absl::StrCat("shape[", i, "]"), found.shape[i], tensor.shape[i]);
    }
    if (found.strides[i] != tensor.strides[i]) {
      return differs(absl::StrCat("strides[", i, "]"), found.strides[i], tensor.strides[i]);
    }
  }
  if (found.byte_offset != tensor.byte_offset) {
    return differs("byte_offset", found.byte_offset, tensor.byte_offset);
  }
  if (found.nbytes != tensor.nbytes) return differs("nbytes", found.nbytes, tensor.nbytes);
  const uint64_t flags = tensor.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : 0;
  if (found.dlpack_flags != flags) return differs("dlpack_flags", found.dlpack_flags, flags);
  if (found.owner_uid != tensor.owner_uid) {
    return differs("owner_uid", found.owner_uid, tensor.owner_uid);
  }
  return "";
}

void Catalog::MarkDamaged(Tensor& tensor, std::string found) {
  tensor.damage = std::move(found);
  std::string what;
  std::string consequence;
  if (!tensor.name.empty()) {
    what = absl::StrCat(" \"", tensor.name, "\"");
    consequence = "acquiring it answers DATA_LOSS until it is deleted or replaced";
  } else if (tensor.sealed) {
    what = " (unbound)";
    consequence = "it is freed once unleased";
  } else {
    what = " (unpublished)";
    consequence = "publishing it answers DATA_LOSS";
  }
  TSM_LOG(kError) << "tensor " << tensor.id << what << ": its record in " << control_.name()
                  << " was overwritten by another process: found " << tensor.damage << "; "
                  << consequence;
  if (!tensor.name.empty()) {
    // The entry stays (the name is bound) but sends readers to the daemon.
    index_.Bind(NameHash(tensor.name.data(), tensor.name.size()), tensor.slot, kIndexAskDaemon,
                tensor.slot);
  }
}

absl::Status Catalog::DamageError(const Tensor& tensor) const {
  const std::string& name = tensor.name.empty() ? tensor.record_name : tensor.name;
  const std::string what = name.empty() ? absl::StrCat("tensor_id = ", tensor.id, " (unpublished)")
                                        : absl::StrCat("name = \"", name, "\"");
  return absl::DataLossError(
      absl::StrCat(what, ": tensor ", tensor.id, "'s record in ", control_.name(),
                   " was overwritten by another process (found ", tensor.damage, "); ",
                   name.empty() ? "create the tensor again"
                                : "its publisher can delete it or publish a replacement"));
}

absl::Status Catalog::Verify(uint64_t tensor_id) {
  auto it = tensors_.find(tensor_id);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor_id = ", tensor_id, ": no such tensor"));
  }
  Tensor& tensor = it->second;
  if (tensor.damage.empty()) {
    std::string found = RecordMismatch(tensor);
    if (found.empty()) return absl::OkStatus();
    MarkDamaged(tensor, std::move(found));
  }
  return DamageError(tensor);
}

int Catalog::CheckRecords(size_t budget) {
  const bool header = control_.RepairHeader(next_tensor_id_, next_publish_seq_);
  const int segments = pool_->RepairSegmentRecords();
  if ((header || segments > 0) && !reported_repair_) {
    reported_repair_ = true;
    TSM_LOG(kError) << control_.name() << ": another process wrote " << (header ? "the header" : "")
                    << (header && segments > 0 ? " and " : "")
                    << (segments > 0 ? absl::StrCat(segments, " segment records") : "")
                    << "; rewritten as the daemon knows them (logged once)";
  }
  int damaged = 0;
  budget = std::min(budget, tensors_.size());
  auto it = tensors_.upper_bound(sweep_after_);
  for (size_t checked = 0; checked < budget; ++checked) {
    if (it == tensors_.end()) it = tensors_.begin();
    Tensor& tensor = it->second;
    if (tensor.damage.empty()) {
      std::string found = RecordMismatch(tensor);
      if (!found.empty()) {
        MarkDamaged(tensor, std::move(found));
        ++damaged;
      }
    }
    sweep_after_ = it->first;
    ++it;
  }
  return damaged;
}

int64_t Catalog::damaged_count() const {
  int64_t count = 0;
  for (const auto& [id, tensor] : tensors_) count += tensor.damage.empty() ? 0 : 1;
  return count;
}

}  // namespace tensorshm
