// MOCK of a CUDA device for a CPU-only build of torch (which has no CUDA code at all), used by tools/cuda_codegen.py.
// Built with g++ against that torch's own headers and LD_PRELOADed, it registers two things the build lacks, so that
// the autograd engine can handle FakeTensors on "cuda":
// - c10's own FakeGuardImpl (made for torch's tests) as the "cuda" device guard: device and stream bookkeeping only;
// - CUDA hooks saying that one CUDA device exists, whose new random generators are CPU ones (a fake tensor's values
//   are never drawn, but benchmarks/in_model.py seeds a generator on the device).
// Nothing can be allocated or launched on that device.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

namespace fake_cuda {
struct CUDAHooks : at::CUDAHooksInterface {
  CUDAHooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  c10::DeviceIndex current_device() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  int getNumGPUs() const override { return 1; }
  void deviceSynchronize(c10::DeviceIndex) const override {}
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::make_generator<at::CPUGeneratorImpl>(); }
};
}  // namespace fake_cuda

namespace at {
using fake_cuda::CUDAHooks;
REGISTER_CUDA_HOOKS(CUDAHooks);  // under the name getCUDAHooks() asks the registry for
}  // namespace at
