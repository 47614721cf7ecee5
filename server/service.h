// The gRPC service: sessions, create / publish / acquire / delete / list / stat.
#ifndef TENSORSHM_SERVER_SERVICE_H_
#define TENSORSHM_SERVER_SERVICE_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "server/access.h"
#include "server/catalog.h"
#include "server/memory_channel.h"
#include "server/session.h"
#include "server/uid_limits.h"
#include "tensorshm/v1/tensorshm.grpc.pb.h"

namespace tensorshm {

inline constexpr char kSessionMetadataKey[] = "tensorshm-session";

// Thread-safe: every RPC runs on a gRPC thread and takes mu_ for the catalog and sessions.
class TensorShmService final : public v1::TensorShm::Service {
 public:
  // `session_quota_bytes`: most bytes of unpublished buffers one session may hold; 0: no limit.
  // `policy` and `peers` (both outliving the service) decide who may call; null admits all.
  // `uid_limits`: what all sessions of one uid may hold together (--uid-*); {}: no limits.
  TensorShmService(std::unique_ptr<Catalog> catalog, uint64_t session_quota_bytes = 0,
                   const AccessPolicy* policy = nullptr, const PeerTable* peers = nullptr,
                   const UidLimitsConfig& uid_limits = {});

  // Wakes acquire waiters and makes new waits fail with UNAVAILABLE; call before stopping the
  // server so that no handler outlives it.
  void BeginShutdown();

  // After a restart's grace period: frees unbound tensors nobody came back for.
  int ExpireUnbound();

  // Runs the fast path's housekeeping until BeginShutdown: every kHeartbeatIntervalNs, stores
  // the heartbeat in the index and frees retired tensors whose lease page slots were cleared.
  void Housekeep() ABSL_LOCKS_EXCLUDED(mu_);
  // --keep-segments: leave the shm objects for the next daemon with this prefix.
  void KeepSegments();

  // Answers one memory channel request (see ChannelRequest in the .proto): binds `connection`
  // to a session opened by the same process, grants one host segment's descriptor or a fast
  // path part, or creates / publishes for the bound session. Refusals are in the response's
  // code and message.
  ChannelReply HandleChannel(ChannelConnection& connection, const v1::ChannelRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);

  grpc::Status Session(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::SessionResponse, v1::SessionRequest>* stream) override;
  grpc::Status Create(grpc::ServerContext* context, const v1::CreateRequest* request,
                      v1::CreateResponse* response) override;
  grpc::Status Publish(grpc::ServerContext* context, const v1::PublishRequest* request,
                       v1::PublishResponse* response) override;
  grpc::Status Acquire(grpc::ServerContext* context, const v1::AcquireRequest* request,
                       v1::AcquireResponse* response) override;
  grpc::Status Delete(grpc::ServerContext* context, const v1::DeleteRequest* request,
                      v1::DeleteResponse* response) override;
  grpc::Status List(grpc::ServerContext* context, const v1::ListRequest* request,
                    v1::ListResponse* response) override;
  grpc::Status Stat(grpc::ServerContext* context, const v1::StatRequest* request,
                    v1::StatResponse* response) override;

 private:
  // OK if `session` may delete or replace `tensor`: its publisher's uid, or the daemon's.
  absl::Status MayChange(const tensorshm::Session& session, const Tensor& tensor,
                         absl::string_view verb) const;
  // The caller's credentials if the policy admits it; PERMISSION_DENIED otherwise.
  absl::StatusOr<PeerCredentials> Admit(const grpc::ServerContext& context) const;
  // The session named by the call's metadata. INVALID_ARGUMENT if the metadata is missing,
  // FAILED_PRECONDITION if no open session has that token.
  absl::StatusOr<tensorshm::Session*> CallerSession(const grpc::ServerContext& context)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends `session`: drops its leases, frees its unpublished tensors, forgets it.
  void CloseSession(uint64_t session_id, const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);
  // A reconnecting client's SessionOpen: leases and unpublished tensors it held before the
  // daemon restarted, taken back where the catalog allows; the outcome goes into `opened`.
  void Reattach(tensorshm::Session& session, const v1::SessionOpen& open, v1::SessionOpened* opened)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleReleases(tensorshm::Session& session, const v1::ReleaseBatch& batch,
                      v1::ReleaseAck* ack) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a new lease of `session` on `tensor` (sealed) and returns its id.
  // REQUIRES: the lease is charged to session.uid_charge already.
  uint64_t AddLease(tensorshm::Session& session, const Tensor& tensor)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The daemon's ordinal of the CUDA device with `uuid`. INVALID_ARGUMENT unless `device` is
  // CUDA and `uuid` 16 bytes, FAILED_PRECONDITION if no pool is on that device.
  absl::StatusOr<int> CudaOrdinalOf(const DLDevice& device, const std::string& uuid) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Describe(const Tensor& tensor, v1::TensorDesc* desc, v1::Location* location) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Create and Publish for `session`, whichever transport asked.
  absl::Status CreateFor(tensorshm::Session& session, const v1::CreateRequest& request,
                         v1::CreateResponse* response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PublishFor(tensorshm::Session& session, const v1::PublishRequest& request,
                          v1::PublishResponse* response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes up to `count` unpublished uint8 buffers of `length` bytes for `session` ahead of its
  // need (CreateRequest.stock), fewer when the pool is short; none under a session quota.
  void Stock(tensorshm::Session& session, uint64_t length, uint32_t count,
             google::protobuf::RepeatedPtrField<v1::StockedBuffer>* stocked)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status DeleteFor(const tensorshm::Session& session, const v1::DeleteRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The descriptor of fast path part `request.part()` for `session`.
  absl::StatusOr<int> GrantFastPath(const tensorshm::Session& session,
                                    const v1::FastPathRequest& request, v1::FastPathGrant* grant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The descriptor of host segment `request.segment_id` for `session`, as the channel grants it.
  absl::StatusOr<int> GrantSegment(const tensorshm::Session& session,
                                   const v1::SegmentRequest& request, v1::SegmentGrant* grant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The catalog's index, for the heartbeat, which needs no lock (header atomics only).
  CatalogIndex& index_;
  Mutex mu_;
  CondVar published_;  // signalled on every publish and on shutdown
  CondVar stopping_;   // signalled on shutdown (wakes Housekeep)
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<Catalog> catalog_ ABSL_GUARDED_BY(mu_);
  const uint64_t session_quota_bytes_;
  const AccessPolicy* const policy_;
  const PeerTable* const peers_;
  // Thread-safe on its own; declared before sessions_, whose charges it must outlive.
  UidLimits uid_limits_;
  SessionTable sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_SERVICE_H_
