/*
 * Test runner: forks one child per test, kills it after its timeout, and
 * reports "N passed, M failed".
 *
 *   runner            run every test (not the hidden self-checks)
 *   runner NAME...    run only these tests
 *   runner --list     print the test names
 *
 * Environment: TEST_TIMEOUT_SCALE multiplies every timeout (valgrind, TSan);
 * TEST_SEED seeds the randomized tests.
 */
#include "runner.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TEST_XFAIL 1
#define TEST_HIDDEN 2

#include "test_list.h"

#define DECLARE(name, timeout, flags) TEST_IMPL(name);
TEST_LIST(DECLARE)
#undef DECLARE

typedef struct {
    const char *name;
    void (*fn)(void);
    int timeout_s;
    int flags;
} test_entry_t;

static const test_entry_t tests[] = {
#define ENTRY(name, timeout, flags) {#name, run_test_##name, timeout, flags},
    TEST_LIST(ENTRY)
#undef ENTRY
};

#define NTESTS (sizeof(tests) / sizeof(tests[0]))

uint64_t test_seed(void)
{
    const char *s = getenv("TEST_SEED");
    uint64_t v = s ? strtoull(s, NULL, 0) : 0x9e3779b97f4a7c15ULL;
    return v ? v : 1;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Runs one test in a child.  Returns 1 if it passed, 0 otherwise, and
 * describes the outcome in what. */
static int run_one(const test_entry_t *t, double scale, char *what, size_t wlen)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(what, wlen, "fork: %s", strerror(errno));
        return 0;
    }
    if (pid == 0) {
        setpgid(0, 0);
        t->fn();
        fflush(stdout);
        fflush(stderr);
        exit(0);
    }
    double limit = t->timeout_s * scale;
    double start = now_s();
    int status = 0;
    for (;;) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid) {
            break;
        }
        if (w < 0 && errno != EINTR) {
            snprintf(what, wlen, "waitpid: %s", strerror(errno));
            return 0;
        }
        if (now_s() - start > limit) {
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            snprintf(what, wlen, "timed out after %.0f s", limit);
            return 0;
        }
        usleep(2000);
    }
    if (WIFEXITED(status)) {
        if (WEXITSTATUS(status) == 0) {
            snprintf(what, wlen, "%.2f s", now_s() - start);
            return 1;
        }
        snprintf(what, wlen, "exit status %d", WEXITSTATUS(status));
        return 0;
    }
    if (WIFSIGNALED(status)) {
        snprintf(what, wlen, "killed by signal %d (%s)", WTERMSIG(status),
                 strsignal(WTERMSIG(status)));
        return 0;
    }
    snprintf(what, wlen, "unknown wait status %d", status);
    return 0;
}

int main(int argc, char **argv)
{
    const char *sc = getenv("TEST_TIMEOUT_SCALE");
    double scale = sc ? atof(sc) : 1.0;
    if (scale <= 0) {
        scale = 1.0;
    }
    if (argc > 1 && strcmp(argv[1], "--list") == 0) {
        for (size_t i = 0; i < NTESTS; i++) {
            printf("%s%s\n", tests[i].name,
                   tests[i].flags & TEST_XFAIL ? " (xfail)"
                   : tests[i].flags & TEST_HIDDEN ? " (hidden)" : "");
        }
        return 0;
    }
    /* Selection: names on the command line, or every non-hidden test. */
    int selected[NTESTS];
    int nsel = 0;
    for (size_t i = 0; i < NTESTS; i++) {
        selected[i] = 0;
    }
    if (argc > 1) {
        for (int a = 1; a < argc; a++) {
            size_t i;
            for (i = 0; i < NTESTS; i++) {
                if (strcmp(argv[a], tests[i].name) == 0) {
                    selected[i] = 1;
                    break;
                }
            }
            if (i == NTESTS) {
                fprintf(stderr, "unknown test: %s\n", argv[a]);
                return 2;
            }
        }
    } else {
        for (size_t i = 0; i < NTESTS; i++) {
            selected[i] = !(tests[i].flags & TEST_HIDDEN);
        }
    }
    for (size_t i = 0; i < NTESTS; i++) {
        nsel += selected[i];
    }

    int passed = 0, failed = 0, xfailed = 0, n = 0;
    printf("1..%d\n", nsel);
    for (size_t i = 0; i < NTESTS; i++) {
        if (!selected[i]) {
            continue;
        }
        char what[128];
        int ok = run_one(&tests[i], scale, what, sizeof(what));
        n++;
        if (tests[i].flags & TEST_XFAIL) {
            if (ok) {
                printf("not ok %d - %s # known bug no longer reproduces: remove TEST_XFAIL\n",
                       n, tests[i].name);
                failed++;
            } else {
                printf("ok %d - %s # TODO known core bug (%s)\n", n, tests[i].name, what);
                xfailed++;
                passed++;
            }
        } else if (ok) {
            printf("ok %d - %s (%s)\n", n, tests[i].name, what);
            passed++;
        } else {
            printf("not ok %d - %s (%s)\n", n, tests[i].name, what);
            failed++;
        }
        fflush(stdout);
    }
    if (xfailed) {
        printf("# %d of the passed tests are expected failures (known core bugs)\n", xfailed);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
