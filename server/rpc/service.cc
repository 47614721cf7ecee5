#include "server/rpc/service.h"

#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/check.h"
#include "common/tensor/grpc_status.h"
#include "common/tensor/name.h"
#include "common/tensor/wire.h"
#include "server/ops/log.h"

namespace tensorshm {
namespace {

// Stocked buffers (CreateRequest.stock): at most this many per request, of at most this size.
constexpr uint32_t kMaxStock = 64;
constexpr uint64_t kMaxStockedBytes = 4 << 20;

// Ids of each kind one ReleaseBatch may carry (clients send at most 4096): each refused id costs
// a Rejection in the ack, many times its own size.
constexpr int kMaxReleaseIds = 16384;

// Records the housekeeping thread compares with the catalog's own copies each round (every
// kHeartbeatIntervalNs): a table of 65,536 records in under 3 s, some tens of microseconds a round.
constexpr size_t kRecordsCheckedPerRound = 256;

}  // namespace

TensorShmService::TensorShmService(std::unique_ptr<Catalog> catalog, uint64_t session_quota_bytes,
                                   const AccessPolicy* policy, const PeerTable* peers,
                                   const UidLimitsConfig& uid_limits)
    : index_(catalog->mutable_index()),
      catalog_(std::move(catalog)),
      session_quota_bytes_(session_quota_bytes),
      policy_(policy),
      peers_(peers),
      uid_limits_(uid_limits) {
  // The host pool is shared evenly between the uids creating tensors (HostPool::FairShare).
  catalog_->mutable_host_pool().set_creating_uids([this] { return uid_limits_.CreatingUids(); });
  // Tensor records outlive sessions: the catalog counts them per uid (--uid-tensors).
  catalog_->set_uid_tensors(uid_limits.tensors);
  // Lease page slots count against --uid-leases with the RPC leases (see LeaseBoard).
  catalog_->CountPageLeasesIn(&uid_limits_);
}

TensorShmService::~TensorShmService() {
  // uid_limits_ goes before catalog_, whose lease pages may still count slots in it.
  catalog_->CountPageLeasesIn(nullptr);
}

absl::Duration TensorShmService::CrossCancelHoldFromEnvironment() {
  const char* value = std::getenv("TENSORSHMD_TEST_CROSS_CANCEL_MS");
  int64_t ms = 0;
  if (value == nullptr || !absl::SimpleAtoi(value, &ms) || ms <= 0) return absl::ZeroDuration();
  TSM_LOG(kWarning) << "TENSORSHMD_TEST_CROSS_CANCEL_MS = " << ms
                    << ": test mode (answers held back, no fast path); never in production";
  return absl::Milliseconds(ms);
}

absl::Duration TensorShmService::GrowthDelayFromEnvironment() {
  const char* value = std::getenv("TENSORSHMD_TEST_GROWTH_DELAY_MS");
  int64_t ms = 0;
  if (value == nullptr || !absl::SimpleAtoi(value, &ms) || ms <= 0) return absl::ZeroDuration();
  TSM_LOG(kWarning) << "TENSORSHMD_TEST_GROWTH_DELAY_MS = " << ms
                    << ": test mode (every pool growth is slowed down); never in production";
  return absl::Milliseconds(ms);
}

void TensorShmService::FinishGranting(grpc::ServerUnaryReactor* reactor, grpc::Status status,
                                      bool granted) {
  if (!granted || cross_cancel_hold_ == absl::ZeroDuration() || !status.ok()) {
    reactor->Finish(std::move(status));
    return;
  }
  // Test only: the answer leaves later, on a thread of its own. gRPC's shutdown waits for it
  // (the call is not done until it is finished).
  std::thread([reactor, status = std::move(status), hold = cross_cancel_hold_]() mutable {
    absl::SleepFor(hold);
    reactor->Finish(std::move(status));
  }).detach();
}

grpc::ServerUnaryReactor* TensorShmService::Unary(
    grpc::CallbackServerContext* context, const UnaryFrame& frame,
    absl::FunctionRef<absl::Status(UnaryCall&)> body) {
  grpc::ServerUnaryReactor* reactor =
      frame.reactor != nullptr ? frame.reactor : context->DefaultReactor();
  bool answered_later = false;
  const absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<PeerCredentials> peer = Admit(*context);
    if (!peer.ok()) return peer.status();
    if (!frame.checked.ok()) return frame.checked;
    ServiceLock lock(this);
    UnaryCall call{*peer, reactor};
    if (frame.needs_session) {
      absl::StatusOr<tensorshm::Session*> session = CallerSession(*context, *peer);
      if (!session.ok()) return session.status();
      call.session = *session;
    }
    const absl::Status answer = body(call);
    answered_later = call.answered_later;
    return answer;
  }();  // `lock` goes: what the body queued is finished
  if (answered_later) return reactor;
  if (frame.counted) metrics_.CountOp(frame.op, status);
  FinishGranting(reactor, ToGrpcStatus(status), status.ok() && frame.request_id != 0);
  return reactor;
}

absl::Status TensorShmService::MayChange(const tensorshm::Session& session, const Tensor& tensor,
                                         absl::string_view verb) const {
  if (policy_ == nullptr || session.uid == tensor.owner_uid || session.uid == policy_->owner()) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "name = \"", tensor.name, "\": published by uid ", tensor.owner_uid, "; uid ", session.uid,
      " may not ", verb, " it (only its publisher and the daemon's uid may)"));
}

int TensorShmService::ExpireUnbound() {
  ServiceLock lock(this);
  return catalog_->ExpireUnbound();
}

void TensorShmService::KeepHeldOnStop() {
  ServiceLock lock(this);
  keep_held_on_stop_ = true;
}

void TensorShmService::KeepSegments() {
  ServiceLock lock(this);
  catalog_->KeepSegments();
}

absl::StatusOr<PeerCredentials> TensorShmService::Admit(
    const grpc::ServerContextBase& context) const {
  if (policy_ == nullptr || peers_ == nullptr) return PeerCredentials{};
  absl::StatusOr<PeerCredentials> peer = peers_->Find(context.peer());
  if (!peer.ok()) {
    return absl::PermissionDeniedError(
        absl::StrCat("connection ", context.peer(), ": peer credentials unknown"));
  }
  if (absl::Status s = policy_->Admit(*peer); !s.ok()) return s;
  return *peer;
}

void TensorShmService::Housekeep() {
  while (true) {
    // The heartbeat does not wait for the mutex: a long call (a segment growing) must not make
    // clients take the daemon for dead.
    index_.Heartbeat();
    ServiceLock lock(this);
    if (shutting_down_) return;
    catalog_->ReadLeasePages();
    catalog_->Reclaim();
    // --evict lru learns of fast path acquires from the lease pages (Catalog::TouchHeld).
    if (evict_ == EvictPolicy::kLru) catalog_->TouchHeld();
    FoldFastAcquires();
    catalog_->CheckRecords(kRecordsCheckedPerRound);
    stopping_.WaitWithTimeout(&mu_, absl::Nanoseconds(kHeartbeatIntervalNs));
    if (shutting_down_) return;
  }
}

void TensorShmService::FoldFastAcquires() {
  const uint64_t total = catalog_->FastAcquires();
  // The board's total never decreases.
  TSM_CHECK(total >= fast_acquires_counted_);
  metrics_.CountFastAcquires(total - fast_acquires_counted_);
  fast_acquires_counted_ = total;
}

absl::Status TensorShmService::NoSession(const std::string& token) {
  return absl::FailedPreconditionError(
      absl::StrCat("metadata ", kSessionMetadataKey, " = \"", absl::CHexEscape(token.substr(0, 64)),
                   "\": no open session has this id (its stream ended, or it never existed)"));
}

absl::StatusOr<Session*> TensorShmService::CallerSession(const grpc::ServerContextBase& context,
                                                         const PeerCredentials& caller) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kSessionMetadataKey);
  if (it == metadata.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata ", kSessionMetadataKey, ": missing; open a Session stream and send its id"));
  }
  std::string token(it->second.data(), it->second.size());
  tensorshm::Session* session = sessions_.Find(token);
  if (session == nullptr) return NoSession(token);
  if (absl::Status s = session->CheckCaller(caller); !s.ok()) return s;
  return session;
}

void TensorShmService::Describe(const Tensor& tensor, v1::TensorDesc* desc,
                                v1::Location* location) const {
  ToWire(tensor.dtype, desc->mutable_dtype());
  ToWire(tensor.device, desc->mutable_device());
  desc->mutable_shape()->Assign(tensor.shape.begin(), tensor.shape.end());
  desc->mutable_strides()->Assign(tensor.strides.begin(), tensor.strides.end());
  desc->set_byte_offset(tensor.byte_offset);
  desc->set_nbytes(tensor.nbytes);
  desc->set_flags(tensor.subbyte_padded ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : 0);
  if (location == nullptr) return;
  location->set_segment_id(tensor.buffer.segment_id);
  location->set_offset(tensor.buffer.offset);
  location->set_length(tensor.buffer.length);
  // CUDA segments are always this daemon's own (device memory does not survive it).
  location->set_segment_instance(catalog_->instance_id());
  if (tensor.device.device_type == kDLCUDA) {
    const CudaPool* pool = catalog_->cuda_pool(tensor.device.device_id);
    v1::CudaLocation* cuda = location->mutable_cuda();
    cuda->set_device_ordinal(pool->ordinal());
    cuda->set_device_uuid(pool->uuid().data(), pool->uuid().size());
    if (tensor.buffer.length > 0) {
      const CUipcMemHandle& handle = pool->SegmentHandle(tensor.buffer.segment_id);
      location->set_segment_size(pool->SegmentSize(tensor.buffer.segment_id));
      cuda->set_ipc_handle(handle.reserved, sizeof(handle.reserved));
    }
    if (tensor.sealed) cuda->set_ready_event(tensor.ready_event);
  } else if (tensor.buffer.length > 0) {
    const HostPool& pool = catalog_->host_pool();
    location->set_segment_size(pool.SegmentSize(tensor.buffer.segment_id));
    location->set_segment_instance(pool.SegmentInstance(tensor.buffer.segment_id));
    // Each segment's own backing: a pool of named segments gives other uids memfd ones.
    const ShmSegment& segment = pool.Segment(tensor.buffer.segment_id);
    location->mutable_host()->set_shm_name(
        segment.backing() == SegmentBacking::kNamed ? segment.name() : "");
  }
}

ChannelReply TensorShmService::HandleChannel(ChannelConnection& connection,
                                             const v1::ChannelRequest& request) {
  ChannelReply reply;
  reply.response.set_sequence(request.sequence());
  absl::Status status = [&]() -> absl::Status {
    if (policy_ != nullptr) {
      if (absl::Status s = policy_->Admit(connection.peer); !s.ok()) return s;
    }
    // A consumer waiting for the name wakes while the publish is committed, not after it (the
    // index's header needs no lock; see CatalogIndex::WakeWaiters).
    if (request.has_publish()) index_.WakeWaiters();
    ServiceLock lock(this);
    if (request.has_bind()) {
      if (!connection.session_token.empty()) {
        return absl::FailedPreconditionError("bind: this channel is bound to a session already");
      }
      const tensorshm::Session* session = sessions_.Find(request.bind().session_id());
      if (session == nullptr) {
        return absl::FailedPreconditionError(
            "bind.session_id: no open session has this id (its stream ended, or it never "
            "existed)");
      }
      // Only the process that opened the session may bind to it: a token seen by another
      // process (a forked child, a leaked log) is worth nothing on its own. Both pids are the
      // kernel's; a client whose pid namespace the daemon cannot see has pid 0 on both
      // connections, and is then known by its uid and gid alone.
      if (session->uid != connection.peer.uid || session->gid != connection.peer.gid ||
          session->peer_pid != connection.peer.pid) {
        return absl::PermissionDeniedError(absl::StrCat(
            "bind.session_id: the session belongs to pid ", session->peer_pid, " (uid ",
            session->uid, ", gid ", session->gid, "); this connection is pid ", connection.peer.pid,
            " (uid ", connection.peer.uid, ", gid ", connection.peer.gid, ")"));
      }
      connection.session_token = request.bind().session_id();
      reply.response.mutable_bound()->set_instance_id(catalog_->instance_id());
      return absl::OkStatus();
    }
    if (request.kind_case() == v1::ChannelRequest::KIND_NOT_SET) {
      return absl::InvalidArgumentError(
          "kind: not set (bind, segment, fast_path, create or publish)");
    }
    if (connection.session_token.empty()) {
      return absl::FailedPreconditionError("kind: bind the channel to a session first");
    }
    tensorshm::Session* session = sessions_.Find(connection.session_token);
    if (session == nullptr) {
      return absl::FailedPreconditionError(
          "kind: the session this channel is bound to has ended; reconnect");
    }
    absl::StatusOr<int> fd = -1;
    switch (request.kind_case()) {
      case v1::ChannelRequest::kSegment:
        fd = GrantSegment(*session, request.segment(), reply.response.mutable_segment());
        break;
      case v1::ChannelRequest::kFastPath:
        fd = GrantFastPath(*session, request.fast_path(), reply.response.mutable_fast_path());
        break;
      case v1::ChannelRequest::kCreate: {
        SegmentGrowth growth;
        absl::Status created =
            CreateFor(*session, request.create(), reply.response.mutable_created(), &growth);
        if (!growth.needed() && !growth.busy()) return created;
        // This thread serves every client's channel: it never makes a segment (posix_fallocate,
        // cuMemAlloc), nor waits for one. UNAVAILABLE sends the client to the gRPC Create, which
        // GrowPools answers once the pool has grown.
        return absl::UnavailableError(
            "create: the pool must grow first; the gRPC Create waits for that");
      }
      case v1::ChannelRequest::kPublish:
        return PublishFor(*session, request.publish(), reply.response.mutable_published());
      case v1::ChannelRequest::kDelete:
        reply.response.mutable_deleted();
        return DeleteFor(*session, request.delete_());
      default:
        return absl::InvalidArgumentError("kind: not a request this daemon knows");
    }
    if (!fd.ok()) return fd.status();
    reply.fd = *fd;
    return absl::OkStatus();
  }();
  metrics_.CountOp(ChannelRequestOp(request), status);
  if (!status.ok()) {
    reply.response.clear_kind();
    reply.response.set_code(static_cast<int32_t>(status.code()));
    reply.response.set_message(std::string(status.message()));
  }
  return reply;
}

absl::StatusOr<int> TensorShmService::GrantFastPath(const tensorshm::Session& session,
                                                    const v1::FastPathRequest& request,
                                                    v1::FastPathGrant* grant) {
  if (cross_cancel_hold_ > absl::ZeroDuration()) {
    return absl::FailedPreconditionError(
        "fast_path: not offered under TENSORSHMD_TEST_CROSS_CANCEL_MS (test mode)");
  }
  absl::StatusOr<int> fd = -1;
  switch (request.part()) {
    case v1::FastPathRequest::INDEX:
      fd = catalog_->index().OpenForClient();
      grant->set_size(catalog_->index().size());
      break;
    case v1::FastPathRequest::RECORDS:
      fd = catalog_->control().OpenForClient();
      grant->set_size(catalog_->control().size());
      break;
    case v1::FastPathRequest::LEASE_PAGE:
      fd = catalog_->OpenLeasePage(session.id, session.uid);
      grant->set_size(kLeasePageBytes);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("fast_path.part = ", static_cast<int>(request.part()),
                       ": expected INDEX (1), RECORDS (2) or LEASE_PAGE (3)"));
  }
  if (!fd.ok()) return fd.status();
  grant->set_part(request.part());
  grant->set_instance_id(catalog_->instance_id());
  return *fd;
}

absl::StatusOr<int> TensorShmService::GrantSegment(const tensorshm::Session& session,
                                                   const v1::SegmentRequest& request,
                                                   v1::SegmentGrant* grant) {
  const HostPool& pool = catalog_->host_pool();
  const uint64_t id = request.segment_id();
  if (!pool.HasSegment(id)) {
    return absl::NotFoundError(absl::StrCat("segment.segment_id = ", id, ": no such host segment (",
                                            pool.segment_count(), " segments)"));
  }
  if (pool.SegmentInstance(id) != request.segment_instance()) {
    return absl::FailedPreconditionError(
        absl::StrCat("segment.segment_instance = ", request.segment_instance(), ": segment ", id,
                     " is another object now (made by instance ", pool.SegmentInstance(id),
                     "); the daemon restarted since that location was issued"));
  }
  if (request.writable() && pool.SegmentOwner(id) != session.uid) {
    return absl::PermissionDeniedError(
        absl::StrCat("segment.writable: segment ", id, " holds the buffers of uid ",
                     pool.SegmentOwner(id), "; uid ", session.uid, " may only read it"));
  }
  absl::StatusOr<int> fd = pool.Segment(id).OpenForClient(request.writable());
  if (!fd.ok()) return fd.status();
  grant->set_segment_id(id);
  grant->set_segment_instance(pool.SegmentInstance(id));
  grant->set_size(pool.SegmentSize(id));
  grant->set_writable(request.writable());
  return *fd;
}

absl::StatusOr<v1::SessionResponse> TensorShmService::OpenSession(
    const grpc::CallbackServerContext& context, const PeerCredentials& peer,
    const v1::SessionOpen& open, uint64_t* session_id, std::string* token) {
  v1::SessionResponse opened;
  // The client's own words are kept for the session's life (Sessions, logs): bounded.
  if (absl::Status s = ValidateSessionOpen(open); !s.ok()) return s;
  {
    ServiceLock lock(this);
    if (shutting_down_) return absl::UnavailableError("tensorshmd is stopping");
    // Per-uid limits: the reattach list is bounded, and the session counts against its uid.
    if (absl::Status s = uid_limits_.CheckHeldList(open.held_tensor_ids_size()); !s.ok()) return s;
    absl::StatusOr<UidLimits::SessionCharge> charge = uid_limits_.OpenSession(peer.uid);
    if (!charge.ok()) return charge.status();
    tensorshm::Session& session = sessions_.Open(open.pid(), open.client_name(), context.peer());
    session.client_version = open.client_version();
    session.opened_at = absl::Now();
    session.uid_charge = *std::move(charge);
    session.uid = peer.uid;
    session.gid = peer.gid;
    if (peer.pid != 0) session.pid = peer.pid;  // the kernel's word over the client's
    session.peer_pid = peer.pid;
    *session_id = session.id;
    *token = session.token;
    Reattach(session, open, opened.mutable_opened());
    opened.mutable_opened()->set_instance_id(catalog_->instance_id());
    const HostPool& pool = catalog_->host_pool();
    for (uint64_t id = 1; id <= pool.segment_count(); ++id) {
      if (!pool.HasSegment(id)) continue;  // lost in a restart
      v1::SegmentRef* segment = opened.mutable_opened()->add_segments();
      segment->set_segment_instance(pool.SegmentInstance(id));
      segment->set_segment_id(id);
    }
  }
  TSM_LOG(kInfo) << "session " << *session_id << " opened: pid " << open.pid() << ", uid "
                 << peer.uid << ", client \"" << LogEscape(open.client_name()) << "\", "
                 << context.peer();
  opened.mutable_opened()->set_session_id(*token);
  opened.mutable_opened()->set_session_number(*session_id);
  opened.mutable_opened()->set_server_version(TENSORSHM_VERSION);
  return opened;
}

std::optional<v1::SessionResponse> TensorShmService::SessionRelease(const std::string& token,
                                                                    const v1::ReleaseBatch& batch) {
  v1::SessionResponse response;
  ServiceLock lock(this);
  tensorshm::Session* session = sessions_.Find(token);
  if (session == nullptr) return std::nullopt;
  HandleReleases(*session, batch, response.mutable_ack());
  return response;
}

void TensorShmService::Reattach(tensorshm::Session& session, const v1::SessionOpen& open,
                                v1::SessionOpened* opened) {
  if (open.held_tensor_ids_size() == 0 && open.unpublished_tensor_ids_size() == 0) return;
  int leases = 0;
  for (uint64_t tensor_id : open.held_tensor_ids()) {
    uint64_t lease = 0;
    // A lease past the uid's --uid-leases is not taken back (its client reports the loss).
    const bool room = session.uid_charge.AddLeases().ok();
    if (room && catalog_->ReattachLease(tensor_id).ok()) {
      lease = sessions_.NextLeaseId();
      session.leases.emplace(lease, tensor_id);
      ++leases;
    } else if (room) {
      session.uid_charge.DropLeases();
    }
    opened->add_lease_ids(lease);
  }
  int readopted = 0;
  for (uint64_t tensor_id : open.unpublished_tensor_ids()) {
    // Charged before it is taken back: a buffer past the uid's --uid-quota is not.
    const Tensor* tensor = catalog_->FindId(tensor_id);
    bool ok = tensor != nullptr && session.unpublished.count(tensor_id) == 0 &&
              session.AddUnpublished(tensor_id, tensor->buffer.length).ok();
    if (ok && !catalog_->Readopt(session.id, session.uid, tensor_id).ok()) {
      session.ForgetUnpublished(tensor_id);
      ok = false;
    }
    if (ok) ++readopted;
    opened->add_readopted(ok);
  }
  TSM_LOG(kInfo) << "session " << session.id << " reconnected: " << leases << " of "
                 << open.held_tensor_ids_size() << " leases and " << readopted << " of "
                 << open.unpublished_tensor_ids_size() << " unpublished tensors taken back";
}

void TensorShmService::HandleReleases(tensorshm::Session& session, const v1::ReleaseBatch& batch,
                                      v1::ReleaseAck* ack) {
  ack->set_sequence(batch.sequence());
  if (batch.lease_ids_size() > kMaxReleaseIds ||
      batch.abandoned_tensor_ids_size() > kMaxReleaseIds) {
    v1::Rejection* rejection = ack->add_rejected();
    rejection->set_code(grpc::StatusCode::INVALID_ARGUMENT);
    rejection->set_message(absl::StrCat(
        "lease_ids: ", batch.lease_ids_size(), " ids, abandoned_tensor_ids: ",
        batch.abandoned_tensor_ids_size(), " ids; at most ", kMaxReleaseIds,
        " of each per batch: nothing in this batch was released; send it in smaller ones"));
    return;
  }
  for (int i = 0; i < batch.lease_ids_size(); ++i) {
    const uint64_t lease = batch.lease_ids(i);
    auto it = session.leases.find(lease);
    if (it == session.leases.end()) {
      v1::Rejection* rejection = ack->add_rejected();
      rejection->set_id(lease);
      rejection->set_code(grpc::StatusCode::FAILED_PRECONDITION);
      rejection->set_message(
          absl::StrCat("lease_ids[", i, "] = ", lease, ": not held by this session"));
      continue;
    }
    catalog_->DropLease(it->second);
    session.leases.erase(it);
    session.uid_charge.DropLeases();
  }
  for (int i = 0; i < batch.abandoned_tensor_ids_size(); ++i) {
    const uint64_t tensor_id = batch.abandoned_tensor_ids(i);
    absl::Status status = session.unpublished.count(tensor_id) == 0
                              ? absl::FailedPreconditionError(
                                    absl::StrCat("abandoned_tensor_ids[", i, "] = ", tensor_id,
                                                 ": not an unpublished tensor of this session"))
                              : catalog_->Abandon(session.id, tensor_id);
    if (status.ok()) {
      session.ForgetUnpublished(tensor_id);
      continue;
    }
    v1::Rejection* rejection = ack->add_rejected();
    rejection->set_id(tensor_id);
    rejection->set_code(static_cast<int32_t>(status.code()));
    rejection->set_message(std::string(status.message()));
  }
  for (uint64_t request_id : batch.settled_request_ids()) SettleRequest(session, request_id);
  // What the session's lease page let go of is freed by the time the batch is acknowledged
  // (Client::Flush relies on it).
  catalog_->Reclaim();
}

void TensorShmService::GiveBack(tensorshm::Session& session,
                                const tensorshm::Session::RequestGrant& grant) {
  if (auto lease = session.leases.find(grant.lease_id); lease != session.leases.end()) {
    catalog_->DropLease(lease->second);
    session.leases.erase(lease);
    session.uid_charge.DropLeases();
  }
  for (uint64_t tensor_id : grant.tensor_ids) {
    if (session.unpublished.count(tensor_id) == 0) continue;  // published, or dropped already
    if (catalog_->Abandon(session.id, tensor_id).ok()) session.ForgetUnpublished(tensor_id);
  }
}

void TensorShmService::Grant(tensorshm::Session& session, const Tensor& tensor,
                             v1::AcquireResponse* response) {
  response->set_lease_id(AddLease(session, tensor));
  response->set_tensor_id(tensor.id);
  Describe(tensor, response->mutable_desc(), response->mutable_location());
}

uint64_t TensorShmService::AddLease(tensorshm::Session& session, const Tensor& tensor) {
  const uint64_t lease = sessions_.NextLeaseId();
  session.leases.emplace(lease, tensor.id);
  catalog_->AddLease(tensor.id);
  return lease;
}

void TensorShmService::CloseSession(uint64_t session_id, const std::string& token) {
  size_t leases = 0;
  size_t unpublished = 0;
  bool kept = false;
  {
    ServiceLock lock(this);
    tensorshm::Session* session = sessions_.Find(token);
    if (session == nullptr) return;
    FailSessionWaiters(session_id, token);
    FailSessionCreates(session_id, token);
    leases = session->leases.size();
    unpublished = session->unpublished.size();
    kept = keep_held_on_stop_;
    if (kept) {
      // The segments stay for the next daemon: nothing the session held is freed, as if the
      // daemon had crashed (its records stay unbound or unpublished, its lease page untouched).
      // Its client re-registers the leases and takes back the unpublished buffers in the next
      // daemon's grace period; that daemon frees what nobody took back.
      leases += static_cast<size_t>(catalog_->PageLeasesOf(session_id));
      session->leases.clear();
      session->unpublished.clear();
    } else {
      uint64_t unpublished_bytes = 0;
      for (const auto& [tensor_id, bytes] : session->unpublished) unpublished_bytes += bytes;
      for (const auto& [lease, tensor_id] : session->leases) catalog_->DropLease(tensor_id);
      session->leases.clear();
      for (const auto& [tensor_id, bytes] : session->unpublished) {
        absl::Status s = catalog_->Abandon(session_id, tensor_id);
        TSM_CHECK(s.ok());
      }
      session->unpublished.clear();
      // Its lease page goes whole: what only it held is freed now.
      const int64_t page_leases = catalog_->DropLeasePage(session_id);
      metrics_.CountReclaimed(unpublished_bytes, unpublished, leases + page_leases);
      catalog_->Reclaim();
    }
    sessions_.Close(session_id);
  }
  if (kept) {
    TSM_LOG(kInfo) << "session " << session_id << " ended by the stop: kept its " << leases
                   << " leases and " << unpublished
                   << " unpublished tensors for the next daemon (--keep-segments)";
    return;
  }
  TSM_LOG(kInfo) << "session " << session_id << " closed: released " << leases << " leases, freed "
                 << unpublished << " unpublished tensors";
}

absl::StatusOr<int> TensorShmService::CudaOrdinalOf(const DLDevice& device,
                                                    const std::string& uuid) const {
  if (device.device_type != kDLCUDA || uuid.size() != 16) {
    return absl::InvalidArgumentError(absl::StrCat("device_uuid: ", uuid.size(),
                                                   " bytes for device ", DeviceName(device),
                                                   "; only CUDA devices take one, of 16 bytes"));
  }
  DeviceUuid wanted;
  std::memcpy(wanted.data(), uuid.data(), wanted.size());
  std::string pools;
  for (const CudaPool* pool : catalog_->cuda_pools()) {
    if (pool->uuid() == wanted) return pool->ordinal();
    absl::StrAppend(&pools, pools.empty() ? "" : ", ", FormatUuid(pool->uuid()));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "device_uuid = ", FormatUuid(wanted), ": this tensorshmd has no pool for the device (",
      pools.empty() ? "no CUDA pools" : "CUDA pools on " + pools, "; see --cuda-pool)"));
}

grpc::ServerUnaryReactor* TensorShmService::Create(grpc::CallbackServerContext* context,
                                                   const v1::CreateRequest* request,
                                                   v1::CreateResponse* response) {
  if (request->wait_ms() != 0) return CreateWaiting(context, request, response);
  return Unary(context, {.op = MetricOp::kCreate, .request_id = request->request_id()},
               [&](UnaryCall& call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
                 if (call.session->TakeSettled(request->request_id())) {
                   return absl::CancelledError(
                       "create: settled (cancelled) by the client before it arrived");
                 }
                 SegmentGrowth growth;
                 absl::Status created = CreateFor(*call.session, *request, response, &growth);
                 if (!growth.needed() && !growth.busy()) {
                   if (!created.ok()) return created;
                   return KeepCreated(call.session->token, absl::OkStatus(), request->request_id(),
                                      *response);
                 }
                 // A pool must grow first: not on this thread, one of gRPC's few.
                 if (shutting_down_) return absl::UnavailableError("tensorshmd is stopping");
                 pending_creates_.push_back(
                     PendingCreate{call.reactor, call.session->token, request, response});
                 creates_pending_.Signal();
                 call.answered_later = true;
                 return absl::OkStatus();
               });
}

void TensorShmService::GrowPools() {
  while (true) {
    ServiceLock lock(this);
    // Between growths, the segments of uids that have gone are given back (looked for once a
    // second: a uid's last session may have ended).
    while (pending_creates_.empty() && grow_ahead_.empty() && !shutting_down_ &&
           !catalog_->host_pool().HasIdleSegments()) {
      creates_pending_.WaitWithTimeout(&mu_, absl::Seconds(1));
    }
    if (shutting_down_) {
      for (const PendingCreate& create : pending_creates_) {
        metrics_.CountOp(MetricOp::kCreate, absl::StatusCode::kUnavailable);
        finishing_.push_back({create.reactor, grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                                           "tensorshmd is stopping")});
      }
      pending_creates_.clear();
      return;
    }
    if (pending_creates_.empty() && grow_ahead_.empty()) {
      GiveBackIdleSegments();
      continue;
    }
    if (pending_creates_.empty()) {
      // Nothing waits for a segment now: grow ahead of need.
      const uint32_t uid = *grow_ahead_.begin();
      grow_ahead_.erase(grow_ahead_.begin());
      GrowAheadNow(uid);
      continue;
    }
    const PendingCreate create = pending_creates_.front();
    pending_creates_.pop_front();
    bool pool_full = false;
    absl::Status status = CreateGrowing(create.token, NoSession(create.token), *create.request,
                                        create.response, &pool_full);
    if (create.waiter != nullptr) {
      FinishGrownCreate(create.waiter, status, pool_full);  // counted when it is answered
    } else {
      const uint64_t request_id = create.request->request_id();
      if (status.ok()) {
        status = KeepCreated(create.token, NoSession(create.token), request_id, *create.response);
      }
      metrics_.CountOp(MetricOp::kCreate, status);
      finishing_.push_back({create.reactor, ToGrpcStatus(status), status.ok() && request_id != 0});
    }
  }  // `lock` goes: the create is answered
}

absl::Status TensorShmService::CreateGrowing(const std::string& token, const absl::Status& gone,
                                             const v1::CreateRequest& request,
                                             v1::CreateResponse* response, bool* pool_full) {
  while (true) {
    tensorshm::Session* session = sessions_.Find(token);
    if (session == nullptr) return gone;
    SegmentGrowth growth;
    absl::Status status =
        CreateFor(*session, request, response, &growth, /*waited=*/false, pool_full);
    if (growth.busy()) {
      // Another call is making a segment of that pool: it may be the one this create needs.
      grown_.Wait(&mu_);
      continue;
    }
    if (!growth.needed()) return status;
    const absl::Status grown = GrowUnlocked(growth);
    if (absl::IsResourceExhausted(grown)) metrics_.CountAllocationFailure(AllocationFailure::kPool);
    if (!grown.ok()) return grown;
  }
}

absl::Status TensorShmService::GrowUnlocked(SegmentGrowth& growth) {
  // Making a segment reserves all its memory (posix_fallocate, cuMemAlloc): every other call
  // goes on meanwhile.
  catalog_->BeginGrowth(growth);
  UnlockAndFinish();
  if (growth_delay_ > absl::ZeroDuration()) {
    TSM_LOG(kWarning) << "TENSORSHMD_TEST_GROWTH_DELAY_MS: a pool growth sleeps "
                      << absl::FormatDuration(growth_delay_) << " before it makes its segment";
    absl::SleepFor(growth_delay_);
  }
  growth.Make();
  mu_.lock();
  const absl::Status grown = catalog_->EndGrowth(growth);
  grown_.SignalAll();
  return grown;
}

void TensorShmService::GiveBackIdleSegments() {
  std::vector<ShmSegment> idle = catalog_->mutable_host_pool().GiveBackIdle();
  // Emptying them takes a while (their pages punched out): every other call goes on meanwhile.
  UnlockAndFinish();
  HostPool::DisposeSegments(std::move(idle));
  mu_.lock();
}

void TensorShmService::GrowAhead(uint32_t uid) {
  if (shutting_down_ || !catalog_->host_pool().PlanAhead(uid).has_value()) return;
  if (grow_ahead_.insert(uid).second) creates_pending_.Signal();
}

void TensorShmService::GrowAheadNow(uint32_t uid) {
  std::optional<GrowthRequest> plan = catalog_->host_pool().PlanAhead(uid);
  if (!plan.has_value()) return;  // grown meanwhile, or room was freed or taken
  SegmentGrowth growth;
  growth.cuda_ordinal = -1;
  growth.request = *plan;
  const absl::Status grown = GrowUnlocked(growth);
  if (grown.ok()) {
    retry_creates_ = true;  // a waiting create of that uid may fit now
    return;
  }
  // Creates still grow the pool on demand; an operator hears of this once (e.g. /dev/shm full).
  if (!warned_growth_ahead_) {
    warned_growth_ahead_ = true;
    TSM_LOG(kWarning) << "host pool: growing segment " << plan->segment_id << " (" << plan->size
                      << " bytes) ahead of need for uid " << uid << " failed: " << grown
                      << "; creates will grow the pool as they need it "
                      << "(logged once)";
  }
}

absl::Status TensorShmService::CreateFor(tensorshm::Session& session,
                                         const v1::CreateRequest& request,
                                         v1::CreateResponse* response, SegmentGrowth* growth,
                                         bool waited, bool* pool_full) {
  absl::StatusOr<DLDataType> dtype = FromWire(request.dtype());
  if (!dtype.ok()) return dtype.status();
  DLDevice device = request.has_device() ? FromWire(request.device()) : DLDevice{kDLCPU, 0};
  const std::vector<int64_t> shape(request.shape().begin(), request.shape().end());
  const std::vector<int64_t> strides(request.strides().begin(), request.strides().end());
  if (!request.device_uuid().empty()) {
    absl::StatusOr<int> ordinal = CudaOrdinalOf(device, request.device_uuid());
    if (!ordinal.ok()) return ordinal.status();
    device.device_id = *ordinal;
  }
  // Quotas before any memory is taken: a refused create costs no allocation, no pool growth and
  // no eviction.
  if (absl::Status s =
          CheckCreateQuotas(session, *dtype, shape, strides, device, request.subbyte_padded());
      !s.ok()) {
    return s;
  }
  // Then --uid-tensors: a uid at its share of records evicts its own (--evict lru) or is
  // refused as by a quota (it does not wait for memory, nor evict another uid's tensors).
  if (absl::Status s = catalog_->RoomForRecord(session.uid, evict_ == EvictPolicy::kLru); !s.ok()) {
    metrics_.CountAllocationFailure(AllocationFailure::kQuota);
    return s;
  }
  // Waiting creates come first: a new one for the same memory queues behind them.
  const PoolKey key{device.device_type, device.device_id,
                    device.device_type == kDLCPU ? session.uid : 0};
  if (!waited) {
    if (absl::Status s = CheckCreateQueue(key); !s.ok()) {
      if (pool_full != nullptr) *pool_full = true;
      return s;
    }
  }
  // From its first host create on, the session's uid shares the host pool with the others.
  if (device.device_type == kDLCPU) session.uid_charge.MarkCreating();
  absl::StatusOr<const Tensor*> tensor = catalog_->Create(
      session.id, *dtype, shape, strides, device, request.subbyte_padded(), session.uid, growth);
  if (absl::IsResourceExhausted(tensor.status()) && catalog_->retired_count() > 0 &&
      catalog_->Reclaim() > 0) {
    // Memory that lease pages let go of since the last housekeeping round is free now.
    tensor = catalog_->Create(session.id, *dtype, shape, strides, device, request.subbyte_padded(),
                              session.uid, growth);
  }
  if (absl::IsResourceExhausted(tensor.status()) && evict_ == EvictPolicy::kLru) {
    tensor = catalog_->CreateEvicting(session.id, *dtype, shape, strides, device,
                                      request.subbyte_padded(), session.uid, growth);
  }
  if (absl::IsResourceExhausted(tensor.status())) {
    if (pool_full != nullptr) *pool_full = true;
    // Once per create: the tries of a create waiting for memory are not counted again.
    if (!waited) metrics_.CountAllocationFailure(AllocationFailure::kPool);
  }
  if (!tensor.ok()) return tensor.status();
  const uint64_t length = (*tensor)->buffer.length;
  if (session_quota_bytes_ > 0 && session.unpublished_bytes + length > session_quota_bytes_) {
    const uint64_t tensor_id = (*tensor)->id;
    TSM_CHECK(catalog_->Abandon(session.id, tensor_id).ok());
    metrics_.CountAllocationFailure(AllocationFailure::kQuota);
    return absl::ResourceExhaustedError(
        absl::StrCat("session quota: ", length, " more bytes requested, ",
                     session.unpublished_bytes, " bytes of unpublished tensors held, quota ",
                     session_quota_bytes_, " bytes (--session-quota); publish or drop some first"));
  }
  if (absl::Status s = session.AddUnpublished((*tensor)->id, length); !s.ok()) {
    TSM_CHECK(catalog_->Abandon(session.id, (*tensor)->id).ok());
    if (absl::IsResourceExhausted(s)) metrics_.CountAllocationFailure(AllocationFailure::kQuota);
    return s;  // --uid-quota
  }
  response->set_tensor_id((*tensor)->id);
  Describe(**tensor, response->mutable_desc(), response->mutable_location());
  if (request.stock() > 0 && device.device_type == kDLCPU && length > 0) {
    Stock(session, length, request.stock(), response->mutable_stocked());
  }
  if (device.device_type == kDLCPU && length > 0) GrowAhead(session.uid);
  return absl::OkStatus();
}

void TensorShmService::Stock(tensorshm::Session& session, uint64_t length, uint32_t count,
                             google::protobuf::RepeatedPtrField<v1::StockedBuffer>* stocked) {
  // Stock is memory nobody uses yet: it never takes the last eighth of the pool, and a session
  // or uid with a quota gets none (its quota is for what it creates).
  const HostPool& pool = catalog_->host_pool();
  count = std::min(count, kMaxStock);
  // Nor while creates wait for memory: what is freed is theirs.
  if (!creates_waiting_.empty() || session_quota_bytes_ > 0 ||
      uid_limits_.config().unpublished_bytes > 0 || length == 0 || length > kMaxStockedBytes ||
      pool.used_bytes() + (count + 0ull) * length > pool.capacity_bytes() / 8 * 7) {
    return;
  }
  // Nor past an eighth of the uid's fair share: stock keeps a segment from being given back to
  // another uid, and a client takes its stock without a call, so it cannot be taken back.
  const uint64_t stock_bound = pool.FairShare(session.uid) / 8;
  if ((count + 0ull) * length > stock_bound) {
    count = static_cast<uint32_t>(stock_bound / length);
    if (count == 0) return;
  }
  const int64_t elements = static_cast<int64_t>(length);
  for (uint32_t i = 0; i < count; ++i) {
    SegmentGrowth not_for_stock;  // asked for, never begun: stock takes no new segment
    absl::StatusOr<const Tensor*> tensor =
        catalog_->Create(session.id, DLDataType{kDLUInt, 8, 1}, absl::MakeConstSpan(&elements, 1),
                         {}, DLDevice{kDLCPU, 0}, false, session.uid, &not_for_stock);
    if (!tensor.ok()) return;
    if (!session.AddUnpublished((*tensor)->id, (*tensor)->buffer.length).ok()) {
      TSM_CHECK(catalog_->Abandon(session.id, (*tensor)->id).ok());
      return;
    }
    catalog_->MarkStocked((*tensor)->id);
    v1::StockedBuffer* buffer = stocked->Add();
    buffer->set_tensor_id((*tensor)->id);
    v1::TensorDesc desc;
    Describe(**tensor, &desc, buffer->mutable_location());
  }
}

grpc::ServerUnaryReactor* TensorShmService::Publish(grpc::CallbackServerContext* context,
                                                    const v1::PublishRequest* request,
                                                    v1::PublishResponse* response) {
  return Unary(context, {.op = MetricOp::kPublish},
               [&](UnaryCall& call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                 return PublishFor(*call.session, *request, response);
               });
}

absl::Status TensorShmService::PublishFor(tensorshm::Session& session,
                                          const v1::PublishRequest& request,
                                          v1::PublishResponse* response) {
  if (absl::Status s = ValidateName(request.name()); !s.ok()) return s;
  if (const Tensor* bound = catalog_->Find(request.name()); bound != nullptr && request.replace()) {
    if (absl::Status s = MayChange(session, *bound, "replace"); !s.ok()) return s;
  }
  if (!request.ready_event().empty()) {
    const Tensor* tensor = catalog_->FindId(request.tensor_id());
    if (request.ready_event().size() != sizeof(CUipcEventHandle)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ready_event: ", request.ready_event().size(), " bytes; must be empty or a ",
                       sizeof(CUipcEventHandle), "-byte CUipcEventHandle"));
    }
    if (tensor != nullptr && tensor->device.device_type != kDLCUDA) {
      return absl::InvalidArgumentError(absl::StrCat("ready_event: set for tensor ", tensor->id,
                                                     " on ", DeviceName(tensor->device),
                                                     "; only CUDA tensors take one"));
    }
  }
  if (request.has_desc()) {
    const v1::TensorDesc& desc = request.desc();
    absl::StatusOr<DLDataType> dtype = FromWire(desc.dtype());
    if (!dtype.ok()) return dtype.status();
    const std::vector<int64_t> shape(desc.shape().begin(), desc.shape().end());
    const std::vector<int64_t> strides(desc.strides().begin(), desc.strides().end());
    if (absl::Status s =
            catalog_->Reshape(session.id, request.tensor_id(), *dtype, shape, strides,
                              (desc.flags() & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0);
        !s.ok()) {
      return s;
    }
  }
  // The lease of publish-and-acquire is charged first: over --uid-leases nothing is published.
  if (request.acquire()) {
    if (absl::Status s = session.uid_charge.AddLeases(); !s.ok()) return s;
  }
  absl::Status s = catalog_->Publish(session.id, request.tensor_id(), request.name(),
                                     request.replace(), request.ready_event(), session.pid);
  if (!s.ok()) {
    if (request.acquire()) session.uid_charge.DropLeases();
    return s;
  }
  session.ForgetUnpublished(request.tensor_id());
  if (request.acquire()) {
    const Tensor* tensor = catalog_->FindId(request.tensor_id());
    TSM_CHECK(tensor != nullptr);
    Grant(session, *tensor, response->mutable_acquired());
  }
  WakeWaiters(request.name());
  if (request.stock() > 0) {
    Stock(session, request.stock_bytes(), request.stock(), response->mutable_stocked());
    GrowAhead(session.uid);
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* TensorShmService::Delete(grpc::CallbackServerContext* context,
                                                   const v1::DeleteRequest* request,
                                                   v1::DeleteResponse*) {
  return Unary(context, {.op = MetricOp::kDelete, .checked = ValidateName(request->name())},
               [&](UnaryCall& call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                 return DeleteFor(*call.session, *request);
               });
}

absl::Status TensorShmService::DeleteFor(const tensorshm::Session& session,
                                         const v1::DeleteRequest& request) {
  if (absl::Status s = ValidateName(request.name()); !s.ok()) return s;
  if (const Tensor* bound = catalog_->Find(request.name()); bound != nullptr) {
    if (absl::Status s = MayChange(session, *bound, "delete"); !s.ok()) return s;
  }
  return catalog_->Delete(request.name());
}

grpc::ServerUnaryReactor* TensorShmService::List(grpc::CallbackServerContext* context,
                                                 const v1::ListRequest* request,
                                                 v1::ListResponse* response) {
  const UnaryFrame frame{.op = MetricOp::kList,
                         .needs_session = false,
                         .checked = ValidateNamePrefix(request->prefix())};
  return Unary(context, frame, [&](UnaryCall& call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    catalog_->ReadLeasePages();  // once: each entry's page leases are then a look-up
    for (const Tensor* tensor : catalog_->List(request->prefix())) {
      v1::TensorInfo* info = response->add_tensors();
      info->set_name(tensor->name);
      info->set_tensor_id(tensor->id);
      info->set_leases(catalog_->LeaseCount(*tensor));
      info->set_published_unix_ms(tensor->published_unix_ms);
      info->set_publisher_uid(tensor->owner_uid);
      if (SeesDetailsOf(call.peer, tensor->owner_uid)) {
        info->set_publisher_pid(tensor->publisher_pid);
      }
      Describe(*tensor, info->mutable_desc(), nullptr);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* TensorShmService::Stat(grpc::CallbackServerContext* context,
                                                 const v1::StatRequest*,
                                                 v1::StatResponse* response) {
  return Unary(context, {.op = MetricOp::kStat, .needs_session = false},
               [&](UnaryCall&) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                 StatLocked(response);
                 return absl::OkStatus();
               });
}

v1::StatResponse TensorShmService::StatSnapshot() {
  v1::StatResponse stat;
  ServiceLock lock(this);
  StatLocked(&stat);
  return stat;
}

void TensorShmService::StatLocked(v1::StatResponse* response) {
  FoldFastAcquires();
  catalog_->ReadLeasePages();
  response->set_tensors(catalog_->tensor_count());
  response->set_names(catalog_->name_count());
  response->set_leases(sessions_.lease_count() + catalog_->PageLeaseCount());
  response->set_sessions(sessions_.size());
  response->set_evicted_tensors(catalog_->evicted_tensors());
  response->set_evicted_bytes(catalog_->evicted_bytes());
  response->set_creates_waiting(static_cast<int64_t>(creates_waiting_.size()));
  response->set_stocked_tensors(catalog_->stocked_tensors());
  const HostPool& pool = catalog_->host_pool();
  v1::PoolStats* stats = response->add_pools();
  ToWire(DLDevice{kDLCPU, 0}, stats->mutable_device());
  stats->set_capacity_bytes(static_cast<int64_t>(pool.capacity_bytes()));
  // Stock is allocated from the pool like any buffer: the pool's own figure holds both.
  stats->set_used_bytes(static_cast<int64_t>(pool.used_bytes() - catalog_->stock_bytes()));
  stats->set_stock_bytes(static_cast<int64_t>(catalog_->stock_bytes()));
  stats->set_segments(static_cast<int64_t>(pool.live_segment_count()));
  for (const CudaPool* cuda : catalog_->cuda_pools()) {
    v1::PoolStats* device = response->add_pools();
    ToWire(DLDevice{kDLCUDA, cuda->ordinal()}, device->mutable_device());
    device->set_capacity_bytes(static_cast<int64_t>(cuda->capacity_bytes()));
    device->set_used_bytes(static_cast<int64_t>(cuda->used_bytes()));
    device->set_segments(static_cast<int64_t>(cuda->segment_count()));
  }
  // Eviction (--evict lru) adds its figures here; metrics.cc exports them.
}

}  // namespace tensorshm
