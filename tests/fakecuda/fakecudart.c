/*
 * A fake CUDA runtime for kvrecv's tests on machines without a GPU.
 *
 * It implements the runtime functions kvrecv resolves (csrc/cuda.c), with:
 *   - "device memory" from cudaMalloc: an address range reserved with
 *     PROT_NONE (any direct host access through it faults) backed by a
 *     separate host allocation that only the fake's copies touch;
 *   - pinned memory from cudaHostAlloc (reported as host-registered);
 *   - streams with one worker thread each: cudaMemcpyAsync really is
 *     asynchronous, events complete when the worker reaches them, so
 *     ordering and event bugs in the caller show up.  FAKECUDA_DELAY_US
 *     delays every async copy (widens race windows);
 *   - copy-kind checks: a copy whose kind does not match the memory it
 *     touches fails with cudaErrorInvalidValue.
 * FAKECUDA_DEVICES sets the device count (default 1; 0: none).
 * fakecuda_counters() reports what was done, for the tests.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define OK 0
#define E_INVALID_VALUE 1
#define E_MEMORY 2
#define E_NO_DEVICE 100
#define E_NOT_READY 600

typedef struct {
    int type;
    int device;
    void *device_pointer;
    void *host_pointer;
} attrs_t;

typedef struct {
    char *fake;
    char *real;
    size_t len;
    int device; /* 1 device, 0 pinned host */
} region_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static region_t *g_regions;
static size_t g_nregions, g_cap;
static uint64_t g_counters[6]; /* h2d, d2h, d2d, bytes, async, bad kind */
static __thread int t_device;

static long env_long(const char *name, long dflt)
{
    const char *v = getenv(name);
    return v && *v ? strtol(v, NULL, 10) : dflt;
}

static void add_region(char *fake, char *real, size_t len, int device)
{
    pthread_mutex_lock(&g_lock);
    if (g_nregions == g_cap) {
        g_cap = g_cap ? g_cap * 2 : 64;
        g_regions = realloc(g_regions, g_cap * sizeof(region_t));
    }
    g_regions[g_nregions++] = (region_t){fake, real, len, device};
    pthread_mutex_unlock(&g_lock);
}

/* The region containing [p, p+len); -1 if p is not in one. */
static int find_region(const void *p, size_t len, region_t *out)
{
    const char *c = p;
    int found = -1;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_nregions; i++) {
        region_t *r = &g_regions[i];
        if (c >= r->fake && c < r->fake + r->len) {
            if (len > (size_t)(r->fake + r->len - c)) {
                found = -2; /* runs past the allocation */
            } else {
                *out = *r;
                found = 0;
            }
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

static int remove_region(void *fake, region_t *out)
{
    int rc = -1;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_nregions; i++) {
        if (g_regions[i].fake == fake) {
            *out = g_regions[i];
            g_regions[i] = g_regions[--g_nregions];
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

int cudaGetDeviceCount(int *n)
{
    *n = (int)env_long("FAKECUDA_DEVICES", 1);
    return *n > 0 ? OK : E_NO_DEVICE;
}

int cudaGetDevice(int *d)
{
    *d = t_device;
    return OK;
}

int cudaSetDevice(int d)
{
    int n = 0;
    cudaGetDeviceCount(&n);
    if (d < 0 || d >= n) {
        return E_INVALID_VALUE;
    }
    t_device = d;
    return OK;
}

int cudaRuntimeGetVersion(int *v)
{
    *v = 12040;
    return OK;
}

int cudaGetLastError(void)
{
    return OK;
}

const char *cudaGetErrorString(int e)
{
    switch (e) {
    case OK:
        return "no error";
    case E_INVALID_VALUE:
        return "invalid argument";
    case E_MEMORY:
        return "out of memory";
    case E_NO_DEVICE:
        return "no CUDA-capable device is detected";
    case E_NOT_READY:
        return "device not ready";
    default:
        return "unknown error";
    }
}

int cudaMalloc(void **p, size_t len)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    size_t span = (len + pg - 1) / pg * pg;
    if (span == 0) {
        span = pg;
    }
    void *fake = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    char *real = calloc(1, span);
    if (fake == MAP_FAILED || real == NULL) {
        free(real);
        return E_MEMORY;
    }
    add_region(fake, real, span, 1);
    *p = fake;
    return OK;
}

int cudaFree(void *p)
{
    region_t r;
    if (p == NULL) {
        return OK;
    }
    if (remove_region(p, &r) != 0 || !r.device) {
        return E_INVALID_VALUE;
    }
    munmap(r.fake, r.len);
    free(r.real);
    return OK;
}

int cudaHostAlloc(void **p, size_t len, unsigned flags)
{
    (void)flags;
    char *m = aligned_alloc(4096, (len + 4095) / 4096 * 4096);
    if (m == NULL) {
        return E_MEMORY;
    }
    add_region(m, m, len, 0);
    *p = m;
    return OK;
}

int cudaMallocHost(void **p, size_t len)
{
    return cudaHostAlloc(p, len, 0);
}

int cudaFreeHost(void *p)
{
    region_t r;
    if (remove_region(p, &r) != 0 || r.device) {
        return E_INVALID_VALUE;
    }
    free(p);
    return OK;
}

int cudaPointerGetAttributes(attrs_t *a, const void *p)
{
    region_t r;
    memset(a, 0, sizeof(*a));
    a->device = -2;
    if (find_region(p, 1, &r) == 0) {
        a->type = r.device ? 2 : 1;
        a->device = 0;
        a->device_pointer = (void *)p;
        a->host_pointer = r.device ? NULL : (void *)p;
    }
    return OK;
}

/* Resolves a copy: real addresses, and whether each side is device. */
static int resolve(void *dst, const void *src, size_t len, int kind, char **rdst,
                   const char **rsrc)
{
    region_t rd, rs;
    int fd = find_region(dst, len, &rd), fs = find_region(src, len, &rs);
    if (fd == -2 || fs == -2) {
        return E_INVALID_VALUE;
    }
    int ddev = fd == 0 && rd.device, sdev = fs == 0 && rs.device;
    int want_ddev = kind == 1 || kind == 3, want_sdev = kind == 2 || kind == 3;
    if (kind != 4 && (ddev != want_ddev || sdev != want_sdev)) {
        __atomic_add_fetch(&g_counters[5], 1, __ATOMIC_RELAXED);
        return E_INVALID_VALUE;
    }
    *rdst = ddev ? rd.real + ((char *)dst - rd.fake) : dst;
    *rsrc = sdev ? rs.real + ((const char *)src - rs.fake) : src;
    int k = ddev && sdev ? 2 : ddev ? 0 : sdev ? 1 : -1;
    if (k >= 0) {
        __atomic_add_fetch(&g_counters[k], 1, __ATOMIC_RELAXED);
    }
    __atomic_add_fetch(&g_counters[3], len, __ATOMIC_RELAXED);
    return OK;
}

int cudaMemcpy(void *dst, const void *src, size_t len, int kind)
{
    char *d;
    const char *s;
    int rc = resolve(dst, src, len, kind, &d, &s);
    if (rc == OK) {
        memmove(d, s, len);
    }
    return rc;
}

/* ---- streams and events ---- */

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    uint64_t recorded;  /* generation of the last record */
    uint64_t completed; /* generation the stream reached */
} event_t;

typedef struct task {
    int is_event;
    char *dst;
    const char *src;
    size_t len;
    event_t *ev;
    uint64_t gen;
    struct task *next;
} task_t;

typedef struct {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    task_t *head, *tail;
    int busy, stop;
    long delay_us;
} stream_t;

static void *stream_main(void *arg)
{
    stream_t *s = arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while (s->head == NULL && !s->stop) {
            pthread_cond_wait(&s->cond, &s->lock);
        }
        if (s->head == NULL && s->stop) {
            break;
        }
        task_t *t = s->head;
        s->head = t->next;
        if (s->head == NULL) {
            s->tail = NULL;
        }
        s->busy = 1;
        pthread_mutex_unlock(&s->lock);
        if (t->is_event) {
            pthread_mutex_lock(&t->ev->lock);
            if (t->gen > t->ev->completed) {
                t->ev->completed = t->gen;
            }
            pthread_cond_broadcast(&t->ev->cond);
            pthread_mutex_unlock(&t->ev->lock);
        } else {
            if (s->delay_us > 0) {
                usleep((useconds_t)s->delay_us);
            }
            memmove(t->dst, t->src, t->len);
        }
        free(t);
        pthread_mutex_lock(&s->lock);
        s->busy = 0;
        pthread_cond_broadcast(&s->cond);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

static void stream_push(stream_t *s, task_t *t)
{
    pthread_mutex_lock(&s->lock);
    t->next = NULL;
    if (s->tail) {
        s->tail->next = t;
    } else {
        s->head = t;
    }
    s->tail = t;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
}

int cudaStreamCreateWithFlags(void **out, unsigned flags)
{
    (void)flags;
    stream_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return E_MEMORY;
    }
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    s->delay_us = env_long("FAKECUDA_DELAY_US", 0);
    if (pthread_create(&s->thread, NULL, stream_main, s) != 0) {
        free(s);
        return E_MEMORY;
    }
    *out = s;
    return OK;
}

int cudaStreamSynchronize(void *p)
{
    stream_t *s = p;
    if (s == NULL) {
        return OK;
    }
    pthread_mutex_lock(&s->lock);
    while (s->head != NULL || s->busy) {
        pthread_cond_wait(&s->cond, &s->lock);
    }
    pthread_mutex_unlock(&s->lock);
    return OK;
}

int cudaStreamDestroy(void *p)
{
    stream_t *s = p;
    if (s == NULL) {
        return E_INVALID_VALUE;
    }
    pthread_mutex_lock(&s->lock);
    s->stop = 1;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    free(s);
    return OK;
}

int cudaMemcpyAsync(void *dst, const void *src, size_t len, int kind, void *stream)
{
    if (stream == NULL) {
        return cudaMemcpy(dst, src, len, kind);
    }
    task_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return E_MEMORY;
    }
    int rc = resolve(dst, src, len, kind, &t->dst, &t->src);
    if (rc != OK) {
        free(t);
        return rc;
    }
    t->len = len;
    __atomic_add_fetch(&g_counters[4], 1, __ATOMIC_RELAXED);
    stream_push(stream, t);
    return OK;
}

int cudaEventCreateWithFlags(void **out, unsigned flags)
{
    (void)flags;
    event_t *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return E_MEMORY;
    }
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->cond, NULL);
    *out = e;
    return OK;
}

int cudaEventDestroy(void *p)
{
    event_t *e = p;
    if (e == NULL) {
        return E_INVALID_VALUE;
    }
    pthread_mutex_destroy(&e->lock);
    pthread_cond_destroy(&e->cond);
    free(e);
    return OK;
}

int cudaEventRecord(void *p, void *stream)
{
    event_t *e = p;
    if (e == NULL) {
        return E_INVALID_VALUE;
    }
    pthread_mutex_lock(&e->lock);
    uint64_t gen = ++e->recorded;
    if (stream == NULL) {
        e->completed = gen;
    }
    pthread_mutex_unlock(&e->lock);
    if (stream != NULL) {
        task_t *t = calloc(1, sizeof(*t));
        if (t == NULL) {
            return E_MEMORY;
        }
        t->is_event = 1;
        t->ev = e;
        t->gen = gen;
        stream_push(stream, t);
    }
    return OK;
}

int cudaEventQuery(void *p)
{
    event_t *e = p;
    if (e == NULL) {
        return E_INVALID_VALUE;
    }
    pthread_mutex_lock(&e->lock);
    int done = e->completed >= e->recorded;
    pthread_mutex_unlock(&e->lock);
    return done ? OK : E_NOT_READY;
}

int cudaEventSynchronize(void *p)
{
    event_t *e = p;
    pthread_mutex_lock(&e->lock);
    while (e->completed < e->recorded) {
        pthread_cond_wait(&e->cond, &e->lock);
    }
    pthread_mutex_unlock(&e->lock);
    return OK;
}

int cudaDeviceSynchronize(void)
{
    return OK;
}

/* For the tests: h2d, d2h, d2d copies, bytes, async copies, bad kinds. */
void fakecuda_counters(uint64_t out[6])
{
    for (int i = 0; i < 6; i++) {
        out[i] = __atomic_load_n(&g_counters[i], __ATOMIC_RELAXED);
    }
}
