/* The runner's own checks: each must be reported as a failure. */
#include "runner.h"

#include <signal.h>
#include <unistd.h>

TEST_IMPL(_selftest_assert)
{
    int two = 2;
    ASSERT_EQ(two + 2, 5);
}

TEST_IMPL(_selftest_crash)
{
    raise(SIGSEGV);
}

TEST_IMPL(_selftest_hang)
{
    for (;;) {
        pause();
    }
}
