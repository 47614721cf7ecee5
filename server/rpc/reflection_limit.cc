#include "server/rpc/reflection_limit.h"

#include <grpcpp/server_context.h>

#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "common/base/mutex.h"
#include "server/ops/log.h"

namespace tensorshm {
namespace {

// Reflection streams open now, of uids other than the owner. Thread-safe.
class ReflectionStreams {
 public:
  explicit ReflectionStreams(int most) : most_(most) {}
  // Whether `uid` may open one more (counted if so).
  bool TryOpen(uid_t uid) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    if (total_ >= most_ || open_[uid] >= kPerUid) return false;
    ++open_[uid];
    ++total_;
    return true;
  }
  void Close(uid_t uid) ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    if (--open_[uid] == 0) open_.erase(uid);
    --total_;
  }

 private:
  static constexpr int kPerUid = 1;
  const int most_;
  Mutex mu_;
  std::map<uid_t, int> open_ ABSL_GUARDED_BY(mu_);
  int total_ ABSL_GUARDED_BY(mu_) = 0;
};

class ReflectionInterceptor : public grpc::experimental::Interceptor {
 public:
  ReflectionInterceptor(grpc::experimental::ServerRpcInfo* info, const PeerTable* peers,
                        const AccessPolicy* policy, ReflectionStreams* streams)
      : info_(info), peers_(peers), policy_(policy), streams_(streams) {}
  ~ReflectionInterceptor() override {
    if (counted_) streams_->Close(uid_);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      grpc::ServerContextBase* context = info_->server_context();
      absl::StatusOr<PeerCredentials> peer = peers_->Find(context->peer());
      // A peer the listener did not hand over is refused by admission anyway: it holds no slot.
      if (!peer.ok() || !policy_->Admit(*peer).ok()) {
        context->TryCancel();
      } else if (peer->uid != policy_->owner()) {
        if (streams_->TryOpen(peer->uid)) {
          counted_ = true;
          uid_ = peer->uid;
        } else {
          TSM_LOG(kDebug) << "reflection stream of uid " << peer->uid << " (pid " << peer->pid
                          << ") cancelled: one per uid, and a thread kept for uid "
                          << policy_->owner();
          context->TryCancel();
        }
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* info_;
  const PeerTable* peers_;
  const AccessPolicy* policy_;
  ReflectionStreams* streams_;
  bool counted_ = false;
  uid_t uid_ = 0;
};

class ReflectionLimit : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  ReflectionLimit(const PeerTable* peers, const AccessPolicy* policy, int threads)
      : peers_(peers), policy_(policy), streams_(threads > 2 ? threads - 2 : 1) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    if (!absl::StartsWith(info->method(), "/grpc.reflection.")) return nullptr;
    return new ReflectionInterceptor(info, peers_, policy_, &streams_);
  }

 private:
  const PeerTable* peers_;
  const AccessPolicy* policy_;
  ReflectionStreams streams_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeReflectionLimit(
    const PeerTable* peers, const AccessPolicy* policy, int threads) {
  return std::make_unique<ReflectionLimit>(peers, policy, threads);
}

}  // namespace tensorshm
