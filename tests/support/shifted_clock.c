/* A wall clock shifted by KEEL_CLOCK_SHIFT seconds (negative: behind) for one process, loaded
 * with LD_PRELOAD: what `faketime` would do for redis-server, whose jemalloc cannot start
 * under libfaketime (it calls clock_gettime while libfaketime initialises itself, through
 * dlsym, which allocates). Here nothing is looked up or allocated: the real clock is read by
 * the system call itself. Only the realtime clocks move; the monotonic ones stay true.
 *
 * Built by tests/support/redis_servers.py (shifted_clock_library) with the system's cc.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long shift_ns(void)
{
    static volatile int known = 0;
    static long long shift = 0;
    if (!known) {
        const char *value = getenv("KEEL_CLOCK_SHIFT");
        shift = value ? atoll(value) * 1000000000LL : 0;
        known = 1;
    }
    return shift;
}

int clock_gettime(clockid_t id, struct timespec *ts)
{
    if (syscall(SYS_clock_gettime, id, ts) != 0) {
        return -1;
    }
    if (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + shift_ns();
        ts->tv_sec = (time_t)(ns / 1000000000LL);
        ts->tv_nsec = (long)(ns % 1000000000LL);
    }
    return 0;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz)
{
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) {
        return -1;
    }
    tv->tv_sec = ts.tv_sec;  /* glibc declares it nonnull */
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *out)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) {
        return (time_t)-1;
    }
    if (out) {
        *out = ts.tv_sec;
    }
    return ts.tv_sec;
}
