/*
 * ref_ucx_put: what a NIXL-like put loop achieves with the same UCX.
 *
 *   ref_ucx_put PLANFILE put|get ROUNDS WARMUP
 *
 * Two processes (fork): the "prefill" holds the source pages, the "decode"
 * the destination pages, each as NBUF registered buffers.  They swap worker
 * addresses, buffer addresses and packed rkeys over a socketpair.
 *
 *   put: the prefill posts one ucp_put_nbx per contiguous run of pages per
 *        buffer per room, then one ucp_ep_flush_nbx per room (a NIXL UCX
 *        transfer request: its writes, then a flush); the round ends when
 *        every room's flush completed.
 *   get: the decode does the same with ucp_get_nbx (pull).
 *
 * The passive side only progresses its worker (tcp RMA in UCX 1.13 needs
 * it), event driven: it sleeps on the worker's wakeup fd (ucp_worker_arm),
 * as kvrecv's engine thread does, so that on a small machine it does not
 * take a core from the initiator.  The initiator busy-polls while it waits
 * for its flushes.  There is no completion notice to the passive side, so
 * this is an upper bound for a put-based design.  Output: one JSON object
 * on stdout.
 *
 * The plan file (written by common.write_plan_file):
 *   u32 nbuf, u32 pool_pages, u32 rooms, u32 pages, u64 item,
 *   then per room: i32 src[pages], i32 dst[pages].
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#define CHECK(cond, ...)                                                                    \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            fprintf(stderr, "ref_ucx_put: " __VA_ARGS__);                                   \
            fprintf(stderr, "\n");                                                          \
            exit(2);                                                                        \
        }                                                                                   \
    } while (0)

typedef struct {
    uint32_t nbuf, pool, rooms, pages;
    uint64_t item;
    int32_t *src, *dst; /* rooms * pages each */
} plan_t;

typedef struct {
    uint64_t src, dst; /* byte offsets within a buffer */
    uint64_t len;
} run_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec * 1e-6;
}

static void read_plan(const char *path, plan_t *p)
{
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL, "cannot open %s: %s", path, strerror(errno));
    CHECK(fread(&p->nbuf, 4, 1, f) == 1 && fread(&p->pool, 4, 1, f) == 1 &&
              fread(&p->rooms, 4, 1, f) == 1 && fread(&p->pages, 4, 1, f) == 1 &&
              fread(&p->item, 8, 1, f) == 1,
          "short plan header");
    size_t n = (size_t)p->rooms * p->pages;
    p->src = malloc(n * 4);
    p->dst = malloc(n * 4);
    for (uint32_t r = 0; r < p->rooms; r++) {
        CHECK(fread(p->src + (size_t)r * p->pages, 4, p->pages, f) == p->pages &&
                  fread(p->dst + (size_t)r * p->pages, 4, p->pages, f) == p->pages,
              "short plan body");
    }
    fclose(f);
}

/* Contiguous runs of room r (both sides consecutive). */
static size_t room_runs(const plan_t *p, uint32_t r, run_t *out)
{
    const int32_t *s = p->src + (size_t)r * p->pages, *d = p->dst + (size_t)r * p->pages;
    size_t n = 0;
    for (uint32_t i = 0; i < p->pages; i++) {
        if (i > 0 && s[i] == s[i - 1] + 1 && d[i] == d[i - 1] + 1) {
            out[n - 1].len += p->item;
        } else {
            out[n].src = (uint64_t)s[i] * p->item;
            out[n].dst = (uint64_t)d[i] * p->item;
            out[n].len = p->item;
            n++;
        }
    }
    return n;
}

static void xwrite(int fd, const void *buf, size_t len)
{
    const char *b = buf;
    while (len) {
        ssize_t n = write(fd, b, len);
        CHECK(n > 0, "write: %s", strerror(errno));
        b += n;
        len -= (size_t)n;
    }
}

static void xread(int fd, void *buf, size_t len)
{
    char *b = buf;
    while (len) {
        ssize_t n = read(fd, b, len);
        CHECK(n > 0, "read: %s", n == 0 ? "peer closed" : strerror(errno));
        b += n;
        len -= (size_t)n;
    }
}

static void send_blob(int fd, const void *buf, uint64_t len)
{
    xwrite(fd, &len, 8);
    xwrite(fd, buf, len);
}

static void *recv_blob(int fd, uint64_t *len)
{
    xread(fd, len, 8);
    void *b = malloc(*len ? *len : 1);
    xread(fd, b, *len);
    return b;
}

static void wait_req(ucp_worker_h w, void *req)
{
    if (req == NULL) {
        return;
    }
    CHECK(!UCS_PTR_IS_ERR(req), "request failed: %s", ucs_status_string(UCS_PTR_STATUS(req)));
    while (ucp_request_check_status(req) == UCS_INPROGRESS) {
        ucp_worker_progress(w);
    }
    ucs_status_t st = ucp_request_check_status(req);
    CHECK(st == UCS_OK, "request completed with %s", ucs_status_string(st));
    ucp_request_free(req);
}

int main(int argc, char **argv)
{
    CHECK(argc == 5, "usage: ref_ucx_put PLANFILE put|get ROUNDS WARMUP");
    plan_t p;
    read_plan(argv[1], &p);
    int get = strcmp(argv[2], "get") == 0;
    CHECK(get || strcmp(argv[2], "put") == 0, "mode must be put or get");
    int rounds = atoi(argv[3]), warmup = atoi(argv[4]);

    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    int is_decode = pid == 0;
    int fd = is_decode ? sv[1] : sv[0];
    close(is_decode ? sv[0] : sv[1]);
    int initiator = get ? is_decode : !is_decode;

    ucp_config_t *cfg;
    CHECK(ucp_config_read(NULL, NULL, &cfg) == UCS_OK, "ucp_config_read");
    ucp_params_t up;
    memset(&up, 0, sizeof(up));
    up.field_mask = UCP_PARAM_FIELD_FEATURES;
    up.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    ucp_context_h ctx;
    CHECK(ucp_init(&up, cfg, &ctx) == UCS_OK, "ucp_init");
    ucp_config_release(cfg);
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    ucp_worker_h w;
    CHECK(ucp_worker_create(ctx, &wp, &w) == UCS_OK, "ucp_worker_create");

    /* buffers: the prefill's hold the pattern, the decode's are zero */
    size_t blen = (size_t)p.pool * p.item;
    char **buf = calloc(p.nbuf, sizeof(char *));
    ucp_mem_h *memh = calloc(p.nbuf, sizeof(ucp_mem_h));
    for (uint32_t b = 0; b < p.nbuf; b++) {
        CHECK(posix_memalign((void **)&buf[b], 4096, blen) == 0, "out of memory");
        uint64_t *wds = (uint64_t *)buf[b];
        for (size_t i = 0; i < blen / 8; i++) {
            wds[i] = is_decode ? 0 : ((uint64_t)b << 48) + i;
        }
        ucp_mem_map_params_t mp;
        memset(&mp, 0, sizeof(mp));
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        mp.address = buf[b];
        mp.length = blen;
        CHECK(ucp_mem_map(ctx, &mp, &memh[b]) == UCS_OK, "ucp_mem_map");
    }

    /* exchange worker address, buffer addresses and rkeys: the prefill
     * sends first, the decode receives first (the blobs can exceed the
     * socket buffer, so both sending at once could block forever) */
    ucp_address_t *addr;
    size_t addr_len;
    CHECK(ucp_worker_get_address(w, &addr, &addr_len) == UCS_OK, "get_address");
    uint64_t raddr_len = 0;
    void *raddr = NULL;
    uint64_t *rbase = calloc(p.nbuf, 8);
    void **rkbuf = calloc(p.nbuf, sizeof(void *));
    for (int turn = 0; turn < 2; turn++) {
        if ((turn == 0) == !is_decode) {
            send_blob(fd, addr, addr_len);
            for (uint32_t b = 0; b < p.nbuf; b++) {
                void *rk;
                size_t rk_len;
                CHECK(ucp_rkey_pack(ctx, memh[b], &rk, &rk_len) == UCS_OK, "rkey_pack");
                uint64_t a = (uint64_t)(uintptr_t)buf[b];
                xwrite(fd, &a, 8);
                send_blob(fd, rk, rk_len);
                ucp_rkey_buffer_release(rk);
            }
        } else {
            raddr = recv_blob(fd, &raddr_len);
            for (uint32_t b = 0; b < p.nbuf; b++) {
                uint64_t l;
                xread(fd, &rbase[b], 8);
                rkbuf[b] = recv_blob(fd, &l);
            }
        }
    }
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = raddr;
    ucp_ep_h e;
    CHECK(ucp_ep_create(w, &ep, &e) == UCS_OK, "ucp_ep_create");
    ucp_rkey_h *rkey = calloc(p.nbuf, sizeof(ucp_rkey_h));
    for (uint32_t b = 0; b < p.nbuf; b++) {
        CHECK(ucp_ep_rkey_unpack(e, rkbuf[b], &rkey[b]) == UCS_OK, "rkey_unpack");
    }

    double cpu0 = cpu_s();
    double *secs = calloc((size_t)rounds + warmup, sizeof(double));
    uint64_t ops = 0;
    if (initiator) {
        run_t *runs = malloc((size_t)p.pages * sizeof(run_t));
        void **flush = calloc(p.rooms, sizeof(void *));
        for (int it = 0; it < rounds + warmup; it++) {
            if (it == warmup) {
                cpu0 = cpu_s();
                ops = 0;
            }
            double t0 = now_s();
            for (uint32_t r = 0; r < p.rooms; r++) {
                size_t nr = room_runs(&p, r, runs);
                for (uint32_t b = 0; b < p.nbuf; b++) {
                    ucp_request_param_t rp;
                    memset(&rp, 0, sizeof(rp));
                    rp.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
                    rp.memh = memh[b];
                    for (size_t k = 0; k < nr; k++) {
                        void *req;
                        if (get) { /* decode pulls prefill src into its dst */
                            req = ucp_get_nbx(e, buf[b] + runs[k].dst, runs[k].len,
                                              rbase[b] + runs[k].src, rkey[b], &rp);
                        } else {
                            req = ucp_put_nbx(e, buf[b] + runs[k].src, runs[k].len,
                                              rbase[b] + runs[k].dst, rkey[b], &rp);
                        }
                        CHECK(!UCS_PTR_IS_ERR(req), "put/get: %s",
                              ucs_status_string(UCS_PTR_STATUS(req)));
                        if (req != NULL) {
                            ucp_request_free(req); /* completion comes with the flush */
                        }
                        ops++;
                    }
                }
                ucp_request_param_t fp;
                memset(&fp, 0, sizeof(fp));
                flush[r] = ucp_ep_flush_nbx(e, &fp);
            }
            for (uint32_t r = 0; r < p.rooms; r++) {
                wait_req(w, flush[r]);
            }
            secs[it] = now_s() - t0;
        }
        double cpu = cpu_s() - cpu0;
        char stop = 1;
        xwrite(fd, &stop, 1);
        double peer_cpu;
        xread(fd, &peer_cpu, sizeof(peer_cpu));
        int bad = 0;
        if (get) { /* we are the decode: check */
            for (uint32_t r = 0; r < p.rooms; r++) {
                for (uint32_t i = 0; i < p.pages; i++) {
                    uint32_t b = (r + i) % p.nbuf;
                    uint64_t want = ((uint64_t)b << 48) +
                                    (uint64_t)p.src[(size_t)r * p.pages + i] * p.item / 8;
                    if (*(uint64_t *)(buf[b] + (uint64_t)p.dst[(size_t)r * p.pages + i] * p.item) != want) {
                        bad++;
                    }
                }
            }
        } else {
            int32_t pbad;
            xread(fd, &pbad, 4);
            bad = pbad;
        }
        printf("{\"mode\": \"%s\", \"ops_per_room\": %.1f, \"initiator_cpu\": %.6f, "
               "\"passive_cpu\": %.6f, \"bad_pages\": %d, \"seconds\": [",
               argv[2], (double)ops / rounds / p.rooms, cpu, peer_cpu, bad);
        for (int it = warmup; it < rounds + warmup; it++) {
            printf("%s%.9f", it > warmup ? ", " : "", secs[it]);
        }
        printf("], \"warmup_seconds\": [");
        for (int it = 0; it < warmup; it++) {
            printf("%s%.9f", it ? ", " : "", secs[it]);
        }
        printf("]}\n");
        fflush(stdout);
    } else {
        /* passive: progress until told to stop, sleeping on the worker's
         * event fd when there is nothing to do; the CPU counted is that of
         * the whole run */
        int efd;
        CHECK(ucp_worker_get_efd(w, &efd) == UCS_OK, "ucp_worker_get_efd");
        for (;;) {
            unsigned progressed = 0;
            while (ucp_worker_progress(w) != 0) {
                progressed = 1;
            }
            struct pollfd pfd[2] = {{fd, POLLIN, 0}, {efd, POLLIN, 0}};
            if (poll(pfd, 1, 0) > 0) {
                break;
            }
            ucs_status_t st = ucp_worker_arm(w);
            if (st == UCS_ERR_BUSY) {
                /* UCX 1.13 over posix/sysv/cma keeps answering BUSY after
                 * one-sided operations, with nothing to progress: nap
                 * instead of spinning. */
                usleep(progressed ? 5 : 50);
                continue;
            }
            CHECK(st == UCS_OK, "ucp_worker_arm: %s", ucs_status_string(st));
            poll(pfd, 2, -1);
        }
        char stop;
        xread(fd, &stop, 1);
        double cpu = cpu_s() - cpu0;
        xwrite(fd, &cpu, sizeof(cpu));
        if (!get) { /* we are the decode: check */
            int32_t bad = 0;
            for (uint32_t r = 0; r < p.rooms; r++) {
                for (uint32_t i = 0; i < p.pages; i++) {
                    uint32_t b = (r + i) % p.nbuf;
                    uint64_t want = ((uint64_t)b << 48) +
                                    (uint64_t)p.src[(size_t)r * p.pages + i] * p.item / 8;
                    if (*(uint64_t *)(buf[b] + (uint64_t)p.dst[(size_t)r * p.pages + i] * p.item) != want) {
                        bad++;
                    }
                }
            }
            xwrite(fd, &bad, 4);
        }
    }

    /* teardown: flush and close quietly */
    for (uint32_t b = 0; b < p.nbuf; b++) {
        ucp_rkey_destroy(rkey[b]);
    }
    ucp_request_param_t cp;
    memset(&cp, 0, sizeof(cp));
    cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void *creq = ucp_ep_close_nbx(e, &cp);
    if (UCS_PTR_IS_PTR(creq)) {
        for (int i = 0; i < 100000 && ucp_request_check_status(creq) == UCS_INPROGRESS; i++) {
            ucp_worker_progress(w);
        }
        ucp_request_free(creq);
    }
    for (uint32_t b = 0; b < p.nbuf; b++) {
        ucp_mem_unmap(ctx, memh[b]);
        free(buf[b]);
    }
    ucp_worker_release_address(w, addr);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
    if (!is_decode) {
        int status;
        waitpid(pid, &status, 0);
    }
    return 0;
}
