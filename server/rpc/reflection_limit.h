// Server reflection is gRPC's synchronous service: an open reflection stream holds one of the
// daemon's few synchronous threads for as long as it lasts, and with them all taken every other
// reflection call is refused ("Server Threadpool Exhausted"). The daemon's service and the health
// service use the callback API and hold no thread; reflection is what a uid could starve. This
// interceptor bounds the reflection streams of uids other than the daemon's own: one open at once
// per uid, and threads - 2 in all (gRPC keeps one thread polling: with 4, three streams take the
// pool), so that the daemon's own uid always finds one. A stream past either is cancelled as it
// starts (CANCELLED), before its handler waits on it. (A uid that is not admitted never gets this
// far: its connections are closed at accept.)
#ifndef TENSORSHM_SERVER_RPC_REFLECTION_LIMIT_H_
#define TENSORSHM_SERVER_RPC_REFLECTION_LIMIT_H_

#include <grpcpp/support/server_interceptor.h>
#include <sys/types.h>

#include <memory>

#include "server/core/access.h"

namespace tensorshm {

// An interceptor factory for ServerBuilder::experimental().SetInterceptorCreators: it makes an
// interceptor only for reflection calls (others run without any). `peers` (who is at the other
// end of each connection) and `policy` must outlive the server; `threads` is the synchronous
// thread count.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeReflectionLimit(
    const PeerTable* peers, const AccessPolicy* policy, int threads);

}  // namespace tensorshm

#endif  // TENSORSHM_SERVER_RPC_REFLECTION_LIMIT_H_
