/* slowlink: an LD_PRELOAD shim that makes one process's network slow, the way a degraded NIC does.
 *
 * It wraps write, writev, send, sendto and sendmsg. In a selected process, once the fault is
 * active, every write to a socket first waits for its turn on a virtual link of SLOWLINK_BPS
 * bytes per second shared by all the process's threads; then the real call runs unchanged. Data,
 * return values and errno are never altered: only time passes. Files, pipes and ttys are never
 * paced, so logs and the console stay fast.
 *
 *   SLOWLINK_MATCH=NAME=VALUE  the process is selected while getenv(NAME) equals VALUE
 *                              (RANK=5: one local rank; SLURMD_NODENAME=node3: one node).
 *                              Unset: nothing is selected and the shim does nothing.
 *   SLOWLINK_BPS=N             the link's rate in bytes per second.
 *   SLOWLINK_ONSET_FILE=PATH   optional: pacing starts once PATH exists, and then stays on.
 *   SLOWLINK_DEBUG=1           print per-call counts to stderr when the process exits.
 *
 * Everything is read with getenv at call time (cached for at most REFRESH_NS), because Python
 * launchers set RANK with os.environ after the process started, and that calls putenv.
 *
 * Build: gcc -O2 -shared -fPIC -Wall -o slowlink.so slowlink.c -ldl -lpthread
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* How long a read of the environment or of the onset file is trusted. */
#define REFRESH_NS 50000000LL

/* Set while a thread is inside a wrapper, so that anything our own code calls (getenv, access,
 * fstat, dlsym, fprintf) that writes goes straight to libc instead of recursing into the pacer. */
static __thread int inside_shim;

typedef ssize_t (*write_fn)(int, const void *, size_t);
typedef ssize_t (*writev_fn)(int, const struct iovec *, int);
typedef ssize_t (*send_fn)(int, const void *, size_t, int);
typedef ssize_t (*sendto_fn)(int, const void *, size_t, int, const struct sockaddr *, socklen_t);
typedef ssize_t (*sendmsg_fn)(int, const struct msghdr *, int);

static void *real(const char *name, void **slot) {
    void *fn = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!fn) {
        fn = dlsym(RTLD_NEXT, name);
        __atomic_store_n(slot, fn, __ATOMIC_RELEASE);
    }
    return fn;
}
static void *real_write_p, *real_writev_p, *real_send_p, *real_sendto_p, *real_sendmsg_p;
#define REAL(name) ((name##_fn)real(#name, &real_##name##_p))

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- Is the fault on for this process right now? ---------------------------------------- */

static long long config_read_at = -REFRESH_NS - 1; /* when the cache below was filled */
static long long bps;                              /* 0: this process is not selected */
static int onset_seen;                             /* the onset file existed once: stay on */
static pthread_mutex_t config_lock = PTHREAD_MUTEX_INITIALIZER;

static int env_matches(void) {
    const char *match = getenv("SLOWLINK_MATCH");
    const char *eq = match ? strchr(match, '=') : NULL;
    if (!eq || eq == match) return 0;
    char name[256];
    size_t len = (size_t)(eq - match);
    if (len >= sizeof name) return 0;
    memcpy(name, match, len);
    name[len] = '\0';
    const char *value = getenv(name);
    return value && strcmp(value, eq + 1) == 0;
}

static int onset_reached(void) {
    const char *path = getenv("SLOWLINK_ONSET_FILE");
    return !path || !*path || access(path, F_OK) == 0;
}

/* The rate to pace at, or 0 when this process is not (yet) slowed. */
static long long active_bps(void) {
    long long t = now_ns();
    pthread_mutex_lock(&config_lock);
    if (t - config_read_at > REFRESH_NS) {
        bps = 0;
        if (env_matches()) {
            const char *rate = getenv("SLOWLINK_BPS");
            long long r = rate ? atoll(rate) : 0;
            if (r > 0 && (onset_seen || (onset_seen = onset_reached()))) bps = r;
        }
        config_read_at = t;
    }
    long long r = bps;
    pthread_mutex_unlock(&config_lock);
    return r;
}

static int is_socket(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode);
}

/* ---- The virtual link --------------------------------------------------------------------- */

/* The moment the link finishes the bytes already booked: a write books its bytes after this
 * (or after now, if the link is idle: an idle link earns no credit) and may go when they are
 * through. One deadline for the whole process, so threads share the rate instead of each
 * getting it. */
static long long link_free_at;
static pthread_mutex_t link_lock = PTHREAD_MUTEX_INITIALIZER;

static long long cost_ns(size_t bytes, long long rate) {
    return (long long)((double)bytes * 1e9 / (double)rate);
}

/* Book `bytes` on the link and sleep, outside the lock, until they are through. */
static void wait_for_link(size_t bytes, long long rate) {
    pthread_mutex_lock(&link_lock);
    long long t = now_ns();
    if (link_free_at < t) link_free_at = t;
    link_free_at += cost_ns(bytes, rate);
    long long deadline = link_free_at;
    pthread_mutex_unlock(&link_lock);
    struct timespec ts = {deadline / 1000000000LL, deadline % 1000000000LL};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* Once the real call has returned: move the link's deadline by the time of the bytes that were
 * sent but not booked (or booked but not sent: a short write, EAGAIN), so that what the link is
 * charged for is exactly what went out and a retry is not charged twice. */
static void settle(size_t booked, ssize_t sent, long long rate) {
    double unbooked = (double)(sent > 0 ? (size_t)sent : 0) - (double)booked;
    pthread_mutex_lock(&link_lock);
    link_free_at += (long long)(unbooked * 1e9 / (double)rate);
    pthread_mutex_unlock(&link_lock);
}

/* How many of `bytes` the call will likely send. A blocking socket takes them all. A non-blocking
 * one takes at most what fits in its send buffer: booking the whole request would sleep for
 * bytes the kernel then refuses (a 4 MB send to a 208 KB buffer would sleep 20x too long). */
static size_t likely_sent(int fd, size_t bytes, int flags) {
    int sndbuf = 0;
    socklen_t len = sizeof sndbuf;
    int nonblocking = (flags & MSG_DONTWAIT) || (fcntl(fd, F_GETFL) & O_NONBLOCK);
    if (nonblocking && getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &len) == 0 && sndbuf > 0 &&
        (size_t)sndbuf < bytes)
        return (size_t)sndbuf;
    return bytes;
}

/* ---- SLOWLINK_DEBUG: which calls the traced program makes ----------------------------------- */

enum { W_WRITE, W_WRITEV, W_SEND, W_SENDTO, W_SENDMSG, N_WRAPPERS };
static const char *const wrapper_names[N_WRAPPERS] = {"write", "writev", "send", "sendto",
                                                      "sendmsg"};
static struct {
    unsigned long calls, socket_calls, paced_calls, paced_bytes_sent, short_writes, slept_ms;
} counts[N_WRAPPERS];
static int debug_on; /* read once at load: it only decides what is counted */

#define COUNT(which, field, by) __atomic_add_fetch(&counts[which].field, (by), __ATOMIC_RELAXED)

/* A child forked while another thread held a lock would wait on it forever: start afresh. */
static void unlock_in_child(void) {
    pthread_mutex_init(&config_lock, NULL);
    pthread_mutex_init(&link_lock, NULL);
}

__attribute__((constructor)) static void on_load(void) {
    const char *debug = getenv("SLOWLINK_DEBUG");
    debug_on = debug && strcmp(debug, "1") == 0;
    pthread_atfork(NULL, NULL, unlock_in_child);
}

__attribute__((destructor)) static void print_counts(void) {
    if (!debug_on) return;
    inside_shim = 1;
    for (int i = 0; i < N_WRAPPERS; i++) {
        if (!counts[i].calls) continue;
        fprintf(stderr,
                "slowlink[%d] %-7s calls=%lu to_sockets=%lu paced=%lu paced_bytes_sent=%lu "
                "short_or_eagain=%lu slept_ms=%lu\n",
                (int)getpid(), wrapper_names[i], counts[i].calls, counts[i].socket_calls,
                counts[i].paced_calls, counts[i].paced_bytes_sent, counts[i].short_writes,
                counts[i].slept_ms);
    }
}

/* ---- The wrappers --------------------------------------------------------------------------- */

/* What a paced call booked on the link; rate 0: the call is not paced. */
struct booking {
    long long rate;
    size_t bytes;
};

/* Decide whether a write of `bytes` to fd is paced and if so wait for the link. errno is left
 * as the caller had it. */
static struct booking before_write(int which, int fd, size_t bytes, int flags) {
    int saved_errno = errno;
    struct booking booked = {bytes > 0 ? active_bps() : 0, 0};
    int to_socket = (booked.rate > 0 || debug_on) && is_socket(fd);
    if (debug_on) {
        COUNT(which, calls, 1);
        COUNT(which, socket_calls, to_socket);
    }
    if (booked.rate > 0 && to_socket) {
        long long t = now_ns();
        booked.bytes = likely_sent(fd, bytes, flags);
        wait_for_link(booked.bytes, booked.rate);
        if (debug_on) {
            COUNT(which, paced_calls, 1);
            COUNT(which, slept_ms, (unsigned long)((now_ns() - t) / 1000000));
        }
    } else {
        booked.rate = 0;
    }
    errno = saved_errno;
    return booked;
}

static void after_write(int which, struct booking booked, size_t bytes, ssize_t sent) {
    if (!booked.rate) return;
    int saved_errno = errno;
    if (debug_on) {
        COUNT(which, paced_bytes_sent, sent > 0 ? (unsigned long)sent : 0);
        COUNT(which, short_writes, sent < 0 || (size_t)sent < bytes);
    }
    if (sent < 0 || (size_t)sent != booked.bytes) settle(booked.bytes, sent, booked.rate);
    errno = saved_errno;
}

static size_t iov_bytes(const struct iovec *iov, int n) {
    size_t total = 0;
    for (int i = 0; iov && i < n; i++) total += iov[i].iov_len;
    return total;
}

/* Each wrapper: outside the pacer (a nested call from our own code) go straight to libc. */
#define PACED(which, fd, bytes, flags, call)                             \
    do {                                                                 \
        if (inside_shim) return call;                                    \
        inside_shim = 1;                                                 \
        size_t n_ = (bytes);                                             \
        struct booking booked_ = before_write(which, fd, n_, flags);     \
        ssize_t sent_ = call;                                            \
        after_write(which, booked_, n_, sent_);                          \
        inside_shim = 0;                                                 \
        return sent_;                                                    \
    } while (0)

ssize_t write(int fd, const void *buf, size_t n) {
    PACED(W_WRITE, fd, n, 0, REAL(write)(fd, buf, n));
}

ssize_t writev(int fd, const struct iovec *iov, int iovcnt) {
    PACED(W_WRITEV, fd, iov_bytes(iov, iovcnt), 0, REAL(writev)(fd, iov, iovcnt));
}

ssize_t send(int fd, const void *buf, size_t n, int flags) {
    PACED(W_SEND, fd, n, flags, REAL(send)(fd, buf, n, flags));
}

ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *addr,
               socklen_t addrlen) {
    PACED(W_SENDTO, fd, n, flags, REAL(sendto)(fd, buf, n, flags, addr, addrlen));
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags) {
    PACED(W_SENDMSG, fd, msg ? iov_bytes(msg->msg_iov, (int)msg->msg_iovlen) : 0, flags,
          REAL(sendmsg)(fd, msg, flags));
}
