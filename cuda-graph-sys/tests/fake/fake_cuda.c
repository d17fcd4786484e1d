/* A fake libcuda for CPU tests of the loader and of what the safe crate does on old drivers.
 *
 * tests/fake/mod.rs compiles it with the system `cc` into a shared library, one build per
 * configuration, and the tests open it with `Driver::load(path)` or through
 * CUDA_GRAPH_LIBCUDA. Every behaviour is fixed at compile time by these macros (-D):
 *
 *   FAKE_NO_GET_PROC_ADDRESS  export no cuGetProcAddress_v2, only the 11.3 cuGetProcAddress
 *                             (a driver before CUDA 12.0).
 *   FAKE_DRIVER_VERSION       what cuDriverGetVersion says (default 13000). A request for a
 *                             newer ABI returns CUDA_ERROR_INVALID_VALUE and writes neither
 *                             the pointer nor the status: what driver 580 (13.0) does for
 *                             13010, so what a 12.8 driver does for 13000.
 *   FAKE_MISSING              entries the driver does not have: status SYMBOL_NOT_FOUND.
 *   FAKE_TOO_NEW              entries whose ABI the driver reports as not there: status
 *                             VERSION_NOT_SUFFICIENT.
 *   FAKE_RESOLVE_ERROR        a buggy driver: a pointer and status SUCCESS, but
 *                             CUDA_ERROR_UNKNOWN.
 *   FAKE_NULL                 a buggy driver: CUDA_SUCCESS and status SUCCESS, but NULL.
 *   FAKE_FAIL_CALLS           entries that resolve but return FAKE_FAIL_CODE (default 719,
 *                             CUDA_ERROR_LAUNCH_FAILED) when called.
 *
 * The lists are string literals of comma-separated items: `name` (every ABI of it), `name@N`
 * (ABI N and newer), `*` or `*@N` (every entry). Every other `cu*` name resolves: the few
 * functions below are implemented, the rest are one stub that returns
 * CUDA_ERROR_NOT_SUPPORTED.
 *
 * Each implementation counts its calls. The count is read through the driver itself: the
 * symbol `fakeCallCount` resolves (at any ABI) to `int fakeCallCount(const char *counter)`,
 * where counter is the entry's name, `name@ABI` for entries implemented at several ABIs
 * (`cuCtxSynchronize@2000`, `cuCtxSynchronize@13000`), `stub`, or `plain` (calls of the
 * plain exported names, which the loader must never use). */

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifndef FAKE_DRIVER_VERSION
#define FAKE_DRIVER_VERSION 13000
#endif
#ifndef FAKE_MISSING
#define FAKE_MISSING ""
#endif
#ifndef FAKE_TOO_NEW
#define FAKE_TOO_NEW ""
#endif
#ifndef FAKE_RESOLVE_ERROR
#define FAKE_RESOLVE_ERROR ""
#endif
#ifndef FAKE_NULL
#define FAKE_NULL ""
#endif
#ifndef FAKE_FAIL_CALLS
#define FAKE_FAIL_CALLS ""
#endif
#ifndef FAKE_FAIL_CODE
#define FAKE_FAIL_CODE 719
#endif

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUevent;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

enum {
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
};

/* ---- configuration lists ---- */

/* Whether `list` has an item for `name` requested at `version`. */
static int listed(const char *list, const char *name, int version) {
    size_t n = strlen(name);
    const char *p = list;
    while (*p) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *at = memchr(p, '@', len);
        size_t name_len = at ? (size_t)(at - p) : len;
        int from = 0;
        if (at) {
            for (const char *d = at + 1; d < p + len; d++) from = from * 10 + (*d - '0');
        }
        int name_ok = (name_len == 1 && p[0] == '*') || (name_len == n && memcmp(p, name, n) == 0);
        if (name_ok && version >= from) return 1;
        if (!end) break;
        p = end + 1;
    }
    return 0;
}

/* ---- call counters ---- */

enum counter {
    C_cuInit,
    C_cuDriverGetVersion,
    C_cuDeviceGet,
    C_cuDeviceGetCount,
    C_cuDevicePrimaryCtxRetain,
    C_cuDevicePrimaryCtxRelease,
    C_cuCtxSetCurrent,
    C_cuCtxGetCurrent,
    C_cuCtxSynchronize_2000,
    C_cuCtxSynchronize_13000,
    C_cuCtxGetDevice_2000,
    C_cuCtxGetDevice_13000,
    C_cuEventCreate,
    C_cuEventDestroy,
    C_cuEventElapsedTime_2000,
    C_cuEventElapsedTime_12080,
    C_cuGetErrorName,
    C_cuGetErrorString,
    C_cuDeviceGetName,
    C_cuDeviceGetAttribute,
    C_cuDeviceTotalMem,
    C_stub,
    C_plain,
    C_COUNT
};

static const char *const counter_names[C_COUNT] = {
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxSynchronize@2000",
    "cuCtxSynchronize@13000",
    "cuCtxGetDevice@2000",
    "cuCtxGetDevice@13000",
    "cuEventCreate",
    "cuEventDestroy",
    "cuEventElapsedTime@2000",
    "cuEventElapsedTime@12080",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem",
    "stub",
    "plain",
};

static atomic_int counts[C_COUNT];

/* -1 for an unknown counter name. */
static int fakeCallCount(const char *counter) {
    for (int i = 0; i < C_COUNT; i++) {
        if (counter && strcmp(counter, counter_names[i]) == 0) return atomic_load(&counts[i]);
    }
    return -1;
}

/* Counts the call, then fails it when FAKE_FAIL_CALLS names the entry. */
#define ENTER(counter, name)                                                               \
    do {                                                                                   \
        atomic_fetch_add(&counts[counter], 1);                                             \
        if (listed(FAKE_FAIL_CALLS, name, FAKE_DRIVER_VERSION)) return FAKE_FAIL_CODE;     \
    } while (0)

/* ---- the emulated driver: one device, its primary context, per-thread current context ---- */

static int primary_ctx_object;
#define PRIMARY_CTX ((CUcontext)&primary_ctx_object)
static _Thread_local CUcontext current_ctx;
static atomic_int event_objects;

static CUresult f_cuInit(unsigned flags) {
    ENTER(C_cuInit, "cuInit");
    return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static CUresult f_cuDriverGetVersion(int *version) {
    ENTER(C_cuDriverGetVersion, "cuDriverGetVersion");
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = FAKE_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

static CUresult f_cuDeviceGet(CUdevice *dev, int ordinal) {
    ENTER(C_cuDeviceGet, "cuDeviceGet");
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *dev = 0;
    return CUDA_SUCCESS;
}

static CUresult f_cuDeviceGetCount(int *count) {
    ENTER(C_cuDeviceGetCount, "cuDeviceGetCount");
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = 1;
    return CUDA_SUCCESS;
}

static CUresult f_cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
    ENTER(C_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = PRIMARY_CTX;
    return CUDA_SUCCESS;
}

static CUresult f_cuDevicePrimaryCtxRelease(CUdevice dev) {
    ENTER(C_cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease");
    return dev == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

static CUresult f_cuCtxSetCurrent(CUcontext ctx) {
    ENTER(C_cuCtxSetCurrent, "cuCtxSetCurrent");
    if (ctx && ctx != PRIMARY_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    current_ctx = ctx;
    return CUDA_SUCCESS;
}

static CUresult f_cuCtxGetCurrent(CUcontext *ctx) {
    ENTER(C_cuCtxGetCurrent, "cuCtxGetCurrent");
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = current_ctx;
    return CUDA_SUCCESS;
}

/* The ABI before 13.0 waits for the calling thread's current context: without one it fails,
   as the real driver does, so a caller that forgot to bind sees an error. */
static CUresult f_cuCtxSynchronize_v2000(void) {
    ENTER(C_cuCtxSynchronize_2000, "cuCtxSynchronize");
    return current_ctx == PRIMARY_CTX ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static CUresult f_cuCtxSynchronize_v13000(CUcontext ctx) {
    ENTER(C_cuCtxSynchronize_13000, "cuCtxSynchronize");
    if (!ctx) ctx = current_ctx;
    return ctx == PRIMARY_CTX ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static CUresult f_cuCtxGetDevice_v2000(CUdevice *dev) {
    ENTER(C_cuCtxGetDevice_2000, "cuCtxGetDevice");
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    if (current_ctx != PRIMARY_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    *dev = 0;
    return CUDA_SUCCESS;
}

static CUresult f_cuCtxGetDevice_v13000(CUdevice *dev, CUcontext ctx) {
    ENTER(C_cuCtxGetDevice_13000, "cuCtxGetDevice");
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    if (!ctx) ctx = current_ctx;
    if (ctx != PRIMARY_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    *dev = 0;
    return CUDA_SUCCESS;
}

static CUresult f_cuEventCreate(CUevent *event, unsigned flags) {
    ENTER(C_cuEventCreate, "cuEventCreate");
    (void)flags;
    if (!event) return CUDA_ERROR_INVALID_VALUE;
    if (current_ctx != PRIMARY_CTX) return CUDA_ERROR_INVALID_CONTEXT;
    /* Distinct, never dereferenced handles. */
    *event = (CUevent)(uintptr_t)(0x1000 + 16 * atomic_fetch_add(&event_objects, 1));
    return CUDA_SUCCESS;
}

static CUresult f_cuEventDestroy(CUevent event) {
    ENTER(C_cuEventDestroy, "cuEventDestroy");
    return event ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Both ABIs write 1.5 ms; the counters tell which one was called. */
static CUresult elapsed(float *ms, CUevent start, CUevent end) {
    if (!ms) return CUDA_ERROR_INVALID_VALUE;
    if (!start || !end) return CUDA_ERROR_INVALID_HANDLE;
    *ms = 1.5f;
    return CUDA_SUCCESS;
}

static CUresult f_cuEventElapsedTime_v2000(float *ms, CUevent start, CUevent end) {
    ENTER(C_cuEventElapsedTime_2000, "cuEventElapsedTime");
    return elapsed(ms, start, end);
}

static CUresult f_cuEventElapsedTime_v12080(float *ms, CUevent start, CUevent end) {
    ENTER(C_cuEventElapsedTime_12080, "cuEventElapsedTime");
    return elapsed(ms, start, end);
}

static const struct {
    int code;
    const char *name;
    const char *text;
} errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult describe(CUresult code, const char **out, int text) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++) {
        if (errors[i].code == code) {
            *out = text ? errors[i].text : errors[i].name;
            return CUDA_SUCCESS;
        }
    }
    *out = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult f_cuGetErrorName(CUresult code, const char **name) {
    ENTER(C_cuGetErrorName, "cuGetErrorName");
    return describe(code, name, 0);
}

static CUresult f_cuGetErrorString(CUresult code, const char **text) {
    ENTER(C_cuGetErrorString, "cuGetErrorString");
    return describe(code, text, 1);
}

/* ---- device queries, enough for `fp8-moe info`: an sm_90 device with 132 SMs and 1 GiB ---- */

static CUresult f_cuDeviceGetName(char *name, int len, CUdevice dev) {
    ENTER(C_cuDeviceGetName, "cuDeviceGetName");
    static const char fake_name[] = "Fake CUDA device";
    if (!name || len <= 0 || dev != 0) return CUDA_ERROR_INVALID_VALUE;
    size_t n = sizeof fake_name < (size_t)len ? sizeof fake_name : (size_t)len;
    memcpy(name, fake_name, n);
    name[n - 1] = 0;
    return CUDA_SUCCESS;
}

static CUresult f_cuDeviceGetAttribute(int *value, int attribute, CUdevice dev) {
    ENTER(C_cuDeviceGetAttribute, "cuDeviceGetAttribute");
    if (!value || dev != 0) return CUDA_ERROR_INVALID_VALUE;
    switch (attribute) {
    case 16: *value = 132; break; /* MULTIPROCESSOR_COUNT */
    case 75: *value = 9; break;   /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *value = 0; break;   /* COMPUTE_CAPABILITY_MINOR */
    default: *value = 0; break;
    }
    return CUDA_SUCCESS;
}

static CUresult f_cuDeviceTotalMem(size_t *bytes, CUdevice dev) {
    ENTER(C_cuDeviceTotalMem, "cuDeviceTotalMem");
    if (!bytes || dev != 0) return CUDA_ERROR_INVALID_VALUE;
    *bytes = (size_t)1 << 30;
    return CUDA_SUCCESS;
}

/* Every entry the fake does not implement. Called through another entry's pointer type it
   ignores the arguments, which the C calling conventions of x86-64 and AArch64 allow. */
static CUresult f_stub(void) {
    atomic_fetch_add(&counts[C_stub], 1);
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* ---- cuGetProcAddress_v2 ---- */

static const struct {
    const char *name;
    int since; /* the ABI version this implementation is; the newest <= the request wins */
    void *fn;
} impls[] = {
    {"cuInit", 2000, (void *)f_cuInit},
    {"cuDriverGetVersion", 2020, (void *)f_cuDriverGetVersion},
    {"cuDeviceGet", 2000, (void *)f_cuDeviceGet},
    {"cuDeviceGetCount", 2000, (void *)f_cuDeviceGetCount},
    {"cuDevicePrimaryCtxRetain", 7000, (void *)f_cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 11000, (void *)f_cuDevicePrimaryCtxRelease},
    {"cuCtxSetCurrent", 4000, (void *)f_cuCtxSetCurrent},
    {"cuCtxGetCurrent", 4000, (void *)f_cuCtxGetCurrent},
    {"cuCtxSynchronize", 2000, (void *)f_cuCtxSynchronize_v2000},
    {"cuCtxSynchronize", 13000, (void *)f_cuCtxSynchronize_v13000},
    {"cuCtxGetDevice", 2000, (void *)f_cuCtxGetDevice_v2000},
    {"cuCtxGetDevice", 13000, (void *)f_cuCtxGetDevice_v13000},
    {"cuEventCreate", 2000, (void *)f_cuEventCreate},
    {"cuEventDestroy", 4000, (void *)f_cuEventDestroy},
    {"cuEventElapsedTime", 2000, (void *)f_cuEventElapsedTime_v2000},
    {"cuEventElapsedTime", 12080, (void *)f_cuEventElapsedTime_v12080},
    {"cuGetErrorName", 6000, (void *)f_cuGetErrorName},
    {"cuGetErrorString", 6000, (void *)f_cuGetErrorString},
    {"cuDeviceGetName", 2000, (void *)f_cuDeviceGetName},
    {"cuDeviceGetAttribute", 2000, (void *)f_cuDeviceGetAttribute},
    {"cuDeviceTotalMem", 3020, (void *)f_cuDeviceTotalMem},
};

static CUresult get_proc_address(const char *symbol, void **pfn, int version, uint64_t flags,
                                 int *status) {
    (void)flags;
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    /* Seen on driver 580 for a version newer than itself: nothing written. */
    if (version > FAKE_DRIVER_VERSION) return CUDA_ERROR_INVALID_VALUE;
    int found_status = CU_GET_PROC_ADDRESS_SUCCESS;
    if (strcmp(symbol, "fakeCallCount") == 0) {
        *pfn = (void *)fakeCallCount;
    } else if (strncmp(symbol, "cu", 2) != 0 || listed(FAKE_MISSING, symbol, version)) {
        *pfn = NULL;
        found_status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    } else if (listed(FAKE_TOO_NEW, symbol, version)) {
        *pfn = NULL;
        found_status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
    } else if (listed(FAKE_NULL, symbol, version)) {
        *pfn = NULL;
    } else {
        /* The newest implementation at or below the requested ABI, else the stub. */
        void *fn = NULL;
        int best = -1, known = 0;
        for (size_t i = 0; i < sizeof impls / sizeof impls[0]; i++) {
            if (strcmp(impls[i].name, symbol) != 0) continue;
            known = 1;
            if (impls[i].since <= version && impls[i].since > best) {
                best = impls[i].since;
                fn = impls[i].fn;
            }
        }
        if (!known) fn = (void *)f_stub;
        *pfn = fn;
        if (!fn) found_status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
    }
    if (status) *status = found_status;
    if (listed(FAKE_RESOLVE_ERROR, symbol, version)) {
        if (!*pfn) *pfn = (void *)f_stub;
        return CUDA_ERROR_UNKNOWN;
    }
    return CUDA_SUCCESS;
}

#ifndef FAKE_NO_GET_PROC_ADDRESS
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                                    int *status) {
    return get_proc_address(symbol, pfn, version, flags, status);
}
#else
/* A driver before 12.0 has only the 11.3 form, without the status. */
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
    return get_proc_address(symbol, pfn, version, flags, NULL);
}
#endif

/* Traps: the oldest ABI under the plain names, as libcuda exports it. The loader must never
   take these with dlsym; the `plain` counter shows whether anything did. */
EXPORT CUresult cuInit(unsigned flags) {
    (void)flags;
    atomic_fetch_add(&counts[C_plain], 1);
    return CUDA_ERROR_NOT_SUPPORTED;
}

EXPORT CUresult cuCtxSynchronize(void) {
    atomic_fetch_add(&counts[C_plain], 1);
    return CUDA_ERROR_NOT_SUPPORTED;
}
