/* A stand-in libcuda.so.1 for a machine without a GPU, so that Mooncake's prebuilt wheel (linked against the
 * CUDA driver) loads for its TCP transport. Every driver call answers CUDA_ERROR_NO_DEVICE (100): Mooncake then
 * treats every buffer as host memory. Only for bench.remote's comparison; never on a machine with a driver.
 * Built by bench/mooncake/setup_venv.sh: gcc -shared -fPIC -o libcuda.so.1 cuda_stub.c */
#include <stddef.h>

typedef int CUresult;
#define NO_DEVICE 100

static const char *no_device = "CUDA_ERROR_NO_DEVICE (kvstore bench stub: no CUDA driver here)";

CUresult cuGetErrorName(CUresult error, const char **str) { (void)error; *str = "CUDA_ERROR_NO_DEVICE"; return 0; }
CUresult cuGetErrorString(CUresult error, const char **str) { (void)error; *str = no_device; return 0; }

#define NO(name) CUresult name() { return NO_DEVICE; }
NO(cuInit)
NO(cuDriverGetVersion)
NO(cuDeviceGet)
NO(cuDeviceGetCount)
NO(cuDeviceGetAttribute)
NO(cuDevicePrimaryCtxRetain)
NO(cuDevicePrimaryCtxRelease_v2)
NO(cuCtxGetDevice)
NO(cuCtxSetCurrent)
NO(cuMemAddressFree)
NO(cuMemAddressReserve)
NO(cuMemCreate)
NO(cuMemExportToShareableHandle)
NO(cuMemGetAddressRange_v2)
NO(cuMemGetAllocationGranularity)
NO(cuMemGetHandleForAddressRange)
NO(cuMemImportFromShareableHandle)
NO(cuMemMap)
NO(cuMemRelease)
NO(cuMemSetAccess)
NO(cuMemUnmap)
NO(cuPointerGetAttribute)
NO(cuPointerSetAttribute)
NO(cuGetProcAddress)
NO(cuGetProcAddress_v2)
