// The control segment: tensorshmd's catalog in shared memory, a wire format between a daemon and
// its restarted self. Standard-layout structs of fixed size, offsets not pointers, a magic and a
// layout version in the header. A record is committed by its `state` word, written last with
// release ordering; readers load it with acquire ordering before trusting the other fields.
//
// Layout of the segment:
//   [0, kControlHeaderBytes)                       ControlHeader
//   [kControlHeaderBytes, + kMaxSegments * 64)     SegmentRecord[kMaxSegments]
//   [RecordsOffset(), + record_count * 1024)       TensorRecord[record_count]
#ifndef TENSORSHM_COMMON_SHM_CATALOG_LAYOUT_H_
#define TENSORSHM_COMMON_SHM_CATALOG_LAYOUT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace tensorshm {

inline constexpr uint64_t kControlMagic = 0x314c54434d534e54ull;  // "TNSMCTL1", little-endian
inline constexpr uint32_t kControlLayoutVersion = 3;
inline constexpr uint32_t kControlHeaderBytes = 4096;
inline constexpr uint32_t kMaxSegments = 1024;
inline constexpr uint32_t kRecordMaxDims = 32;
inline constexpr uint32_t kRecordNameBytes = 256;

// Tensor ids and publish sequence numbers a daemon hands out stay below this; a recovery takes
// a larger value in the header or a record for another process's bytes.
inline constexpr uint64_t kMaxRecordCounter = uint64_t{1} << 62;

enum class SegmentState : uint32_t {
  kUnused = 0,
  kLive = 1,       // the named shm object exists with `size` bytes reserved
  kEphemeral = 2,  // a memfd: it ends with the daemon that made it; a hole after recovery
};

enum class RecordState : uint32_t {
  kFree = 0,       // slot unused
  kWriting = 1,    // buffer allocated to a producer, not yet published; on recovery kept for the
                   // grace period (its producer may come back), then reclaimed
  kPublished = 2,  // sealed and bound to `name`; the highest publish_seq wins a name on recovery
  kUnbound = 3,    // sealed, name deleted or replaced, memory still held by leases
};

struct ControlHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t header_bytes;
  uint32_t segment_record_bytes;
  uint32_t tensor_record_bytes;
  uint32_t max_segments;
  uint32_t record_count;
  uint64_t host_pool_bytes;
  uint64_t host_segment_bytes;
  std::atomic<uint64_t> next_tensor_id;
  std::atomic<uint64_t> next_publish_seq;
  char shm_prefix[64];  // NUL-terminated
  uint8_t reserved[kControlHeaderBytes - 128];
};

struct SegmentRecord {
  std::atomic<uint32_t> state;  // SegmentState; written last
  int32_t device_type;          // DLDeviceType
  int32_t device_id;
  uint32_t owner_uid;  // the uid whose buffers the segment holds (the only one it is writable by)
  uint64_t segment_id;
  uint64_t size;
  uint64_t instance;  // the daemon instance that created the object (Location.segment_instance)
  // 0: the object is "/<prefix>.cpu.<segment_id>"; else "/<prefix>.cpu.<segment_id>.<suffix as
  // 16 hex digits>", a random name taken because another process held the first one (see
  // HostPool::ObjectName). Records written before this field existed held zeros here, so no
  // layout version change.
  uint64_t name_suffix;
  // The bytes at the start of the object that the pool holds; the rest (its free end, given back
  // for another segment: HostPool::TrimTail) is punched out. 0: all `size` bytes (records
  // written before this field existed held zeros here, so no layout version change).
  uint64_t held;
  uint8_t reserved[8];
};

struct TensorRecord {
  std::atomic<uint32_t> state;  // RecordState; written last
  uint32_t name_length;
  uint64_t tensor_id;
  uint64_t publish_seq;
  uint64_t segment_id;
  uint64_t offset;
  uint64_t length;
  int32_t device_type;
  int32_t device_id;
  uint8_t dtype_code;
  uint8_t dtype_bits;
  uint16_t dtype_lanes;
  int32_t ndim;
  uint64_t byte_offset;
  int64_t nbytes;
  int64_t shape[kRecordMaxDims];
  int64_t strides[kRecordMaxDims];
  char name[kRecordNameBytes];
  uint64_t dlpack_flags;  // DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED or 0
  uint32_t owner_uid;     // uid of the creating (and publishing) session
  uint32_t reserved0;
  // When Publish bound the name (Unix epoch, ms, the daemon's clock); written before the state
  // word commits the publish. 0: unknown (records written before this field existed held zeros
  // here, so no layout version change). Informational only: recovery takes it as it is, bounded.
  int64_t published_unix_ms;
  // CUDA tensors (zeros otherwise, as records written before these fields held, so no layout
  // version change): the 16-byte UUID of the device, written with the record, and the
  // producer's 64-byte CUipcEventHandle, written before the state word commits the publish. What
  // a client acquiring on the fast path needs besides the segment it maps already.
  uint8_t device_uuid[16];
  uint8_t ready_event[64];
  uint8_t reserved[72];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == 4 && sizeof(std::atomic<uint64_t>) == 8);

static_assert(std::is_standard_layout_v<ControlHeader>);
static_assert(sizeof(ControlHeader) == kControlHeaderBytes);
static_assert(offsetof(ControlHeader, layout_version) == 8);
static_assert(offsetof(ControlHeader, record_count) == 28);
static_assert(offsetof(ControlHeader, next_tensor_id) == 48);
static_assert(offsetof(ControlHeader, shm_prefix) == 64);

static_assert(std::is_standard_layout_v<SegmentRecord>);
static_assert(sizeof(SegmentRecord) == 64);
static_assert(offsetof(SegmentRecord, owner_uid) == 12);
static_assert(offsetof(SegmentRecord, segment_id) == 16);
static_assert(offsetof(SegmentRecord, size) == 24);
static_assert(offsetof(SegmentRecord, instance) == 32);
static_assert(offsetof(SegmentRecord, name_suffix) == 40);
static_assert(offsetof(SegmentRecord, held) == 48);

static_assert(std::is_standard_layout_v<TensorRecord>);
static_assert(sizeof(TensorRecord) == 1024);
static_assert(offsetof(TensorRecord, tensor_id) == 8);
static_assert(offsetof(TensorRecord, publish_seq) == 16);
static_assert(offsetof(TensorRecord, segment_id) == 24);
static_assert(offsetof(TensorRecord, offset) == 32);
static_assert(offsetof(TensorRecord, length) == 40);
static_assert(offsetof(TensorRecord, device_type) == 48);
static_assert(offsetof(TensorRecord, dtype_code) == 56);
static_assert(offsetof(TensorRecord, ndim) == 60);
static_assert(offsetof(TensorRecord, byte_offset) == 64);
static_assert(offsetof(TensorRecord, device_uuid) == 872);
static_assert(offsetof(TensorRecord, ready_event) == 888);
static_assert(offsetof(TensorRecord, nbytes) == 72);
static_assert(offsetof(TensorRecord, shape) == 80);
static_assert(offsetof(TensorRecord, strides) == 336);
static_assert(offsetof(TensorRecord, name) == 592);
static_assert(offsetof(TensorRecord, dlpack_flags) == 848);
static_assert(offsetof(TensorRecord, owner_uid) == 856);
static_assert(offsetof(TensorRecord, published_unix_ms) == 864);
static_assert(offsetof(TensorRecord, reserved) == 952);

// Byte offset of the first TensorRecord, and the whole segment's size, for `record_count`.
constexpr uint64_t RecordsOffset() {
  return kControlHeaderBytes + uint64_t{kMaxSegments} * sizeof(SegmentRecord);
}
constexpr uint64_t ControlSegmentBytes(uint32_t record_count) {
  return RecordsOffset() + uint64_t{record_count} * sizeof(TensorRecord);
}
static_assert(RecordsOffset() % alignof(TensorRecord) == 0);
static_assert(RecordsOffset() % 4096 == 0);

}  // namespace tensorshm

#endif  // TENSORSHM_COMMON_SHM_CATALOG_LAYOUT_H_
