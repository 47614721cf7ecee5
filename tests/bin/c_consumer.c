/* c_consumer: acquires a tensor through the C API and prints its storage checksum, proving the C
 * header compiles as C and the C API works across processes.
 *   c_consumer SOCKET NAME  ->  "meta <ndim> <flags>" and "checksum <fnv1a of storage bytes>" */
#include <inttypes.h>
#include <stdio.h>

#include "tensorshm/tensorshm.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: c_consumer SOCKET NAME\n");
    return 2;
  }
  tsm_client* client = NULL;
  int rc = tsm_connect(argv[1], "c_consumer", &client);
  if (rc != TSM_OK) {
    printf("error %d %s\n", rc, tsm_last_error());
    return 3;
  }
  DLManagedTensorVersioned* t = NULL;
  rc = tsm_acquire(client, argv[2], 0, &t);
  if (rc != TSM_OK) {
    printf("error %d %s\n", rc, tsm_last_error());
    tsm_client_free(client);
    return 3;
  }
  /* The storage spans [low, high] elements around element 0 (byte_offset bytes into data). */
  const DLTensor* d = &t->dl_tensor;
  int64_t low = 0, high = 0, empty = 0;
  for (int i = 0; i < d->ndim; ++i) {
    if (d->shape[i] == 0) empty = 1;
    int64_t reach = (d->shape[i] - 1) * d->strides[i];
    if (reach < 0)
      low += reach;
    else
      high += reach;
  }
  const int64_t bits = (int64_t)d->dtype.bits * d->dtype.lanes;
  int64_t nbytes = empty ? 0 : (high - low + 1) * bits / 8;
  if (bits % 8 != 0) {
    int64_t numel = 1;
    for (int i = 0; i < d->ndim; ++i) numel *= d->shape[i];
    nbytes = (numel * bits + 7) / 8;
  }
  uint64_t hash = 0xcbf29ce484222325ull;
  const unsigned char* bytes = (const unsigned char*)d->data;
  for (int64_t i = 0; i < nbytes; ++i) {
    hash ^= bytes[i];
    hash *= 0x100000001b3ull;
  }
  printf("meta %d %" PRIu64 "\n", d->ndim, (uint64_t)t->flags);
  printf("checksum %" PRIu64 "\n", hash);
  t->deleter(t);
  rc = tsm_flush(client);
  tsm_stats stats;
  if (rc == TSM_OK) rc = tsm_stat(client, &stats);
  tsm_client_free(client);
  if (rc != TSM_OK) {
    printf("error %d %s\n", rc, tsm_last_error());
    return 3;
  }
  return 0;
}
