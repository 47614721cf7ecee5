// TSM_CHECK: a broken internal invariant is a bug; report it and abort rather than limp on.
#ifndef TENSORSHM_COMMON_CHECK_H_
#define TENSORSHM_COMMON_CHECK_H_

#include <cstdio>
#include <cstdlib>

#define TSM_CHECK(condition)                                                             \
  do {                                                                                   \
    if (!(condition)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #condition); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (false)

#endif  // TENSORSHM_COMMON_CHECK_H_
