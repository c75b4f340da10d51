/* MOCK of libcuda.so.1, the NVIDIA driver's library (absent without a GPU), used by tools/cuda_codegen.py for a CUDA
 * build of torch: found first on LD_LIBRARY_PATH when torch dlopens it, which it does when the autograd engine first
 * sets "cuda" up and asks whether the device's primary context is active. Nothing is ever loaded or launched. */
typedef int CUresult;  /* 0: CUDA_SUCCESS */

static char context[64];
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDriverGetVersion(int *version) { *version = 13000; return 0; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return 0; }
CUresult cuDeviceGet(int *device, int ordinal) { *device = 0; return 0; }
CUresult cuDeviceGetAttribute(int *value, int attribute, int device) { *value = 0; return 0; }
CUresult cuDevicePrimaryCtxGetState(int device, unsigned *flags, int *active) { *flags = 0; *active = 1; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int device) { *ctx = context; return 0; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = context; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { return 0; }
CUresult cuGetErrorString(CUresult error, const char **text) { *text = "fake libcuda (tools/cuda_codegen.py)"; return 0; }
CUresult cuGetErrorName(CUresult error, const char **text) { *text = "CUDA_ERROR_FAKE"; return 0; }
