#include "client/mappings.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tensorshm {

absl::StatusOr<std::shared_ptr<const SegmentMapping>> Mappings::HostSegment(const SegmentKey& key,
                                                                            uint64_t segment_size,
                                                                            uint64_t offset,
                                                                            uint64_t length) {
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> found = segments_.Find(key, segment_size);
  if (!found.ok() || *found != nullptr) return found;
  uint64_t size = 0;
  std::string shm_name;
  absl::StatusOr<UniqueFd> fd;
  if (std::shared_ptr<WritableSegment> own = segments_.FindWritable(key)) {
    // A segment of this process's own buffers (a put's lease): viewed read-only through the
    // descriptor it already holds, without asking the daemon.
    fd = own->DupDescriptor();
    size = own->size();
    shm_name = own->shm_name();
  } else {
    fd = channel_.RequestSegment(session_token_(), key.first, key.second, /*writable=*/false, &size,
                                 &shm_name);
  }
  if (!fd.ok()) return fd.status();
  if (size < segment_size) {
    return absl::InternalError(absl::StrCat("tensorshmd granted ", SegmentLabel(key), " as ", size,
                                            " bytes; its location said ", segment_size));
  }
  // The whole segment, as the daemon granted it (at least what the caller needs).
  absl::StatusOr<std::shared_ptr<const SegmentMapping>> mapping =
      segments_.Insert(key, *std::move(fd), size, std::move(shm_name), offset, length);
  if (mapping.ok() && (*mapping)->size() > length) {
    // The rest of the segment on the sender thread: a small first tensor does not wait for a
    // large segment, and later reads of it do not fault.
    populate_later_([mapping = *mapping] { mapping->Populate(); });
  }
  return mapping;
}

absl::StatusOr<CUdeviceptr> Mappings::CudaSegment(int ordinal, const v1::Location& location) {
  const SegmentKey key{location.segment_instance(), location.segment_id()};
  if (CudaState::Mapped mapped; cuda_.FindMapped(ordinal, key, &mapped)) return mapped.base;
  uint64_t size = 0;
  uint64_t granularity = 0;
  absl::StatusOr<UniqueFd> fd =
      channel_.RequestCudaSegment(session_token_(), location.cuda().device_ordinal(), key.first,
                                  key.second, &size, &granularity);
  if (!fd.ok()) return fd.status();
  if (size < location.segment_size()) {
    return absl::InternalError(absl::StrCat("tensorshmd granted cuda segment ", key.second, " as ",
                                            size, " bytes; its location said ",
                                            location.segment_size()));
  }
  return cuda_.MapVmmSegment(ordinal, key, *std::move(fd), size, granularity);
}

void Mappings::AdoptWritable(const v1::SegmentGrant& grant, UniqueFd fd) {
  const SegmentKey key{grant.segment_instance(), grant.segment_id()};
  if (!grant.writable() || segments_.FindWritable(key) != nullptr) return;
  (void)segments_.InsertWritable(key, std::move(fd), grant.size(), grant.shm_name());
}

absl::StatusOr<HostBuffer> Mappings::Buffer(const v1::Location& location, bool populate) {
  const SegmentKey key{location.segment_instance(), location.segment_id()};
  std::shared_ptr<WritableSegment> segment = segments_.FindWritable(key);
  if (segment == nullptr) {
    uint64_t size = 0;
    std::string shm_name;
    absl::StatusOr<UniqueFd> fd = channel_.RequestSegment(session_token_(), key.first, key.second,
                                                          /*writable=*/true, &size, &shm_name);
    if (!fd.ok()) return fd.status();
    absl::StatusOr<std::shared_ptr<WritableSegment>> inserted =
        segments_.InsertWritable(key, *std::move(fd), size, std::move(shm_name));
    if (!inserted.ok()) return inserted.status();
    segment = *std::move(inserted);
  }
  absl::StatusOr<char*> data = segment->Prepare(location.offset(), location.length(), populate);
  if (!data.ok()) return data.status();
  return HostBuffer{std::move(segment), *data};
}

}  // namespace tensorshm
