// The mappings of tensorshm memory a write must never reach in this process (consumers'
// read-only segment mappings, the producer's segments where sealed buffers are read-only) and
// the daemons' control segments that say which tensor lies where. They are kept so that a write
// to a published tensor, which stops the process with SIGSEGV (the memory is shared and sealed),
// first says which tensor it hit, why it is read-only, and how to get a private copy.
//
// Lock-free and async-signal-safe on the reading side: the SIGSEGV handler reads them. The
// handler is installed with the first segment added (not when $TENSORSHM_SEGV_REPORT is "0"); it
// passes every fault on to the handler installed before it (or the default action) after at most
// one report, so the process stops as it would have without it.
#ifndef TENSORSHM_CLIENT_SEALED_RANGES_H_
#define TENSORSHM_CLIENT_SEALED_RANGES_H_

#include <cstdint>

namespace tensorshm {
namespace sealed_ranges {

// Host segment `segment_id` of daemon instance `instance` (a SegmentKey), mapped at
// [address, address + size): a write fault there is reported. Silently not kept when every slot
// is taken (thousands of segments: only the report goes).
void AddSegment(const void* address, uint64_t size, uint64_t instance, uint64_t segment_id);
// Before the mapping goes.
void RemoveSegment(const void* address);

// A daemon's control segment mapped read-only at [address, address + size), read to name the
// tensor a write hit. Removed before it is unmapped.
void AddCatalog(const void* address, uint64_t size);
void RemoveCatalog(const void* address);

// The report for a write fault at `fault` (what the handler writes to stderr), into `out` of
// `capacity` bytes; its length, 0 if `fault` lies in no segment added. For tests.
uint64_t Describe(uintptr_t fault, char* out, uint64_t capacity);

}  // namespace sealed_ranges
}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_SEALED_RANGES_H_
