/*
 * cuda: the CUDA runtime, loaded at run time with dlopen.
 *
 * kvrecv has no build-time or link-time dependency on CUDA.  The runtime is
 * looked up the first time it is needed, from $KVRECV_CUDART if set, else
 * libcudart.so.12, else libcudart.so.  A failed load is not cached (a later
 * call tries again); a successful one is kept for the life of the process.
 *
 * Only this module knows CUDA's types and prototypes (a minimal subset,
 * declared here without CUDA headers).  Streams and events are opaque
 * pointers.  Every function is thread safe once kvr_cuda_load succeeded.
 */
#ifndef KVR_CUDA_H
#define KVR_CUDA_H

#include <stddef.h>

/* What a pointer is, as the runtime sees it. */
enum {
    KVR_CUDA_MEM_UNKNOWN = 0, /* not known to CUDA: pageable host memory */
    KVR_CUDA_MEM_HOST = 1,    /* pinned / registered host memory */
    KVR_CUDA_MEM_DEVICE = 2,  /* device memory (VRAM) */
    KVR_CUDA_MEM_MANAGED = 3, /* managed (unified) memory */
};

/* Loads the runtime.  0, or -1 with the reason in err. */
int kvr_cuda_load(char *err, size_t errlen);
/* 1 once loaded. */
int kvr_cuda_loaded(void);
/* The file that was loaded ("" before). */
const char *kvr_cuda_path(void);
/* Runtime version (e.g. 12040), or 0. */
int kvr_cuda_runtime_version(void);

/* Number of devices, or -1 with err. */
int kvr_cuda_device_count(char *err, size_t errlen);
/* Memory kind (KVR_CUDA_MEM_*) and device of ptr; -1 with err on error. */
int kvr_cuda_pointer_kind(const void *ptr, int *device, char *err, size_t errlen);

int kvr_cuda_get_device(int *dev);
int kvr_cuda_set_device(int dev, char *err, size_t errlen);

/* Pinned host memory. */
void *kvr_cuda_host_alloc(size_t len, char *err, size_t errlen);
void kvr_cuda_host_free(void *p);

/* A non-blocking stream on the current device. */
int kvr_cuda_stream_create(void **stream, char *err, size_t errlen);
void kvr_cuda_stream_destroy(void *stream);
int kvr_cuda_stream_sync(void *stream, char *err, size_t errlen);

/* An event without timing. */
int kvr_cuda_event_create(void **event, char *err, size_t errlen);
void kvr_cuda_event_destroy(void *event);
int kvr_cuda_event_record(void *event, void *stream, char *err, size_t errlen);
/* 1 done, 0 not yet, -1 failed (err). */
int kvr_cuda_event_query(void *event, char *err, size_t errlen);

enum { KVR_CUDA_H2D = 1, KVR_CUDA_D2H = 2, KVR_CUDA_D2D = 3, KVR_CUDA_DEFAULT = 4 };
int kvr_cuda_memcpy_async(void *dst, const void *src, size_t len, int kind, void *stream,
                          char *err, size_t errlen);
/* Synchronous copy (used only outside the data path's hot loop). */
int kvr_cuda_memcpy(void *dst, const void *src, size_t len, int kind, char *err, size_t errlen);

#endif
