// The emulated driver's virtual memory management (tests/support/fake_cuda/vmm.cc) holds to
// what CUDA does and what tensorshm's VMM pools will rely on: an allocation exported as a file
// descriptor maps the same bytes in another process, a read-only mapping refuses the driver's
// writes (the context stays usable) and kills a process that writes it directly, and misuse is
// refused as the real driver refuses it.
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "common/cuda/cuda_driver.h"
#include "gtest/gtest.h"
#include "tests/support/fake_cuda/fake_cuda.h"
#include "tests/support/test_daemon.h"

namespace tensorshm::testing {
namespace {

constexpr size_t kGranularity = size_t{2} << 20;

// The emulated driver's count of VMM allocations not yet freed (tsm_fake_cuda_vmm_allocations).
int64_t LiveAllocations() {
  void* driver = dlopen(FakeCudaPath().c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (driver == nullptr) return -1;
  auto count = reinterpret_cast<decltype(&tsm_fake_cuda_vmm_allocations)>(
      dlsym(driver, "tsm_fake_cuda_vmm_allocations"));
  const int64_t live = count != nullptr ? count() : -1;
  dlclose(driver);
  return live;
}

class FakeCudaVmmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("TENSORSHM_LIBCUDA", FakeCudaPath().c_str(), 1);
    absl::StatusOr<const CudaDriver*> driver = CudaDriver::Get();
    ASSERT_TRUE(driver.ok()) << driver.status();
    cu_ = *driver;
    ASSERT_EQ(cu_->cuDevicePrimaryCtxRetain(&context_, 0), CUDA_SUCCESS);
    ASSERT_EQ(cu_->cuCtxPushCurrent_v2(context_), CUDA_SUCCESS);
  }
  void TearDown() override {
    if (cu_ == nullptr) return;
    cu_->cuCtxPopCurrent_v2(nullptr);
    cu_->cuDevicePrimaryCtxRelease_v2(0);
  }

  static CUmemAllocationProp Prop(bool posix_fd) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes =
        posix_fd ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    return prop;
  }

  // Reserves, maps and gives `flags` access to `size` bytes of `handle`; returns the address.
  CUdeviceptr Map(CUmemGenericAllocationHandle handle, size_t size, CUmemAccess_flags flags) const {
    CUdeviceptr ptr = 0;
    EXPECT_EQ(cu_->cuMemAddressReserve(&ptr, size, 0, 0, 0), CUDA_SUCCESS);
    EXPECT_EQ(ptr % kGranularity, 0u);
    EXPECT_EQ(cu_->cuMemMap(ptr, size, 0, handle, 0), CUDA_SUCCESS);
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = 0;
    access.flags = flags;
    EXPECT_EQ(cu_->cuMemSetAccess(ptr, size, &access, 1), CUDA_SUCCESS);
    return ptr;
  }

  void Unmap(CUdeviceptr ptr, size_t size) const {
    EXPECT_EQ(cu_->cuMemUnmap(ptr, size), CUDA_SUCCESS);
    EXPECT_EQ(cu_->cuMemAddressFree(ptr, size), CUDA_SUCCESS);
  }

  const CudaDriver* cu_ = nullptr;
  CUcontext context_ = nullptr;
};

TEST_F(FakeCudaVmmTest, ReportsSupportAndTheGranularity) {
  int vmm = 0;
  int posix_fd = 0;
  ASSERT_EQ(
      cu_->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0),
      CUDA_SUCCESS);
  ASSERT_EQ(cu_->cuDeviceGetAttribute(
                &posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, 0),
            CUDA_SUCCESS);
  EXPECT_EQ(vmm, 1);
  EXPECT_EQ(posix_fd, 1);
  size_t granularity = 0;
  const CUmemAllocationProp prop = Prop(true);
  ASSERT_EQ(
      cu_->cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
      CUDA_SUCCESS);
  EXPECT_EQ(granularity, kGranularity);
  CUmemGenericAllocationHandle handle = 0;
  EXPECT_EQ(cu_->cuMemCreate(&handle, kGranularity + 4096, &prop, 0), CUDA_ERROR_INVALID_VALUE);
  CUmemAllocationProp elsewhere = prop;
  elsewhere.location.id = 7;
  EXPECT_EQ(cu_->cuMemCreate(&handle, kGranularity, &elsewhere, 0), CUDA_ERROR_INVALID_DEVICE);
}

TEST_F(FakeCudaVmmTest, AnExportedDescriptorMapsTheSameBytesReadOnlyInAnotherProcess) {
  const size_t size = 2 * kGranularity;
  const CUmemAllocationProp prop = Prop(true);
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_EQ(cu_->cuMemCreate(&handle, size, &prop, 0), CUDA_SUCCESS);
  const CUdeviceptr ptr = Map(handle, size, CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  std::vector<unsigned char> pattern(size);
  for (size_t i = 0; i < size; ++i) pattern[i] = static_cast<unsigned char>(i * 7 + 3);
  ASSERT_EQ(cu_->cuMemcpyHtoD_v2(ptr + 0, pattern.data(), size), CUDA_SUCCESS);
  int fd = -1;
  ASSERT_EQ(
      cu_->cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      CUDA_SUCCESS);
  ASSERT_GE(fd, 0);

  // Another process (forked: the descriptor arrives as SCM_RIGHTS would bring it) imports it,
  // maps it read-only, reads every byte, is refused a write through the driver, and dies of a
  // direct write. Its exit code says how far it got.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    CUmemGenericAllocationHandle imported = 0;
    if (cu_->cuMemImportFromShareableHandle(&imported, reinterpret_cast<void*>(intptr_t{fd}),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) !=
        CUDA_SUCCESS) {
      _exit(10);
    }
    close(fd);
    CUdeviceptr view = 0;
    if (cu_->cuMemAddressReserve(&view, size, 0, 0, 0) != CUDA_SUCCESS ||
        cu_->cuMemMap(view, size, 0, imported, 0) != CUDA_SUCCESS) {
      _exit(11);
    }
    CUmemAccessDesc read{};
    read.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    read.location.id = 0;
    read.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
    if (cu_->cuMemSetAccess(view, size, &read, 1) != CUDA_SUCCESS) _exit(12);
    std::vector<unsigned char> seen(size);
    if (cu_->cuMemcpyDtoH_v2(seen.data(), view, size) != CUDA_SUCCESS || seen != pattern) {
      _exit(13);
    }
    if (cu_->cuMemsetD8_v2(view, 0xff, 16) != CUDA_ERROR_INVALID_VALUE) _exit(14);
    if (cu_->cuMemcpyHtoD_v2(view, seen.data(), 16) != CUDA_ERROR_INVALID_VALUE) _exit(15);
    if (cu_->cuMemcpyDtoH_v2(seen.data(), view, 16) != CUDA_SUCCESS) _exit(16);  // still usable
    signal(SIGSEGV, SIG_DFL);  // no sanitizer's report: the plain fault, as a process gets it
    *reinterpret_cast<volatile unsigned char*>(view + 5) = 1;
    _exit(17);
  }
  close(fd);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the consumer exited " << WEXITSTATUS(status);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // A sanitizer that keeps its own handler reports the fault and aborts (abort_on_error=1).
  EXPECT_TRUE(WTERMSIG(status) == SIGSEGV || WTERMSIG(status) == SIGABRT) << WTERMSIG(status);
#else
  EXPECT_EQ(WTERMSIG(status), SIGSEGV);
#endif
  // The producer's bytes are as it wrote them.
  std::vector<unsigned char> after(size);
  ASSERT_EQ(cu_->cuMemcpyDtoH_v2(after.data(), ptr, size), CUDA_SUCCESS);
  EXPECT_EQ(after, pattern);
  Unmap(ptr, size);
  EXPECT_EQ(cu_->cuMemRelease(handle), CUDA_SUCCESS);
}

TEST_F(FakeCudaVmmTest, MisuseIsRefusedAsTheDriverRefusesIt) {
  const size_t size = 2 * kGranularity;
  CUmemGenericAllocationHandle local = 0;
  const CUmemAllocationProp no_fd = Prop(false);
  ASSERT_EQ(cu_->cuMemCreate(&local, size, &no_fd, 0), CUDA_SUCCESS);
  int fd = -1;
  // Not created for a descriptor: none to export.
  EXPECT_EQ(
      cu_->cuMemExportToShareableHandle(&fd, local, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
      CUDA_ERROR_INVALID_VALUE);
  CUdeviceptr ptr = 0;
  ASSERT_EQ(cu_->cuMemAddressReserve(&ptr, 2 * size, 0, 0, 0), CUDA_SUCCESS);
  EXPECT_EQ(cu_->cuMemMap(ptr, size, 4096, local, 0), CUDA_ERROR_INVALID_VALUE);   // offset
  EXPECT_EQ(cu_->cuMemMap(ptr, 2 * size, 0, local, 0), CUDA_ERROR_INVALID_VALUE);  // too long
  ASSERT_EQ(cu_->cuMemMap(ptr, size, 0, local, 0), CUDA_SUCCESS);
  EXPECT_EQ(cu_->cuMemMap(ptr, size, 0, local, 0), CUDA_ERROR_INVALID_VALUE);  // mapped already
  // Mapped but no access yet: the driver neither reads nor writes it.
  unsigned char byte = 0;
  EXPECT_EQ(cu_->cuMemcpyDtoH_v2(&byte, ptr, 1), CUDA_ERROR_INVALID_VALUE);
  // Access only to mapped bytes; a reservation goes only once unmapped.
  CUmemAccessDesc rw{};
  rw.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  rw.location.id = 0;
  rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  EXPECT_EQ(cu_->cuMemSetAccess(ptr, 2 * size, &rw, 1), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cu_->cuMemAddressFree(ptr, 2 * size), CUDA_ERROR_INVALID_VALUE);
  // Released while mapped: the memory stays until its mapping goes.
  ASSERT_EQ(cu_->cuMemSetAccess(ptr, size, &rw, 1), CUDA_SUCCESS);
  EXPECT_EQ(cu_->cuMemRelease(local), CUDA_SUCCESS);
  EXPECT_EQ(cu_->cuMemRelease(local), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(cu_->cuMemsetD8_v2(ptr, 0x5a, size), CUDA_SUCCESS);
  EXPECT_EQ(cu_->cuMemcpyDtoH_v2(&byte, ptr + size - 1, 1), CUDA_SUCCESS);
  EXPECT_EQ(byte, 0x5a);
  EXPECT_EQ(cu_->cuMemUnmap(ptr, 2 * size), CUDA_ERROR_INVALID_VALUE);  // not all mapped
  EXPECT_EQ(LiveAllocations(), 1);
  EXPECT_EQ(cu_->cuMemUnmap(ptr, size), CUDA_SUCCESS);
  EXPECT_EQ(LiveAllocations(), 0);                                        // its last mapping went
  EXPECT_EQ(cu_->cuMemAddressFree(ptr, size), CUDA_ERROR_INVALID_VALUE);  // part of one
  EXPECT_EQ(cu_->cuMemAddressFree(ptr, 2 * size), CUDA_SUCCESS);
  EXPECT_EQ(cu_->cuMemAddressFree(ptr, 2 * size), CUDA_ERROR_INVALID_VALUE);  // freed already
  // A descriptor that is no allocation is refused at import.
  CUmemGenericAllocationHandle imported = 0;
  EXPECT_EQ(cu_->cuMemImportFromShareableHandle(&imported, reinterpret_cast<void*>(intptr_t{0}),
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            CUDA_ERROR_INVALID_VALUE);
}

TEST_F(FakeCudaVmmTest, WithoutVmmTheDeviceSaysSoAndCreatesAreNotSupported) {
  // In a child: the setting is read per call.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    setenv("TSM_FAKE_CUDA_NO_VMM", "1", 1);
    int vmm = -1;
    if (cu_->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                  0) != CUDA_SUCCESS ||
        vmm != 0) {
      _exit(1);
    }
    CUmemGenericAllocationHandle handle = 0;
    const CUmemAllocationProp prop = Prop(true);
    _exit(cu_->cuMemCreate(&handle, kGranularity, &prop, 0) == CUDA_ERROR_NOT_SUPPORTED ? 0 : 2);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace tensorshm::testing
