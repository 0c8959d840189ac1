#define _GNU_SOURCE
#include "lanelisten.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define KVR_LANE_HELLO_LEN (KVR_LANE_MAGIC_LEN + KVR_LANE_TOKEN_LEN)

typedef struct {
    int fd; /* -1: a free slot */
    uint64_t since_ns;
    size_t have;
    unsigned char buf[KVR_LANE_HELLO_LEN];
} kvr_lane_pending_t;

struct kvr_lane_listener {
    int fd;
    int epfd;
    uint16_t port;
    kvr_lane_pending_t pending[KVR_LANE_PENDING_MAX];
};

static void kvr_lane_pending_drop(kvr_lane_listener_t *ll, kvr_lane_pending_t *p)
{
    epoll_ctl(ll->epfd, EPOLL_CTL_DEL, p->fd, NULL);
    close(p->fd);
    p->fd = -1;
}

/* Gives socket fd the congestion control name: 0, or -1 with err. */
static int kvr_lane_congestion_set(int fd, const char *name, char *err, size_t errlen)
{
    if (setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, (socklen_t)strlen(name)) == 0) {
        return 0;
    }
    int why = errno;
    char allowed[128] = "";
    FILE *f = fopen("/proc/sys/net/ipv4/tcp_allowed_congestion_control", "r");
    if (f != NULL) {
        if (fgets(allowed, sizeof(allowed), f) == NULL) {
            allowed[0] = '\0';
        }
        allowed[strcspn(allowed, "\n")] = '\0';
        fclose(f);
    }
    snprintf(err, errlen, "lane_congestion='%s' cannot be used here: %s (this host lets any "
             "process use: %s)", name, strerror(why), allowed[0] ? allowed : "not known");
    return -1;
}

int kvr_lane_congestion_check(const char *name, char *err, size_t errlen)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    }
    if (fd < 0) {
        snprintf(err, errlen, "lane_congestion: no tcp socket: %s", strerror(errno));
        return -1;
    }
    int rc = kvr_lane_congestion_set(fd, name, err, errlen);
    close(fd);
    return rc;
}

kvr_lane_listener_t *kvr_lane_listen(const char *host, const char *congestion, char *err,
                                     size_t errlen)
{
    kvr_lane_listener_t *ll = calloc(1, sizeof(*ll));
    if (ll == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    for (int i = 0; i < KVR_LANE_PENDING_MAX; i++) {
        ll->pending[i].fd = -1;
    }
    ll->fd = ll->epfd = -1;
    int any = host == NULL || host[0] == '\0' || strcmp(host, "*") == 0;
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int rc = getaddrinfo(any ? NULL : host, "0", &hints, &ai);
    if (rc != 0 || ai == NULL) {
        snprintf(err, errlen, "%s: %s", host, gai_strerror(rc));
        goto fail;
    }
    ll->fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (ll->fd >= 0 && congestion[0] != '\0' &&
        kvr_lane_congestion_set(ll->fd, congestion, err, errlen) != 0) {
        goto fail;
    }
    if (ll->fd < 0 || bind(ll->fd, ai->ai_addr, ai->ai_addrlen) != 0 ||
        listen(ll->fd, KVR_LANE_PENDING_MAX) != 0) {
        snprintf(err, errlen, "listening on %s: %s", any ? "*" : host, strerror(errno));
        goto fail;
    }
    struct sockaddr_storage sa;
    socklen_t salen = sizeof(sa);
    if (getsockname(ll->fd, (struct sockaddr *)&sa, &salen) != 0) {
        snprintf(err, errlen, "getsockname: %s", strerror(errno));
        goto fail;
    }
    ll->port = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                              : ((struct sockaddr_in *)&sa)->sin_port);
    ll->epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.fd = ll->fd;
    if (ll->epfd < 0 || epoll_ctl(ll->epfd, EPOLL_CTL_ADD, ll->fd, &ev) != 0) {
        snprintf(err, errlen, "epoll: %s", strerror(errno));
        goto fail;
    }
    freeaddrinfo(ai);
    return ll;
fail:
    if (ai != NULL) {
        freeaddrinfo(ai);
    }
    kvr_lane_listener_free(ll);
    return NULL;
}

void kvr_lane_listener_free(kvr_lane_listener_t *ll)
{
    if (ll == NULL) {
        return;
    }
    for (int i = 0; i < KVR_LANE_PENDING_MAX; i++) {
        if (ll->pending[i].fd >= 0) {
            close(ll->pending[i].fd);
        }
    }
    if (ll->fd >= 0) {
        close(ll->fd);
    }
    if (ll->epfd >= 0) {
        close(ll->epfd);
    }
    free(ll);
}

int kvr_lane_listener_fd(const kvr_lane_listener_t *ll)
{
    return ll->epfd;
}

uint16_t kvr_lane_listener_port(const kvr_lane_listener_t *ll)
{
    return ll->port;
}

int kvr_lane_listener_waiting(const kvr_lane_listener_t *ll)
{
    for (int i = 0; i < KVR_LANE_PENDING_MAX; i++) {
        if (ll->pending[i].fd >= 0) {
            return 1;
        }
    }
    return 0;
}

/* Takes the connections waiting to be accepted into free slots (closing
 * what does not fit). */
static unsigned kvr_lane_accept_all(kvr_lane_listener_t *ll, uint64_t now_ns)
{
    unsigned n = 0;
    for (;;) {
        int fd = accept4(ll->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            return n; /* EAGAIN, or an error of one connection */
        }
        n++;
        kvr_lane_pending_t *p = NULL;
        for (int i = 0; i < KVR_LANE_PENDING_MAX && p == NULL; i++) {
            p = ll->pending[i].fd < 0 ? &ll->pending[i] : NULL;
        }
        struct epoll_event ev;
        memset(&ev, 0, sizeof(ev));
        ev.events = EPOLLIN;
        ev.data.fd = fd;
        if (p == NULL || epoll_ctl(ll->epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
            close(fd);
            continue;
        }
        p->fd = fd;
        p->since_ns = now_ns;
        p->have = 0;
    }
}

unsigned kvr_lane_listener_progress(kvr_lane_listener_t *ll,
                                    int (*take)(void *arg, const unsigned char *token, int fd),
                                    void *arg, uint64_t now_ns)
{
    unsigned n = kvr_lane_accept_all(ll, now_ns);
    for (int i = 0; i < KVR_LANE_PENDING_MAX; i++) {
        kvr_lane_pending_t *p = &ll->pending[i];
        if (p->fd < 0) {
            continue;
        }
        ssize_t k = recv(p->fd, p->buf + p->have, KVR_LANE_HELLO_LEN - p->have, MSG_DONTWAIT);
        if (k > 0) {
            p->have += (size_t)k;
        }
        int gone = k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
        if (p->have == KVR_LANE_HELLO_LEN) {
            n++;
            int fd = p->fd;
            epoll_ctl(ll->epfd, EPOLL_CTL_DEL, fd, NULL);
            p->fd = -1;
            if (memcmp(p->buf, KVR_LANE_MAGIC, KVR_LANE_MAGIC_LEN) != 0 ||
                !take(arg, p->buf + KVR_LANE_MAGIC_LEN, fd)) {
                close(fd);
            }
        } else if (gone || now_ns - p->since_ns > KVR_LANE_HANDSHAKE_NS) {
            n += gone;
            kvr_lane_pending_drop(ll, p);
        }
    }
    return n;
}
