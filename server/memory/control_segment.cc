#include "server/memory/control_segment.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/base/check.h"

namespace tensorshm {

absl::StatusOr<ControlSegment> ControlSegment::Create(const std::string& prefix,
                                                      uint32_t record_count,
                                                      uint64_t host_pool_bytes,
                                                      uint64_t host_segment_bytes,
                                                      SegmentBacking backing) {
  if (prefix.size() >= sizeof(ControlHeader::shm_prefix)) {
    return absl::InvalidArgumentError(absl::StrCat("shm prefix = \"", prefix, "\": longer than ",
                                                   sizeof(ControlHeader::shm_prefix) - 1,
                                                   " bytes"));
  }
  absl::StatusOr<ShmSegment> shm = ShmSegment::Create(
      absl::StrCat("/", prefix, ".ctl"), ControlSegmentBytes(record_count), /*map=*/true, backing);
  if (!shm.ok()) return shm.status();
  // A new shm object reads as zeros: every segment and record starts unused / free.
  auto* header = static_cast<ControlHeader*>(shm->address());
  header->layout_version = kControlLayoutVersion;
  header->header_bytes = kControlHeaderBytes;
  header->segment_record_bytes = sizeof(SegmentRecord);
  header->tensor_record_bytes = sizeof(TensorRecord);
  header->max_segments = kMaxSegments;
  header->record_count = record_count;
  header->host_pool_bytes = host_pool_bytes;
  header->host_segment_bytes = host_segment_bytes;
  header->next_tensor_id.store(1, std::memory_order_relaxed);
  header->next_publish_seq.store(1, std::memory_order_relaxed);
  std::memcpy(header->shm_prefix, prefix.data(), prefix.size());
  // The magic goes last: a header with it is complete.
  __atomic_store_n(&header->magic, kControlMagic, __ATOMIC_RELEASE);
  return ControlSegment(*std::move(shm), prefix, record_count, host_pool_bytes, host_segment_bytes);
}

absl::StatusOr<ControlSegment> ControlSegment::Open(const std::string& prefix) {
  const std::string name = absl::StrCat("/", prefix, ".ctl");
  absl::StatusOr<ShmSegment> shm = ShmSegment::Open(name, /*map=*/true);
  if (!shm.ok()) return shm.status();
  auto bad = [&](absl::string_view what) {
    shm->Keep();  // not ours to remove: it may belong to something else
    return absl::FailedPreconditionError(
        absl::StrCat(name, ": not a tensorshm control segment of this version (", what, ")"));
  };
  if (shm->size() < sizeof(ControlHeader)) return bad("too small");
  const auto* header = static_cast<const ControlHeader*>(shm->address());
  if (header->magic != kControlMagic) return bad("magic");
  if (header->layout_version != kControlLayoutVersion) {
    return bad(absl::StrCat("layout_version ", header->layout_version));
  }
  if (header->header_bytes != kControlHeaderBytes ||
      header->segment_record_bytes != sizeof(SegmentRecord) ||
      header->tensor_record_bytes != sizeof(TensorRecord) || header->max_segments != kMaxSegments) {
    return bad("record sizes");
  }
  // Read once: the validated value is the one kept.
  const uint32_t record_count = __atomic_load_n(&header->record_count, __ATOMIC_RELAXED);
  if (record_count == 0 || shm->size() < ControlSegmentBytes(record_count)) {
    return bad(absl::StrCat("record_count ", record_count));
  }
  if (std::string(header->shm_prefix, strnlen(header->shm_prefix, sizeof(header->shm_prefix))) !=
      prefix) {
    return bad("shm_prefix");
  }
  return ControlSegment(*std::move(shm), prefix, record_count,
                        __atomic_load_n(&header->host_pool_bytes, __ATOMIC_RELAXED),
                        __atomic_load_n(&header->host_segment_bytes, __ATOMIC_RELAXED));
}

bool ControlSegment::RepairHeader(uint64_t next_tensor_id, uint64_t next_publish_seq) const {
  ControlHeader& header = this->header();
  bool repaired = false;
  auto repair = [&repaired](auto& word, auto value) {
    if (__atomic_load_n(&word, __ATOMIC_RELAXED) != value) {
      __atomic_store_n(&word, value, __ATOMIC_RELAXED);
      repaired = true;
    }
  };
  repair(header.layout_version, kControlLayoutVersion);
  repair(header.header_bytes, kControlHeaderBytes);
  repair(header.segment_record_bytes, static_cast<uint32_t>(sizeof(SegmentRecord)));
  repair(header.tensor_record_bytes, static_cast<uint32_t>(sizeof(TensorRecord)));
  repair(header.max_segments, kMaxSegments);
  repair(header.record_count, record_count_);
  repair(header.host_pool_bytes, host_pool_bytes_);
  repair(header.host_segment_bytes, host_segment_bytes_);
  for (size_t i = 0; i < sizeof(header.shm_prefix); ++i) {
    repair(header.shm_prefix[i], i < prefix_.size() ? prefix_[i] : '\0');
  }
  if (header.next_tensor_id.load(std::memory_order_relaxed) != next_tensor_id) {
    header.next_tensor_id.store(next_tensor_id, std::memory_order_relaxed);
    repaired = true;
  }
  if (header.next_publish_seq.load(std::memory_order_relaxed) != next_publish_seq) {
    header.next_publish_seq.store(next_publish_seq, std::memory_order_relaxed);
    repaired = true;
  }
  if (__atomic_load_n(&header.magic, __ATOMIC_ACQUIRE) != kControlMagic) {
    __atomic_store_n(&header.magic, kControlMagic, __ATOMIC_RELEASE);  // last, as in Create
    repaired = true;
  }
  return repaired;
}

SegmentRecord& ControlSegment::segment(uint32_t index) const {
  TSM_CHECK(index < kMaxSegments);
  auto* base = static_cast<char*>(shm_.address()) + kControlHeaderBytes;
  return reinterpret_cast<SegmentRecord*>(base)[index];
}

TensorRecord& ControlSegment::record(uint32_t slot) const {
  TSM_CHECK(slot < record_count());
  auto* base = static_cast<char*>(shm_.address()) + RecordsOffset();
  return reinterpret_cast<TensorRecord*>(base)[slot];
}

}  // namespace tensorshm
