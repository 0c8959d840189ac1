/*
 * tcp_pair: the plainest tcp transfer over loopback, as a reference for
 * what the host's kernel and network stack give any library.
 *
 *   tcp_pair MIB_PER_ROUND ROUNDS SEND_KIB RECV_KIB CONGESTION
 *
 * Two processes (fork) and one connection on 127.0.0.1 with TCP_NODELAY
 * and the host's socket buffer autotuning.  The sender writes each round
 * from one buffer with non-blocking send() calls of at most SEND_KIB,
 * sleeping in poll() when the socket is full (as a lane's engine thread
 * does); the receiver reads into one buffer with non-blocking recv() of at
 * most RECV_KIB, sleeping in poll() when nothing is there, and answers one
 * byte once the round is in.  A round is timed by the sender from its
 * first write to that byte.  Output: one JSON object on stdout,
 * {"gbps": [...]} (1e9 B/s per round).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void wait_fd(int fd, short events)
{
    struct pollfd p = {.fd = fd, .events = events};
    (void)poll(&p, 1, 1000);
}

static int receiver(struct sockaddr_in *a, size_t round, int rounds, size_t chunk)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    if (fd < 0 || connect(fd, (struct sockaddr *)a, sizeof(*a)) != 0) {
        perror("tcp_pair: connect");
        return 1;
    }
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    char *buf = malloc(round);
    if (buf == NULL) {
        return 1;
    }
    memset(buf, 0, round);
    for (int r = 0; r < rounds; r++) {
        size_t got = 0;
        while (got < round) {
            size_t want = round - got < chunk ? round - got : chunk;
            ssize_t k = recv(fd, buf + got, want, MSG_DONTWAIT);
            if (k > 0) {
                got += (size_t)k;
            } else if (k == 0) {
                fprintf(stderr, "tcp_pair: the sender went away\n");
                return 1;
            } else if (errno != EAGAIN && errno != EINTR) {
                perror("tcp_pair: recv");
                return 1;
            } else {
                wait_fd(fd, POLLIN);
            }
        }
        char c = 1;
        if (send(fd, &c, 1, MSG_NOSIGNAL) != 1) {
            return 1;
        }
    }
    return 0;
}

static int sender(int fd, size_t round, int rounds, size_t chunk)
{
    char *src = malloc(round);
    if (src == NULL) {
        return 1;
    }
    memset(src, 7, round);
    printf("{\"gbps\": [");
    for (int r = 0; r < rounds; r++) {
        double t0 = now_s();
        size_t put = 0;
        while (put < round) {
            size_t want = round - put < chunk ? round - put : chunk;
            ssize_t k = send(fd, src + put, want, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (k > 0) {
                put += (size_t)k;
            } else if (k < 0 && errno != EAGAIN && errno != EINTR) {
                perror("tcp_pair: send");
                return 1;
            } else {
                wait_fd(fd, POLLOUT);
            }
        }
        char c;
        if (recv(fd, &c, 1, 0) != 1) {
            fprintf(stderr, "tcp_pair: the receiver went away\n");
            return 1;
        }
        printf("%s%.4f", r ? ", " : "", (double)round / (now_s() - t0) / 1e9);
    }
    printf("]}\n");
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: tcp_pair MIB_PER_ROUND ROUNDS SEND_KIB RECV_KIB CONGESTION\n");
        return 2;
    }
    size_t round = (size_t)atol(argv[1]) << 20, send_chunk = (size_t)atol(argv[3]) << 10;
    size_t recv_chunk = (size_t)atol(argv[4]) << 10;
    int rounds = atoi(argv[2]);
    if (round == 0 || rounds <= 0 || send_chunk == 0 || recv_chunk == 0) {
        fprintf(stderr, "tcp_pair: sizes and rounds must be positive\n");
        return 2;
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof(a);
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof(a)) != 0 ||
        getsockname(ls, (struct sockaddr *)&a, &alen) != 0 || listen(ls, 1) != 0) {
        perror("tcp_pair: listen");
        return 1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        perror("tcp_pair: fork");
        return 1;
    }
    if (pid == 0) {
        close(ls);
        _exit(receiver(&a, round, rounds, recv_chunk));
    }
    int fd = accept(ls, NULL, NULL), one = 1;
    if (fd < 0) {
        perror("tcp_pair: accept");
        return 1;
    }
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, argv[5], (socklen_t)strlen(argv[5])) != 0) {
        perror("tcp_pair: TCP_CONGESTION");
        return 1;
    }
    int rc = sender(fd, round, rounds, send_chunk);
    close(fd);
    int st = 0;
    waitpid(pid, &st, 0);
    return rc ? rc : (WIFEXITED(st) ? WEXITSTATUS(st) : 1);
}
