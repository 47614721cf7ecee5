/* tensorshm C API: the C++ client behind opaque handles, for C and other languages.
 *
 * Every function returning int returns a status code: TSM_OK (0) or one of the canonical gRPC
 * codes below. After a failure, tsm_last_error() returns the message (which names the field and
 * value at fault) for the calling thread, valid until that thread's next tensorshm call. No C++
 * exception leaves these functions: an allocation that fails is TSM_RESOURCE_EXHAUSTED, anything
 * else thrown inside is TSM_INTERNAL, each with its message. */
#ifndef TENSORSHM_TENSORSHM_H_
#define TENSORSHM_TENSORSHM_H_

#include <dlpack/dlpack.h>
#include <stddef.h>
#include <stdint.h>

#include "tensorshm/export.h"

#ifdef __cplusplus
extern "C" {
#endif

enum {
  TSM_OK = 0,
  TSM_CANCELLED = 1,
  TSM_UNKNOWN = 2,
  TSM_INVALID_ARGUMENT = 3,
  TSM_DEADLINE_EXCEEDED = 4,
  TSM_NOT_FOUND = 5,
  TSM_ALREADY_EXISTS = 6,
  TSM_PERMISSION_DENIED = 7,
  TSM_RESOURCE_EXHAUSTED = 8,
  TSM_FAILED_PRECONDITION = 9,
  TSM_ABORTED = 10,
  TSM_OUT_OF_RANGE = 11,
  TSM_UNIMPLEMENTED = 12,
  TSM_INTERNAL = 13,
  TSM_UNAVAILABLE = 14,
  TSM_DATA_LOSS = 15,
  TSM_UNAUTHENTICATED = 16
};

/* Acquire timeouts: wait forever for the name to be published. */
#define TSM_WAIT_FOREVER (-1)

typedef struct tsm_client tsm_client;     /* a connection (session); thread-safe */
typedef struct tsm_writable tsm_writable; /* a tensor being filled; not thread-safe */

typedef struct {
  int64_t tensors; /* holding memory: published, unpublished (stocked_tensors included) */
  int64_t leases;
  int64_t sessions;
  int64_t host_capacity_bytes;
  int64_t host_used_bytes; /* what tensors hold, published or not; stock not included */
  /* Stocked buffers (made ahead of a producer's need, stock until published) and their bytes. */
  int64_t stocked_tensors;
  int64_t host_stock_bytes;
} tsm_stats;

/* The message of the calling thread's last failure ("" if none). */
TENSORSHM_EXPORT const char* tsm_last_error(void);

/* Connects. socket may be NULL or "" (the default: $TENSORSHM_SOCKET, else the user's own
 * daemon's socket when one is there, else the packaged daemon's /run/tensorshm/tensorshm.sock);
 * client_name may be NULL. On success *out is a client to free with tsm_client_free; on failure
 * *out is NULL. The daemon must run as this process's effective uid, root, or be the packaged
 * daemon of a /run/tensorshm only root could have made for it (TSM_PERMISSION_DENIED otherwise; see
 * tsm_connect_server_uid and $TENSORSHM_SERVER_UID).
 * TSM_UNAVAILABLE at once if there is no socket file at the path, or after 5 s if the daemon does
 * not accept the connection and open the session (a stopped daemon included).
 *
 * If the daemon restarts, the client reconnects by itself, and a call made meanwhile waits for
 * the new session and runs there within its deadline (its timeout when positive, else 60 s);
 * a publish in flight when the daemon died is not repeated: TSM_UNAVAILABLE, its message saying
 * its fate is unknown (see tensorshm::Client::Connect). */
TENSORSHM_EXPORT int tsm_connect(const char* socket, const char* client_name, tsm_client** out);
/* As tsm_connect, and also accepts a daemon served by server_uid. Every connection's server is
 * checked (SO_PEERCRED): by default it must be this process's effective uid or root, else
 * TSM_PERMISSION_DENIED naming the socket, the server's uid and pid. server_uid -1: no other uid
 * (as tsm_connect); otherwise a uid (0 to 4294967294). */
TENSORSHM_EXPORT int tsm_connect_server_uid(const char* socket, const char* client_name,
                                            int64_t server_uid, tsm_client** out);
/* Drops the client; tensors acquired through it stay valid until their deleters run. NULL is
 * ignored. */
TENSORSHM_EXPORT void tsm_client_free(tsm_client* client);

/* Allocates a writable tensor of ndim (0..32) dimensions: shape holds ndim values; strides may be
 * NULL (C-contiguous), else ndim values in elements. An ndim out of range is TSM_INVALID_ARGUMENT
 * before shape or strides are read.
 * On success *out is to be published with tsm_publish or dropped with tsm_writable_free. */
TENSORSHM_EXPORT int tsm_create(tsm_client* client, DLDataType dtype, int32_t ndim,
                                const int64_t* shape, const int64_t* strides, DLDevice device,
                                tsm_writable** out);
/* As tsm_create; when the pool cannot hold the buffer, waits for memory to be freed. timeout_ms:
 * 0 no wait (tsm_create), > 0 wait that long, TSM_WAIT_FOREVER; then TSM_RESOURCE_EXHAUSTED.
 * Waiting creates are served in order (see tensorshm::Client::Create). */
TENSORSHM_EXPORT int tsm_create_wait(tsm_client* client, DLDataType dtype, int32_t ndim,
                                     const int64_t* shape, const int64_t* strides, DLDevice device,
                                     int64_t timeout_ms, tsm_writable** out);
/* The tensor's metadata; data points at the writable mapping (NULL once published). */
TENSORSHM_EXPORT const DLTensor* tsm_writable_dltensor(const tsm_writable* tensor);
/* data + byte_offset; NULL once published. */
TENSORSHM_EXPORT void* tsm_writable_data(const tsm_writable* tensor);
/* Seals and binds to name. On failure the tensor is unchanged. */
TENSORSHM_EXPORT int tsm_publish(tsm_client* client, tsm_writable* tensor, const char* name,
                                 int replace);
/* Frees the handle; an unpublished tensor's buffer goes back to the pool. NULL is ignored. */
TENSORSHM_EXPORT void tsm_writable_free(tsm_writable* tensor);

/* Acquires name. timeout_ms: 0 no wait, > 0 wait that long, TSM_WAIT_FOREVER. On success *out is
 * a read-only tensor; the caller calls (*out)->deleter(*out) exactly once. */
TENSORSHM_EXPORT int tsm_acquire(tsm_client* client, const char* name, int64_t timeout_ms,
                                 DLManagedTensorVersioned** out);
TENSORSHM_EXPORT int tsm_delete(tsm_client* client, const char* name);
TENSORSHM_EXPORT int tsm_stat(tsm_client* client, tsm_stats* out);
/* Waits until releases queued so far are applied by the daemon, and the background populate of
 * mappings made so far is done. */
TENSORSHM_EXPORT int tsm_flush(tsm_client* client);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TENSORSHM_TENSORSHM_H_ */
