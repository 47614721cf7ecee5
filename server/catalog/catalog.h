// The catalog: every tensor the daemon holds memory for, the names bound to them, and their
// records in the control segment.
#ifndef TENSORSHM_SERVER_CATALOG_CATALOG_H_
#define TENSORSHM_SERVER_CATALOG_CATALOG_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/base/unique_fd.h"
#include "common/shm/catalog_layout.h"
#include "common/tensor/layout.h"
#include "server/catalog/catalog_index.h"
#include "server/catalog/lease_board.h"
#include "server/memory/control_segment.h"
#include "server/memory/cuda_pool.h"
#include "server/memory/host_pool.h"

namespace tensorshm {

struct Tensor {
  uint64_t id = 0;
  uint32_t slot = 0;  // index of its TensorRecord
  DLDataType dtype{};
  DLDevice device{kDLCPU, 0};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // resolved: one per dimension, in elements
  uint64_t byte_offset = 0;
  int64_t nbytes = 0;
  bool subbyte_padded = false;  // one byte per element of a sub-byte dtype
  Buffer buffer;                // length 0: empty tensor, no buffer
  bool sealed = false;
  uint64_t owner_session = 0;  // the creating session, while unpublished; 0: orphaned by a restart
  uint32_t owner_uid = 0;      // the uid whose session created (and published) it
  bool recovered = false;      // restored by Recover: not freed before the grace period ends
  std::string ready_event;     // CUDA: the producer's CUipcEventHandle, recorded at publish
  std::string name;            // bound name; empty when unbound
  int64_t leases = 0;
  // When Publish bound it (Unix epoch, ms); 0 until published, or unknown after a recovery.
  int64_t published_unix_ms = 0;
  // The publishing process (SO_PEERCRED); 0 when unknown (recovered, or not visible).
  int64_t publisher_pid = 0;
  // What the daemon wrote into its TensorRecord, beyond the fields above: the record must keep
  // saying so (see Catalog::Verify).
  uint64_t publish_seq = 0;                       // 0 until published
  RecordState record_state = RecordState::kFree;  // the state word last written
  std::string record_name;                        // the name the record holds (kept when unbound)
  // Non-empty once its record was found overwritten: what the record held instead.
  std::string damage;
  // Least-recently-used order for --evict lru (see Catalog::CreateEvicting): the catalog's use
  // clock when the tensor was last published or seen acquired, and the time then.
  uint64_t use_seq = 0;
  absl::Time last_use = absl::InfinitePast();
  bool acquired = false;  // seen acquired (an RPC lease, or a lease page slot) since publish
  // A stocked buffer (CreateRequest.stock) not yet published: memory made ahead of need, which
  // Stat reports as stock rather than used (see Catalog::MarkStocked).
  bool stocked = false;
};

// A pool segment that Create needs, made outside the caller's lock: Create fills `request` (and
// returns UNAVAILABLE), BeginGrowth marks the pool as growing, Make() creates the segment (the
// slow part: no lock needed, it touches only what the pool fixed at its creation), EndGrowth
// adds it. With `request.busy` another caller is growing that pool: wait for it and retry.
struct SegmentGrowth {
  int cuda_ordinal = -1;  // the pool: -1 the host pool, else the CUDA pool of that ordinal
  GrowthRequest request;

  // Set by BeginGrowth, filled by Make.
  const HostPool* host_pool = nullptr;
  const CudaPool* cuda_pool = nullptr;
  absl::StatusOr<ShmSegment> host_segment = absl::UnknownError("segment not made");
  absl::StatusOr<CudaPool::DeviceMemory> cuda_segment = absl::UnknownError("segment not made");
  // Set by BeginGrowth: host segments given back to make room, emptied and closed by Make before
  // it makes the new one (outside the caller's lock: see HostPool::BeginGrowth).
  std::vector<ShmSegment> given_back;

  // Whether Create asked for a new segment, or to wait for one being made.
  bool needed() const { return request.needed; }
  bool busy() const { return request.busy; }
  void Make();
};

struct CatalogOptions {
  std::string shm_prefix;
  uint64_t host_pool_bytes = 0;
  uint64_t host_segment_bytes = 0;
  uint32_t max_tensors = 0;
  // Named objects survive the daemon (recovery); memfds are not bound by /dev/shm's size.
  SegmentBacking backing = SegmentBacking::kNamed;
  uint32_t owner_uid = 0;                         // the daemon's uid (see HostPoolOptions)
  uint64_t instance_id = 0;                       // this daemon start's, random and non-zero
  std::optional<gid_t> shm_group = std::nullopt;  // --shm-group (see HostPoolOptions::group)
};

// The host pool's part of `options`.
inline HostPoolOptions HostPoolOptionsOf(const CatalogOptions& options) {
  return HostPoolOptions{options.shm_prefix, options.host_pool_bytes, options.host_segment_bytes,
                         options.backing,    options.owner_uid,       options.instance_id,
                         options.shm_group};
}

// Thread-compatible: the service serialises all calls under its mutex. Tensor pointers returned
// stay valid until the tensor is freed (by Release, Delete, Abandon or a replace).
//
// The control segment is shared memory that any process of the daemon's uid can open read-write,
// so the catalog trusts nothing it reads there after Create / Recover: its record count, tensor
// ids and publish sequence numbers live in its own memory (they are only stored into the header,
// for a later recovery), and a tensor whose record no longer says what the daemon wrote is
// damaged (see Verify), never a reason to stop.
//
// Two kinds of lease keep a tensor's memory: counted ones (AddLease, the RPC path) and the slots
// of lease pages (the fast path, see LeaseBoard). A tensor whose name went and whose counted
// leases ended is freed at once unless a lease page holds it; then it is "retired" and freed by a
// later Reclaim that finds no page holding it.
class Catalog {
 public:
  // Creates the control segment and the host pool. Errors from either.
  static absl::StatusOr<std::unique_ptr<Catalog>> Create(const CatalogOptions& options);

  // Rebuilds the catalog of a daemon that was killed (or stopped with --keep-segments) from its
  // control segment "/<prefix>.ctl": re-opens the pool's segments, serves every committed
  // (published) record again, keeps unbound-but-leased ones until ExpireUnbound, and reclaims
  // records that were never committed. Records that do not describe a valid tensor inside the
  // pool are dropped with a warning. Errors from opening the segments; on error every object is
  // left in place (an object the daemon did not create is refused, never removed).
  static absl::StatusOr<std::unique_ptr<Catalog>> Recover(const CatalogOptions& options);

  // Ends a restart's grace period, in which clients that held tensors could come back: frees every
  // unbound tensor no lease holds and every unpublished one nobody re-adopted. Returns how many.
  int ExpireUnbound();

  // True from Recover until ExpireUnbound: reconnecting clients may re-register what they hold.
  bool in_grace() const { return in_grace_; }

  // A reconnecting client's lease on `tensor_id`, held before the restart: counted again.
  // FAILED_PRECONDITION outside the grace period, NOT_FOUND if the tensor is gone or unpublished.
  absl::Status ReattachLease(uint64_t tensor_id);

  // A reconnecting producer takes back its unpublished tensor `tensor_id` for `session`.
  // FAILED_PRECONDITION outside the grace period or if already taken back or published,
  // NOT_FOUND if gone, PERMISSION_DENIED if `uid` did not create it.
  absl::Status Readopt(uint64_t session, uint32_t uid, uint64_t tensor_id);

  // Adds the pool of a CUDA device. REQUIRES: none for that ordinal yet.
  void AddCudaPool(std::unique_ptr<CudaPool> pool);
  // The pool of CUDA device `ordinal` (the daemon's numbering), or nullptr.
  const CudaPool* cuda_pool(int ordinal) const;
  std::vector<const CudaPool*> cuda_pools() const;

  // Leaves the control segment and every pool segment in place at destruction
  // (--keep-segments), for a later daemon with the same --shm-prefix.
  void KeepSegments();

  // Allocates a writable tensor owned by `session`. INVALID_ARGUMENT for a bad dtype / shape /
  // strides / device, FAILED_PRECONDITION for a device without a pool, RESOURCE_EXHAUSTED when
  // the pool or the record table is full. With `growth`, a pool that needs a new segment does
  // not make it: UNAVAILABLE, nothing changed, and `*growth` says what to do (see SegmentGrowth).
  absl::StatusOr<const Tensor*> Create(uint64_t session, const DLDataType& dtype,
                                       absl::Span<const int64_t> shape,
                                       absl::Span<const int64_t> strides, const DLDevice& device,
                                       bool subbyte_padded = false, uint32_t owner_uid = 0,
                                       SegmentGrowth* growth = nullptr);

  // Growing a pool outside the caller's lock (see SegmentGrowth). REQUIRES: `growth` was filled
  // by Create with needed(); EndGrowth after BeginGrowth and Make. EndGrowth returns Make's error,
  // if any (the pool is then as before).
  void BeginGrowth(SegmentGrowth& growth);
  absl::Status EndGrowth(SegmentGrowth& growth);

  // Seals `tensor_id` (created by `session`) and binds it to `name`. NOT_FOUND for an unknown
  // tensor, PERMISSION_DENIED if another session created it, FAILED_PRECONDITION if already
  // published, ALREADY_EXISTS if `name` is bound and !replace. With replace, the old tensor is
  // unbound and freed once unleased. REQUIRES: name valid.
  // `ready_event`: for a CUDA tensor, the producer's event handle that acquirers wait on.
  // `publisher_pid`: the publishing process, kept for List (0: unknown).
  absl::Status Publish(uint64_t session, uint64_t tensor_id, const std::string& name, bool replace,
                       std::string ready_event = "", int64_t publisher_pid = 0);

  // Gives the unpublished host tensor `tensor_id` of `session` a new dtype, shape and strides
  // (empty: C-contiguous) over the same buffer: how a stocked buffer becomes the tensor its
  // client made. NOT_FOUND / PERMISSION_DENIED / FAILED_PRECONDITION as Publish;
  // INVALID_ARGUMENT for a bad layout, or one that does not fit the buffer.
  absl::Status Reshape(uint64_t session, uint64_t tensor_id, const DLDataType& dtype,
                       absl::Span<const int64_t> shape, absl::Span<const int64_t> strides,
                       bool subbyte_padded);

  // Marks `tensor_id`, an unpublished host tensor with a buffer that Create just made, as stock:
  // from now until it is published or freed it counts in stock_bytes() and stocked_tensors().
  // The daemon cannot tell when a client takes a stocked buffer to fill it (it takes it without
  // a call), so a buffer being filled stays stock until its publish.
  // REQUIRES: such a tensor, not marked yet.
  void MarkStocked(uint64_t tensor_id);
  // Stocked buffers now: their count and the bytes of their buffers (all in the host pool).
  int64_t stocked_tensors() const { return stocked_tensors_; }
  uint64_t stock_bytes() const { return stock_bytes_; }

  // The sealed tensor bound to `name`, or nullptr.
  const Tensor* Find(const std::string& name) const;
  const Tensor* FindId(uint64_t tensor_id) const;

  // Lease counting. REQUIRES: a sealed tensor; DropLease on a tensor with leases. AddLease
  // also counts as a use of the tensor for --evict lru.
  void AddLease(uint64_t tensor_id);
  void DropLease(uint64_t tensor_id);

  // Lease pages: the page of `session` (read-write descriptor for its client, made on first
  // use), its slots counted for `uid`; dropped whole when the session ends (then Reclaim);
  // DropLeasePage returns how many of its slots counted as leases then. Errors from making the
  // page. What a page's slots count for is LeaseBoard's rule: only tensors the session could
  // acquire, within its uid's --uid-leases (see CountPageLeasesIn).
  absl::StatusOr<UniqueFd> OpenLeasePage(uint64_t session, uint32_t uid) {
    return lease_board_.Open(session, uid);
  }
  int64_t DropLeasePage(uint64_t session) { return lease_board_.Drop(session); }
  // Counts lease page slots in `limits` (--uid-leases) from now on; nullptr: no longer (gives
  // them back). REQUIRES: no page slot counts yet when set; unset before `limits` goes.
  void CountPageLeasesIn(UidLimits* limits) { lease_board_.set_uid_limits(limits); }
  // Takes in what lease pages changed since they were last read, a bounded amount per call (see
  // LeaseBoard::Read): what LeaseCount, PageLeaseCount, --evict lru and Stat figures see. The
  // housekeeping round calls it, and calls that report leases before they read them.
  void ReadLeasePages();
  // Frees every retired tensor that no lease page holds now (reading only the slots that held it
  // when its name went). Returns how many.
  int Reclaim();
  // Number of retired tensors waiting for lease pages to let go.
  size_t retired_count() const { return retired_.size(); }
  // Leases of `tensor` of both kinds; all leases of both kinds (page slots as last read).
  int64_t LeaseCount(const Tensor& tensor) const;
  int64_t PageLeaseCount() const { return lease_board_.held_slots(); }
  // Slots of `session`'s lease page counting as leases, its page read now; 0 if it has no page.
  int64_t PageLeasesOf(uint64_t session);
  // Acquires the clients' fast paths served since the catalog was made, as their lease pages
  // count them (see LeaseBoard::FastAcquires): never decreasing.
  uint64_t FastAcquires() { return lease_board_.FastAcquires(); }

  // The index clients read (descriptor through the memory channel).
  const CatalogIndex& index() const { return index_; }
  CatalogIndex& mutable_index() { return index_; }

  // Unbinds `name`; memory is freed now if unleased, else at the last DropLease. NOT_FOUND if
  // unbound.
  absl::Status Delete(const std::string& name);

  // Frees the unpublished tensor `tensor_id` created by `session`. NOT_FOUND / PERMISSION_DENIED /
  // FAILED_PRECONDITION (already published) otherwise.
  absl::Status Abandon(uint64_t session, uint64_t tensor_id);

  // OK while the record of tensor `tensor_id` says what the daemon wrote into it. Otherwise,
  // found now or before, the tensor is damaged: DATA_LOSS naming its name, id and what its record
  // holds. Finding it damaged logs that once and turns its index entry, while it is bound, into
  // "ask the daemon" (clients then acquire over RPC, which answers this). A damaged tensor can
  // still be deleted and replaced, and is freed as usual once unleased; its slot's record is
  // rewritten when the slot is reused. NOT_FOUND for an unknown id.
  absl::Status Verify(uint64_t tensor_id);

  // Verifies the records of up to `budget` tensors, taking up where the last call stopped (the
  // housekeeping thread's incremental sweep), and writes back the control segment's header and
  // segment records where they no longer say what the daemon knows (see
  // ControlSegment::RepairHeader, HostPool::RepairSegmentRecords). Returns how many tensors were
  // found damaged in this call.
  int CheckRecords(size_t budget);

  // Tensors found damaged that still hold memory.
  int64_t damaged_count() const;
  // The next tensor id and publish sequence number to hand out.
  uint64_t next_tensor_id() const { return next_tensor_id_; }
  uint64_t next_publish_seq() const { return next_publish_seq_; }

  // Bound names starting with `prefix`, in name order.
  std::vector<const Tensor*> List(const std::string& prefix) const;

  // ---- Records per uid (--uid-tensors) ----

  // The most tensor records one uid may hold at once (0: no limit; see UidLimitsConfig::tensors).
  // Create refuses a create of a uid at the limit. A limit of the whole catalog or more is none:
  // the uid then meets a full record table (--max-tensors), which a create may wait for. Call
  // before the first Create.
  void set_uid_tensors(uint64_t limit) {
    uid_tensors_ = limit >= control_.record_count() ? 0 : limit;
  }
  uint64_t uid_tensors() const { return uid_tensors_; }
  // The records `uid` holds now: every tensor its sessions created that still has one, whatever
  // its state (unpublished, stocked, published and bound, or unbound and still leased), zero-byte
  // tensors included. Unlike sessions and leases, these outlive the sessions that made them.
  uint64_t RecordsOf(uint32_t uid) const;
  // OK if `uid` may take one more record now. At its --uid-tensors limit: with `evict` (--evict
  // lru), its own published tensors that nothing holds are evicted, least recently used first,
  // until it is below (never another uid's: see CreateEvicting); without, or with none left to
  // evict, RESOURCE_EXHAUSTED naming the uid, its records, the limit and --uid-tensors.
  absl::Status RoomForRecord(uint32_t uid, bool evict);

  // ---- Full pools (catalog_eviction.cc) ----

  // As Create, and when the pool (or the record table) is full, first evicts published tensors
  // that nothing holds (no counted lease, no lease page slot, not kept by a restart's grace
  // period), least recently used first (see Tensor::use_seq), as few as make the buffer fit: an
  // eviction unbinds the name as Delete does (a lease page that took the tensor meanwhile keeps
  // its memory until it lets go) and logs one line. Evicts nothing when evicting every candidate
  // would still not make room; then, or when a race left it short, RESOURCE_EXHAUSTED as Create.
  //
  // Whose tensors: the creating uid's own first. Another uid's only for a creating uid within its
  // share, and only tensors of a uid past its share: of records (--uid-tensors, or with no limit
  // the records divided evenly between the uids holding some and the creating one) when the record
  // table is full, of the CUDA pool's bytes (divided the same way) when a CUDA pool is. A host
  // create evicts only its own uid's tensors: its buffers lie in segments of its own (see
  // HostPool), which nobody else's tensors occupy.
  absl::StatusOr<const Tensor*> CreateEvicting(uint64_t session, const DLDataType& dtype,
                                               absl::Span<const int64_t> shape,
                                               absl::Span<const int64_t> strides,
                                               const DLDevice& device, bool subbyte_padded,
                                               uint32_t owner_uid, SegmentGrowth* growth);

  // Counts as used now every tensor counted lease page slots hold (as of the last
  // ReadLeasePages, which the housekeeping round calls first), and every tensor the pages' recent
  // rings name (the latest fast acquires since the last call, see LeaseBoard::TakeRecent): how
  // --evict lru learns of fast path acquires, which never reach the daemon (called every
  // housekeeping round). The cheapest honest reading of the pages: a round reads each page's
  // slots (as ReadLeasePages does anyway) and at most kLeaseRecentSlots ring entries, and the
  // client pays two stores per acquire. What it misses: a tensor acquired and released between two
  // rounds by a session that made more than kLeaseRecentSlots fast acquires after it in that
  // round; its recency is then that of its last acquire seen, or its publish. Recency is only as
  // fine as a round (kHeartbeatIntervalNs). A client can name any tensor id in its page; that
  // only makes the tensor look used, which a lease would do too. A tensor that a page held at the
  // last call and none holds now may have become evictable: it moves release_epoch().
  void TouchHeld();

  // Moves whenever memory may have become available to a create: a buffer freed, a tensor's
  // last counted lease dropped, a lease page letting go of a tensor (seen by TouchHeld).
  uint64_t release_epoch() const { return release_epoch_; }
  int64_t evicted_tensors() const { return evicted_tensors_; }
  int64_t evicted_bytes() const { return evicted_bytes_; }

  // This daemon start's id (SessionOpened.instance_id); CUDA segments belong to it.
  uint64_t instance_id() const { return instance_id_; }
  int64_t tensor_count() const { return static_cast<int64_t>(tensors_.size()); }
  int64_t name_count() const { return static_cast<int64_t>(names_.size()); }
  const HostPool& host_pool() const { return *pool_; }
  HostPool& mutable_host_pool() { return *pool_; }
  const ControlSegment& control() const { return control_; }

 private:
  Catalog(ControlSegment control, CatalogIndex index, uint64_t instance_id,
          bool all_slots_free = true);
  // Turns `record` (a copy of the one in `slot`, in state `state`) back into a Tensor (sealed
  // unless kWriting), reserving its buffer; false if it is invalid.
  bool Restore(uint32_t slot, const TensorRecord& record, RecordState state);
  // After its name went (unlinked from the index already): frees the tensor unless leases or
  // the grace period keep it.
  void Unbind(std::map<uint64_t, Tensor>::iterator it);
  // Frees an unbound tensor that no counted lease holds, unless the grace period keeps it or a
  // lease page holds it (then it is retired).
  void FreeIfUnheld(std::map<uint64_t, Tensor>::iterator it);
  // Whether `session` could hold `tensor_id` in its lease page now: a sealed tensor bound to a
  // name, or its own unpublished tensor (publish-and-acquire leases it before the publish). What
  // a lease page slot may count for, see LeaseBoard.
  bool Acquirable(uint64_t session, uint64_t tensor_id) const;
  // Acquirable, for LeaseBoard calls.
  auto CanHold() const {
    return [this](uint64_t session, uint64_t tensor_id) { return Acquirable(session, tensor_id); };
  }
  void Free(std::map<uint64_t, Tensor>::iterator it);
  // Takes `tensor` out of the stock figures if it is stocked (published or freed).
  void Unstock(Tensor& tensor);
  // The unpublished tensor `tensor_id` of `session`: NOT_FOUND, FAILED_PRECONDITION (published)
  // or PERMISSION_DENIED (another session's) otherwise.
  absl::StatusOr<std::map<uint64_t, Tensor>::iterator> FindUnpublished(uint64_t session,
                                                                       uint64_t tensor_id);
  void WriteRecordState(Tensor& tensor, RecordState state);
  // Writes every field of `tensor`'s record afresh (a reused slot), state kWriting last.
  void WriteNewRecord(Tensor& tensor);
  // Empty if `tensor`'s record says what the daemon wrote; else the first field that does not,
  // with the value found and the one expected.
  std::string RecordMismatch(const Tensor& tensor) const;
  // Records that `tensor`'s record holds `found`: logs it, and points its index entry (if bound)
  // to the daemon.
  void MarkDamaged(Tensor& tensor, std::string found);
  // DATA_LOSS for damaged `tensor`.
  absl::Status DamageError(const Tensor& tensor) const;
  // Hands out the next tensor id / publish sequence number, storing the one after into the
  // shared header for a later recovery.
  uint64_t TakeTensorId();
  uint64_t TakePublishSeq();
  // Gives `tensor` the dtype, shape and `layout` (from ComputeLayout) it describes.
  static void SetLayout(Tensor& tensor, const DLDataType& dtype, absl::Span<const int64_t> shape,
                        TensorLayout layout, bool subbyte_padded);
  // Writes `tensor`'s dtype, shape, strides, offset, size and flags into `record`.
  static void WriteRecordLayout(const Tensor& tensor, TensorRecord& record);
  // Marks `tensor` used now (LRU order).
  void Touch(Tensor& tensor);
  // The evictable tensors, least recently used first: bound, unleased, unheld by `held` (the
  // lease pages' tensors), not recovered. For a record (`for_record`): on any device, zero-byte
  // tensors included; else for bytes: with a buffer, on `device` (and, on the host pool, in
  // `uid`'s segments).
  std::vector<Tensor*> EvictionCandidates(const DLDevice& device, uint32_t uid, bool for_record,
                                          const std::unordered_map<uint64_t, int64_t>& held);
  // Unbinds `tensor`'s name as Delete does; logs it, saying that it made room for `why` ("a
  // create of ... (pool full"), and counts it.
  void Evict(Tensor& tensor, const std::string& why);
  // A uid's fair share of the record table when the record table is full: --uid-tensors, or with
  // no limit the records divided between the uids holding some and `uid`.
  uint64_t RecordShare(uint32_t uid) const;
  // Adds (`delta` 1) or takes away (-1) one record of `uid` in records_of_.
  void CountRecord(uint32_t uid, int delta);

  ControlSegment control_;
  CatalogIndex index_;
  LeaseBoard lease_board_;
  const uint64_t instance_id_;
  std::optional<HostPool> pool_;                         // set by Create; refers to control_
  std::map<int, std::unique_ptr<CudaPool>> cuda_pools_;  // by the daemon's device ordinal
  std::vector<uint32_t> free_slots_;
  std::map<uint64_t, Tensor> tensors_;               // by id
  std::unordered_map<std::string, uint64_t> names_;  // bound name -> tensor id
  std::set<uint64_t> retired_;                       // ids: unbound, held by lease pages only
  bool in_grace_ = false;
  uint64_t next_tensor_id_ = 1;
  uint64_t next_publish_seq_ = 1;
  uint64_t sweep_after_ = 0;      // CheckRecords goes on with the tensor ids above this one
  bool reported_repair_ = false;  // a rewritten header or segment record was logged
  uint64_t use_clock_ = 0;        // last Tensor::use_seq handed out
  uint64_t release_epoch_ = 0;
  std::set<uint64_t> held_last_;  // what lease pages held at the last TouchHeld
  // Records per uid (RecordsOf); only uids holding one. --uid-tensors: 0 no limit.
  std::unordered_map<uint32_t, uint64_t> records_of_;
  uint64_t uid_tensors_ = 0;
  int64_t evicted_tensors_ = 0;
  int64_t evicted_bytes_ = 0;
  int64_t stocked_tensors_ = 0;  // tensors with `stocked` set, and their buffers' bytes
  uint64_t stock_bytes_ = 0;
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_CATALOG_CATALOG_H_
