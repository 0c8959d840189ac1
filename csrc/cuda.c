#include "cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The few CUDA runtime types this module needs (ABI of CUDA 11 and 12). */
typedef int kvr_cuda_err_t; /* cudaError_t */
#define KVR_CUDA_SUCCESS 0
#define KVR_CUDA_NOT_READY 600 /* cudaErrorNotReady */
#define KVR_CUDA_STREAM_NON_BLOCKING 0x01
#define KVR_CUDA_EVENT_DISABLE_TIMING 0x02
#define KVR_CUDA_HOST_ALLOC_PORTABLE 0x01

/* struct cudaPointerAttributes {type, device, devicePointer, hostPointer},
 * with spare room in case a later runtime appends fields. */
typedef struct {
    int type;
    int device;
    void *device_pointer;
    void *host_pointer;
    char spare[64];
} kvr_cuda_attrs_t;

static struct {
    pthread_mutex_t lock;
    int loaded;
    void *dl;
    char path[512];
    int runtime_version;
    kvr_cuda_err_t (*GetDeviceCount)(int *);
    kvr_cuda_err_t (*GetDevice)(int *);
    kvr_cuda_err_t (*SetDevice)(int);
    kvr_cuda_err_t (*PointerGetAttributes)(kvr_cuda_attrs_t *, const void *);
    kvr_cuda_err_t (*HostAlloc)(void **, size_t, unsigned);
    kvr_cuda_err_t (*FreeHost)(void *);
    kvr_cuda_err_t (*StreamCreateWithFlags)(void **, unsigned);
    kvr_cuda_err_t (*StreamDestroy)(void *);
    kvr_cuda_err_t (*StreamSynchronize)(void *);
    kvr_cuda_err_t (*EventCreateWithFlags)(void **, unsigned);
    kvr_cuda_err_t (*EventDestroy)(void *);
    kvr_cuda_err_t (*EventRecord)(void *, void *);
    kvr_cuda_err_t (*EventQuery)(void *);
    kvr_cuda_err_t (*MemcpyAsync)(void *, const void *, size_t, int, void *);
    kvr_cuda_err_t (*Memcpy)(void *, const void *, size_t, int);
    kvr_cuda_err_t (*GetLastError)(void);
    kvr_cuda_err_t (*RuntimeGetVersion)(int *);
    const char *(*GetErrorString)(kvr_cuda_err_t);
} kvr_cu = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int kvr_cuda_fail(char *err, size_t errlen, const char *what, kvr_cuda_err_t rc)
{
    if (err != NULL && errlen > 0) {
        const char *s = kvr_cu.GetErrorString ? kvr_cu.GetErrorString(rc) : NULL;
        snprintf(err, errlen, "%s failed: CUDA error %d (%s)", what, rc, s ? s : "?");
    }
    return -1;
}

static int kvr_cuda_resolve(void *dl, const char *name, void **fn, char *err, size_t errlen)
{
    *fn = dlsym(dl, name);
    if (*fn == NULL) {
        snprintf(err, errlen, "the CUDA runtime has no %s", name);
        return -1;
    }
    return 0;
}

int kvr_cuda_load(char *err, size_t errlen)
{
    pthread_mutex_lock(&kvr_cu.lock);
    if (kvr_cu.loaded) {
        pthread_mutex_unlock(&kvr_cu.lock);
        return 0;
    }
    const char *env = getenv("KVRECV_CUDART");
    /* The runtimes whose API this file declares (12 and 13 share it). */
    const char *candidates[4] = {NULL, NULL, NULL, NULL};
    if (env != NULL && env[0] != '\0') {
        candidates[0] = env; /* only this one: the operator chose it */
    } else {
        candidates[0] = "libcudart.so.12";
        candidates[1] = "libcudart.so.13";
        candidates[2] = "libcudart.so";
    }
    void *dl = NULL;
    const char *used = NULL;
    char tried[768] = "";
    for (int i = 0; i < 4 && candidates[i] != NULL && dl == NULL; i++) {
        dl = dlopen(candidates[i], RTLD_NOW | RTLD_LOCAL);
        if (dl != NULL) {
            used = candidates[i];
        } else {
            const char *why = dlerror();
            size_t n = strlen(tried);
            snprintf(tried + n, sizeof(tried) - n, "%s%s", n ? "; " : "",
                     why ? why : candidates[i]);
        }
    }
    if (dl == NULL) {
        snprintf(err, errlen, "cannot load the CUDA runtime (%s)%s", tried,
                 env ? "" : "; set KVRECV_CUDART to the path of libcudart.so");
        pthread_mutex_unlock(&kvr_cu.lock);
        return -1;
    }
    struct {
        const char *name;
        void **fn;
    } syms[] = {
        {"cudaGetDeviceCount", (void **)&kvr_cu.GetDeviceCount},
        {"cudaGetDevice", (void **)&kvr_cu.GetDevice},
        {"cudaSetDevice", (void **)&kvr_cu.SetDevice},
        {"cudaPointerGetAttributes", (void **)&kvr_cu.PointerGetAttributes},
        {"cudaHostAlloc", (void **)&kvr_cu.HostAlloc},
        {"cudaFreeHost", (void **)&kvr_cu.FreeHost},
        {"cudaStreamCreateWithFlags", (void **)&kvr_cu.StreamCreateWithFlags},
        {"cudaStreamDestroy", (void **)&kvr_cu.StreamDestroy},
        {"cudaStreamSynchronize", (void **)&kvr_cu.StreamSynchronize},
        {"cudaEventCreateWithFlags", (void **)&kvr_cu.EventCreateWithFlags},
        {"cudaEventDestroy", (void **)&kvr_cu.EventDestroy},
        {"cudaEventRecord", (void **)&kvr_cu.EventRecord},
        {"cudaEventQuery", (void **)&kvr_cu.EventQuery},
        {"cudaMemcpyAsync", (void **)&kvr_cu.MemcpyAsync},
        {"cudaMemcpy", (void **)&kvr_cu.Memcpy},
        {"cudaGetLastError", (void **)&kvr_cu.GetLastError},
        {"cudaRuntimeGetVersion", (void **)&kvr_cu.RuntimeGetVersion},
        {"cudaGetErrorString", (void **)&kvr_cu.GetErrorString},
    };
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        char why[256];
        if (kvr_cuda_resolve(dl, syms[i].name, syms[i].fn, why, sizeof(why)) != 0) {
            snprintf(err, errlen, "%s: %s", used, why);
            dlclose(dl); /* loaded stays 0: nothing calls the stale pointers */
            pthread_mutex_unlock(&kvr_cu.lock);
            return -1;
        }
    }
    /* A runtime without a usable device (no driver, no GPU) is not kept:
     * a later call may find another one (KVRECV_CUDART).  The library stays
     * mapped: unloading a CUDA runtime is not safe. */
    int ndev = 0;
    kvr_cuda_err_t drc = kvr_cu.GetDeviceCount(&ndev);
    if (drc != KVR_CUDA_SUCCESS || ndev <= 0) {
        const char *ds = drc != KVR_CUDA_SUCCESS ? kvr_cu.GetErrorString(drc) : "0 devices";
        snprintf(err, errlen, "%s loaded but no CUDA device is usable (%s)", used,
                 ds ? ds : "?");
        kvr_cu.GetLastError();
        pthread_mutex_unlock(&kvr_cu.lock);
        return -1;
    }
    kvr_cu.dl = dl;
    snprintf(kvr_cu.path, sizeof(kvr_cu.path), "%s", used);
    int v = 0;
    if (kvr_cu.RuntimeGetVersion(&v) == KVR_CUDA_SUCCESS) {
        kvr_cu.runtime_version = v;
    }
    kvr_cu.loaded = 1;
    pthread_mutex_unlock(&kvr_cu.lock);
    return 0;
}

int kvr_cuda_loaded(void)
{
    pthread_mutex_lock(&kvr_cu.lock);
    int l = kvr_cu.loaded;
    pthread_mutex_unlock(&kvr_cu.lock);
    return l;
}

const char *kvr_cuda_path(void)
{
    return kvr_cuda_loaded() ? kvr_cu.path : "";
}

int kvr_cuda_runtime_version(void)
{
    return kvr_cuda_loaded() ? kvr_cu.runtime_version : 0;
}

int kvr_cuda_device_count(char *err, size_t errlen)
{
    int n = 0;
    kvr_cuda_err_t rc = kvr_cu.GetDeviceCount(&n);
    if (rc != KVR_CUDA_SUCCESS) {
        kvr_cu.GetLastError();
        return kvr_cuda_fail(err, errlen, "cudaGetDeviceCount", rc);
    }
    return n;
}

int kvr_cuda_pointer_kind(const void *ptr, int *device, char *err, size_t errlen)
{
    kvr_cuda_attrs_t a;
    memset(&a, 0, sizeof(a));
    a.device = -1;
    kvr_cuda_err_t rc = kvr_cu.PointerGetAttributes(&a, ptr);
    if (rc != KVR_CUDA_SUCCESS) {
        /* Runtimes before 11 fail on memory they do not know; clear the
         * sticky error and call it host memory. */
        kvr_cu.GetLastError();
        if (rc == 1 /* cudaErrorInvalidValue */) {
            *device = -1;
            return KVR_CUDA_MEM_UNKNOWN;
        }
        return kvr_cuda_fail(err, errlen, "cudaPointerGetAttributes", rc);
    }
    *device = a.device;
    if (a.type < KVR_CUDA_MEM_UNKNOWN || a.type > KVR_CUDA_MEM_MANAGED) {
        return KVR_CUDA_MEM_UNKNOWN;
    }
    return a.type;
}

int kvr_cuda_get_device(int *dev)
{
    return kvr_cu.GetDevice(dev) == KVR_CUDA_SUCCESS ? 0 : -1;
}

int kvr_cuda_set_device(int dev, char *err, size_t errlen)
{
    kvr_cuda_err_t rc = kvr_cu.SetDevice(dev);
    return rc == KVR_CUDA_SUCCESS ? 0 : kvr_cuda_fail(err, errlen, "cudaSetDevice", rc);
}

void *kvr_cuda_host_alloc(size_t len, char *err, size_t errlen)
{
    void *p = NULL;
    kvr_cuda_err_t rc = kvr_cu.HostAlloc(&p, len, KVR_CUDA_HOST_ALLOC_PORTABLE);
    if (rc != KVR_CUDA_SUCCESS) {
        kvr_cuda_fail(err, errlen, "cudaHostAlloc", rc);
        return NULL;
    }
    return p;
}

void kvr_cuda_host_free(void *p)
{
    if (p != NULL) {
        kvr_cu.FreeHost(p);
    }
}

int kvr_cuda_stream_create(void **stream, char *err, size_t errlen)
{
    kvr_cuda_err_t rc = kvr_cu.StreamCreateWithFlags(stream, KVR_CUDA_STREAM_NON_BLOCKING);
    return rc == KVR_CUDA_SUCCESS ? 0 : kvr_cuda_fail(err, errlen, "cudaStreamCreate", rc);
}

void kvr_cuda_stream_destroy(void *stream)
{
    if (stream != NULL) {
        kvr_cu.StreamDestroy(stream);
    }
}

int kvr_cuda_stream_sync(void *stream, char *err, size_t errlen)
{
    kvr_cuda_err_t rc = kvr_cu.StreamSynchronize(stream);
    return rc == KVR_CUDA_SUCCESS ? 0 : kvr_cuda_fail(err, errlen, "cudaStreamSynchronize", rc);
}

int kvr_cuda_event_create(void **event, char *err, size_t errlen)
{
    kvr_cuda_err_t rc = kvr_cu.EventCreateWithFlags(event, KVR_CUDA_EVENT_DISABLE_TIMING);
    return rc == KVR_CUDA_SUCCESS ? 0 : kvr_cuda_fail(err, errlen, "cudaEventCreate", rc);
}

void kvr_cuda_event_destroy(void *event)
{
    if (event != NULL) {
        kvr_cu.EventDestroy(event);
    }
}

int kvr_cuda_event_record(void *event, void *stream, char *err, size_t errlen)
{
    kvr_cuda_err_t rc = kvr_cu.EventRecord(event, stream);
    return rc == KVR_CUDA_SUCCESS ? 0 : kvr_cuda_fail(err, errlen, "cudaEventRecord", rc);
}

int kvr_cuda_event_query(void *event, char *err, size_t errlen)
{
    kvr_cuda_err_t rc = kvr_cu.EventQuery(event);
    if (rc == KVR_CUDA_SUCCESS) {
        return 1;
    }
    if (rc == KVR_CUDA_NOT_READY) {
        return 0;
    }
    return kvr_cuda_fail(err, errlen, "cudaEventQuery", rc);
}

int kvr_cuda_memcpy_async(void *dst, const void *src, size_t len, int kind, void *stream,
                          char *err, size_t errlen)
{
    kvr_cuda_err_t rc = kvr_cu.MemcpyAsync(dst, src, len, kind, stream);
    return rc == KVR_CUDA_SUCCESS ? 0 : kvr_cuda_fail(err, errlen, "cudaMemcpyAsync", rc);
}

int kvr_cuda_memcpy(void *dst, const void *src, size_t len, int kind, char *err, size_t errlen)
{
    kvr_cuda_err_t rc = kvr_cu.Memcpy(dst, src, len, kind);
    return rc == KVR_CUDA_SUCCESS ? 0 : kvr_cuda_fail(err, errlen, "cudaMemcpy", rc);
}
