// What a client process does about fork(): a child never uses its parent's connections,
// threads, session or leases, and can connect afresh. See docs/decisions.md ("Fork", "gRPC in a
// fork child").
#ifndef TENSORSHM_CLIENT_FORK_H_
#define TENSORSHM_CLIENT_FORK_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

namespace tensorshm {

class ClientCore;

// Once per process, before its first client: installs the fork handlers and, when this client is
// the first to start gRPC, starts it with its fork support on and the "poll" polling strategy
// (unless the user chose otherwise). Thread-safe.
void PrepareProcessForClients();

// A number bumped in every child fork() makes. An object that recorded another value was made
// in an ancestor process. Lock-free: safe to read anywhere, in a child too.
uint64_t ForkGeneration();

// Records `path` (as the kernel reports the daemon's end of a connection, or as given) as a
// daemon socket: at a fork, the child's inherited connections to it are cut. Lock-free (a fork
// may happen at any moment); at most a few distinct paths are kept.
void RememberDaemonSocket(const std::string& path);

// In a forked child (or while the process exits): keeps a reference to the parent's `core` (and
// its `sender` thread object) for the rest of the process, so that nothing of the parent's is
// ever closed or destroyed from the child (nor torn down under exit()). The references stay
// reachable, so leak checkers do not report them.
void KeepForever(std::shared_ptr<ClientCore> core, std::thread* sender = nullptr);

// Process exit: a client's sender thread (detached while tensors outlived the Client) that ends
// while exit() runs would tear its gRPC channel down concurrently with gRPC's own static
// destructors. A sender brackets its teardown with these: BeginSenderTeardown is false once the
// process is exiting (the sender then keeps its core with KeepForever and touches nothing), and
// exit waits (up to a few seconds) for teardowns already under way. Thread-safe.
bool BeginSenderTeardown();
void EndSenderTeardown();

}  // namespace tensorshm

#endif  // TENSORSHM_CLIENT_FORK_H_
