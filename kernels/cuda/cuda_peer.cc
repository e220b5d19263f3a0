// CUDA IPC for the GPU transports (kernels/peer_exchange.h): CudaBackend::OpenPeerMemory and
// OpenPeerEvent, and the PeerMemory and PeerEvent they return.
//
// IpcMemory: another process's device allocation, opened in the backend's device with
// cudaIpcOpenMemHandle (lazy peer access, so an allocation on another GPU of the node works where
// peer access is possible) and closed, after the backend's stream has drained, when destroyed. Its
// size is checked with the driver's cuMemGetAddressRange, obtained through the runtime
// (cudaGetDriverEntryPointByVersion) so that libmuond_cuda.so does not link libcuda.so.1 and still
// loads, to report that there is no driver, on a machine without one.
// IpcEvent: another process's interprocess event (cudaIpcOpenEventHandle); Await polls it from the
// host until the client's recorded work is done (the backend's shared stream never waits on it).
//
// Ownership: the caller owns each object, which must not outlive its backend.
// Thread-safety: both only touch the backend through CudaBackend::OnStream (its mutex) and
// Synchronize, so either may be used from several threads.
#include <cuda.h>  // CUresult and CUdeviceptr, for the driver function's signature; nothing is linked
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/peer_exchange.h"

namespace muond::kernels::cuda {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes);
static_assert(sizeof(cudaIpcEventHandle_t) == kIpcHandleBytes);

using GetAddressRangeFn = PFN_cuMemGetAddressRange_v3020;

// The driver's cuMemGetAddressRange (its CUDA 12 ABI), looked up once.
absl::StatusOr<GetAddressRangeFn> AddressRangeFunction() {
  static const absl::StatusOr<GetAddressRangeFn>* const function = [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t error =
        cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &entry, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t error = cudaGetDriverEntryPoint("cuMemGetAddressRange", &entry, cudaEnableDefault, &found);
#endif
    if (error != cudaSuccess) {
      cudaGetLastError();
      return new absl::StatusOr<GetAddressRangeFn>(CudaStatus(error, "cudaGetDriverEntryPoint(cuMemGetAddressRange)"));
    }
    if (found != cudaDriverEntryPointSuccess || entry == nullptr) {
      return new absl::StatusOr<GetAddressRangeFn>(absl::InternalError(
          absl::StrCat("the CUDA driver has no cuMemGetAddressRange (lookup result ", static_cast<int>(found), ")")));
    }
    return new absl::StatusOr<GetAddressRangeFn>(reinterpret_cast<GetAddressRangeFn>(entry));
  }();
  return *function;
}

// Bytes of the allocation that holds `ptr`, from `ptr` to its end.
absl::StatusOr<uint64_t> BytesFrom(const void* ptr) {
  MUOND_ASSIGN_OR_RETURN(GetAddressRangeFn get_range, AddressRangeFunction());
  CUdeviceptr base = 0;
  size_t size = 0;
  const auto address = reinterpret_cast<CUdeviceptr>(ptr);
  if (const CUresult result = get_range(&base, &size, address); result != CUDA_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cuMemGetAddressRange on the opened peer memory failed: CUresult ", static_cast<int>(result)));
  }
  if (address < base || address - base > size) {
    return absl::InternalError("cuMemGetAddressRange: the opened pointer lies outside its allocation");
  }
  return static_cast<uint64_t>(base + size - address);
}

class IpcMemory final : public PeerMemory {
 public:
  IpcMemory(CudaBackend* backend, void* data) : backend_(backend), data_(data) {}
  ~IpcMemory() override {
    // Work the backend enqueued on the memory completes before the mapping goes away; the wait
    // takes no lock of the backend (Synchronize waits for an event outside it), and no one enqueues
    // work on this memory any more. Errors cannot be reported from here.
    backend_->Synchronize().IgnoreError();
    cudaSetDevice(backend_->device());
    cudaIpcCloseMemHandle(data_);
    cudaGetLastError();
  }
  IpcMemory(const IpcMemory&) = delete;
  IpcMemory& operator=(const IpcMemory&) = delete;

  void* data() override { return data_; }
  uint64_t size() const override { return size_; }
  void set_size(uint64_t size) { size_ = size; }

 private:
  CudaBackend* const backend_;
  void* const data_;
  uint64_t size_ = 0;
};

class IpcEvent final : public PeerEvent {
 public:
  IpcEvent(CudaBackend* backend, cudaEvent_t event) : backend_(backend), event_(event) {}
  ~IpcEvent() override {
    backend_
        ->OnStream([this](cudaStream_t) {
          cudaEventDestroy(event_);
          return absl::OkStatus();
        })
        .IgnoreError();
  }
  IpcEvent(const IpcEvent&) = delete;
  IpcEvent& operator=(const IpcEvent&) = delete;

  absl::StatusOr<bool> Poll() override {
    cudaError_t state = cudaSuccess;
    MUOND_RETURN_IF_ERROR(backend_->OnStream([&](cudaStream_t) {
      state = cudaEventQuery(event_);
      // Not ready is recorded as the thread's last error too, which the next launch on this
      // thread would report as its own: cleared with every other answer but success.
      if (state != cudaSuccess) cudaGetLastError();
      return absl::OkStatus();
    }));
    if (state == cudaSuccess) return true;
    if (state == cudaErrorNotReady) return false;
    return CudaStatus(state, "event_handle: querying the client's event");
  }

 private:
  CudaBackend* const backend_;
  const cudaEvent_t event_;
};

absl::Status CheckHandleSize(absl::string_view name, std::string_view handle) {
  if (handle.size() == kIpcHandleBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": ", handle.size(), " bytes; a CUDA IPC handle has ", kIpcHandleBytes));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PeerMemory>> CudaBackend::OpenPeerMemory(std::string_view handle, uint64_t byte_size) {
  MUOND_RETURN_IF_ERROR(CheckHandleSize("mem_handle", handle));
  cudaIpcMemHandle_t ipc_handle;
  std::memcpy(&ipc_handle, handle.data(), sizeof(ipc_handle));
  void* data = nullptr;
  MUOND_RETURN_IF_ERROR(OnStream([&](cudaStream_t) {
    if (const cudaError_t error = cudaIpcOpenMemHandle(&data, ipc_handle, cudaIpcMemLazyEnablePeerAccess);
        error != cudaSuccess) {
      cudaGetLastError();  // not sticky; keep it from resurfacing in a later call
      return absl::InvalidArgumentError(absl::StrCat("mem_handle: cannot open the peer's memory on CUDA device ",
                                                     device_, " (", cudaGetErrorString(error), ")"));
    }
    return absl::OkStatus();
  }));
  // From here on the destructor closes the handle, also when the size is refused.
  auto memory = std::make_unique<IpcMemory>(this, data);
  absl::StatusOr<uint64_t> range = BytesFrom(data);
  if (!range.ok()) {
    return absl::Status(range.status().code(),
                        absl::StrCat("mem_handle: cannot size the opened allocation: ", range.status().message()));
  }
  const uint64_t available = *range;
  if (available < byte_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("byte_size: ", byte_size, " bytes, but the peer's allocation holds ", available));
  }
  memory->set_size(byte_size);  // what the client registered: the steps' offsets are checked against it
  return std::unique_ptr<PeerMemory>(std::move(memory));
}

absl::StatusOr<std::unique_ptr<PeerEvent>> CudaBackend::OpenPeerEvent(std::string_view handle) {
  MUOND_RETURN_IF_ERROR(CheckHandleSize("event_handle", handle));
  cudaIpcEventHandle_t ipc_handle;
  std::memcpy(&ipc_handle, handle.data(), sizeof(ipc_handle));
  cudaEvent_t event = nullptr;
  MUOND_RETURN_IF_ERROR(OnStream([&](cudaStream_t) {
    if (const cudaError_t error = cudaIpcOpenEventHandle(&event, ipc_handle); error != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat("event_handle: cannot open the peer's event on CUDA device ",
                                                     device_, " (", cudaGetErrorString(error), ")"));
    }
    return absl::OkStatus();
  }));
  return std::unique_ptr<PeerEvent>(std::make_unique<IpcEvent>(this, event));
}

}  // namespace muond::kernels::cuda
