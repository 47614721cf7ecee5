// Pool growth as the catalog sees it: BeginGrowth and EndGrowth under the caller's lock, and
// SegmentGrowth::Make between them with that lock released (the service's GrowPools thread).
#include <utility>

#include "common/base/check.h"
#include "server/catalog/catalog.h"

namespace tensorshm {

void SegmentGrowth::Make() {
  if (cuda_pool != nullptr) {
    cuda_segment = cuda_pool->MakeSegment(request);
  } else {
    TSM_CHECK(host_pool != nullptr);
    // The room first: their pages are what the new segment's reservation may need.
    HostPool::DisposeSegments(std::move(given_back));
    given_back.clear();
    host_segment = host_pool->MakeSegment(request);
  }
}

void Catalog::BeginGrowth(SegmentGrowth& growth) {
  TSM_CHECK(growth.needed());
  if (growth.cuda_ordinal >= 0) {
    CudaPool* pool = cuda_pools_.at(growth.cuda_ordinal).get();
    pool->BeginGrowth();
    growth.cuda_pool = pool;
  } else {
    growth.given_back = pool_->BeginGrowth(growth.request);
    growth.host_pool = &*pool_;
  }
}

absl::Status Catalog::EndGrowth(SegmentGrowth& growth) {
  if (growth.cuda_ordinal >= 0) {
    return cuda_pools_.at(growth.cuda_ordinal)
        ->EndGrowth(growth.request, std::move(growth.cuda_segment));
  }
  return pool_->EndGrowth(growth.request, std::move(growth.host_segment));
}

}  // namespace tensorshm
