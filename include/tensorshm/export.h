// TENSORSHM_EXPORT marks what libtensorshm exports: the C API (tensorshm.h) and the C++ API
// (client.h). The library is built with hidden visibility, so that nothing else in it (the wire
// protocol's protobuf code, the client's internals) is part of its ABI.
#ifndef TENSORSHM_EXPORT_H_
#define TENSORSHM_EXPORT_H_

#if defined(_WIN32)
#define TENSORSHM_EXPORT
#elif defined(__cplusplus)
// The standard attribute form, which may follow another one: class [[nodiscard]] TENSORSHM_EXPORT.
#define TENSORSHM_EXPORT [[gnu::visibility("default")]]
#else
#define TENSORSHM_EXPORT __attribute__((visibility("default")))
#endif

#endif  // TENSORSHM_EXPORT_H_
