/* MOCK of the CUDA runtime (libcudart) for a CUDA build of torch on a machine without a GPU or driver, used by
 * tools/cuda_codegen.py: LD_PRELOADed, these definitions take the place of libcudart's (an object without symbol
 * versions satisfies torch's versioned references). They answer what torch asks while it handles FakeTensors on
 * "cuda": device count, current device, streams, events, capture state. No memory is ever allocated on it. A call
 * not defined here still reaches the real libcudart, which fails for want of a driver: add it here. */
#include <stdlib.h>
#include <string.h>

typedef int cudaError;  /* 0: cudaSuccess */

cudaError cudaGetDeviceCount(int *count) { *count = 1; return 0; }
cudaError cudaGetDevice(int *device) { *device = 0; return 0; }
cudaError cudaSetDevice(int device) { return 0; }
cudaError cudaInitDevice(int device, unsigned device_flags, unsigned flags) { return 0; }
cudaError cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return 0;
}
cudaError cudaGetLastError(void) { return 0; }
cudaError cudaPeekAtLastError(void) { return 0; }
cudaError cudaDriverGetVersion(int *version) { *version = 13000; return 0; }
cudaError cudaRuntimeGetVersion(int *version) { *version = 13000; return 0; }
cudaError cudaDeviceSynchronize(void) { return 0; }

/* Streams and CUDA graph capture: the one default stream, never capturing. */
cudaError cudaStreamIsCapturing(void *stream, int *status) { *status = 0; return 0; }
cudaError cudaStreamGetCaptureInfo(void *stream, int *status, unsigned long long *id, void *graph,
                                   void *dependencies, void *edges, size_t *count) {
  if (status) *status = 0;
  if (id) *id = 0;
  if (count) *count = 0;
  return 0;
}
cudaError cudaThreadExchangeStreamCaptureMode(int *mode) { return 0; }
cudaError cudaStreamWaitEvent(void *stream, void *event, unsigned flags) { return 0; }
cudaError cudaStreamSynchronize(void *stream) { return 0; }
cudaError cudaStreamQuery(void *stream) { return 0; }

/* Events: distinct handles, always complete. */
static char events[4096];
static int next_event;
cudaError cudaEventCreateWithFlags(void **event, unsigned flags) { *event = events + (next_event++ % 4096); return 0; }
cudaError cudaEventCreate(void **event) { return cudaEventCreateWithFlags(event, 0); }
cudaError cudaEventRecord(void *event, void *stream) { return 0; }
cudaError cudaEventRecordWithFlags(void *event, void *stream, unsigned flags) { return 0; }
cudaError cudaEventQuery(void *event) { return 0; }
cudaError cudaEventSynchronize(void *event) { return 0; }
cudaError cudaEventDestroy(void *event) { return 0; }

