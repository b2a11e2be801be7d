/* slowlink: an LD_PRELOAD shim that makes one process's network slow, the way a degraded NIC does.
 *
 * It wraps write, writev, send, sendto and sendmsg. In a selected process, once the fault is
 * active, every write to a socket that LEAVES THE NODE first waits for its turn on a virtual link
 * of SLOWLINK_BPS bytes per second shared by all the process's threads; then the real call runs
 * unchanged. Data, return values and errno are never altered: only time passes. Files, pipes,
 * ttys, Unix sockets and TCP sockets whose peer has the node's own address are never paced: a
 * degraded NIC does not slow what stays inside the node (NVLink, shared memory, loopback), and
 * the console and logs stay fast.
 *
 * SLOWLINK_SCOPE=all paces every socket write instead (the shim's first model: a process whose
 * every send is slow, its node's loopback traffic included), and gives no pretend addresses.
 *
 * "Leaves the node" is decided by address: a TCP socket whose peer address differs from its own
 * local address. Between real machines that is exactly the traffic through the NIC. Under
 * `mscale train --local` every pretend node is this machine, so the shim gives each its own
 * loopback address, as a cluster gives each node its own: in a process where MSCALE_LAUNCHER is
 * "local", the pretend node's address is 127.1.0.0 + GROUP_RANK + 1 (GROUP_RANK: the launcher's
 * node index), and in EVERY such process (selected or not) a listening socket bound to a
 * specific IPv4 address on an ephemeral port (gloo's listener) is bound to that address instead,
 * and a TCP socket that connects, unbound, to a loopback address is first bound to it. gloo
 * advertises the address its listener got, so ranks of one pretend node then talk from and to
 * one address, and ranks of two nodes from and to two.
 *
 *   SLOWLINK_MATCH=NAME=VALUE  the process is selected while getenv(NAME) equals VALUE
 *                              (RANK=5: one local rank; SLURMD_NODENAME=node3: one node).
 *                              Unset: nothing is selected and the shim does nothing.
 *   SLOWLINK_BPS=N             the link's rate in bytes per second.
 *   SLOWLINK_ONSET_FILE=PATH   optional: pacing starts once PATH exists, and then stays on.
 *   SLOWLINK_SCOPE=node|all    node (default): only writes that leave the node are paced;
 *                              all: every socket write is.
 *   SLOWLINK_DEBUG=1           print per-call counts to stderr when the process exits
 *                              (to_sockets: all socket writes; paced: those that left the node).
 *
 * Everything is read with getenv at call time (cached for at most REFRESH_NS), because Python
 * launchers set RANK with os.environ after the process started, and that calls putenv.
 *
 * Build: gcc -O2 -shared -fPIC -Wall -o slowlink.so slowlink.c -ldl -lpthread
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
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
typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
typedef int (*connect_fn)(int, const struct sockaddr *, socklen_t);

static void *real(const char *name, void **slot) {
    void *fn = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!fn) {
        fn = dlsym(RTLD_NEXT, name);
        __atomic_store_n(slot, fn, __ATOMIC_RELEASE);
    }
    return fn;
}
static void *real_write_p, *real_writev_p, *real_send_p, *real_sendto_p, *real_sendmsg_p;
static void *real_bind_p, *real_connect_p;
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

/* ---- Does a write leave the node? ---------------------------------------------------------- */

static int same_address(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family) return 0;
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr ==
               ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    if (a->ss_family == AF_INET6)
        return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                      &((const struct sockaddr_in6 *)b)->sin6_addr, sizeof(struct in6_addr)) == 0;
    return 1; /* a Unix socket: both ends are on this node */
}

/* Whether fd is a connected socket whose peer's address is not its own: traffic through the NIC.
 * Asked per call (two system calls) rather than cached per fd: an fd number is reused once
 * closed, and a cache would have to follow close, dup2 and fork to stay right. */
static int leaves_node(int fd) {
    struct sockaddr_storage self, peer;
    socklen_t self_len = sizeof self, peer_len = sizeof peer;
    if (getsockname(fd, (struct sockaddr *)&self, &self_len) != 0) return 0;
    if (getpeername(fd, (struct sockaddr *)&peer, &peer_len) != 0) return 0; /* unconnected */
    return !same_address(&self, &peer);
}

/* ---- Pretend nodes under `mscale train --local`: one loopback address each ---------------- */

/* Whether only the writes that leave the node are paced (SLOWLINK_SCOPE, read at call time). */
static int node_scope(void) {
    const char *scope = getenv("SLOWLINK_SCOPE");
    return !scope || strcmp(scope, "all") != 0;
}

/* This process's pretend node address (network order), or 0 when it is not a --local worker
 * or the scope is every socket. */
static in_addr_t pretend_address(void) {
    if (!node_scope()) return 0;
    const char *launcher = getenv("MSCALE_LAUNCHER");
    const char *node = getenv("GROUP_RANK");
    if (!launcher || strcmp(launcher, "local") != 0 || !node || !*node) return 0;
    char *end;
    long index = strtol(node, &end, 10);
    if (*end || index < 0 || index >= 0xfffffe) return 0;
    return htonl((in_addr_t)(0x7f010000 + index + 1)); /* 127.1.0.1 for node index 0 */
}

static int is_loopback(in_addr_t a) {
    return (ntohl(a) >> 24) == 127;
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

/* ---- bind and connect: the pretend node's address ---------------------------------------- */

/* A listener on a specific IPv4 address and an ephemeral port (gloo's) gets the pretend node's
 * address instead; anything else (a wildcard bind, a fixed port such as the rendezvous store's)
 * is left as asked. */
int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    in_addr_t own = inside_shim ? 0 : pretend_address();
    if (own && addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
        if (in->sin_port == 0 && in->sin_addr.s_addr != htonl(INADDR_ANY)) {
            struct sockaddr_in moved = *in;
            moved.sin_addr.s_addr = own;
            return REAL(bind)(fd, (const struct sockaddr *)&moved, sizeof moved);
        }
    }
    return REAL(bind)(fd, addr, len);
}

/* A connection to a loopback address leaves from the pretend node's address, so that its peer
 * sees which node it came from (the kernel would pick 127.0.0.1 for every node). A socket the
 * caller bound itself keeps its address; if the bind fails the connection goes on unbound. */
int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    in_addr_t own = inside_shim ? 0 : pretend_address();
    if (own && addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in) &&
        is_loopback(((const struct sockaddr_in *)addr)->sin_addr.s_addr)) {
        struct sockaddr_in self;
        socklen_t self_len = sizeof self;
        int saved_errno = errno;
        if (getsockname(fd, (struct sockaddr *)&self, &self_len) == 0 &&
            self.sin_family == AF_INET && self.sin_port == 0) {
            struct sockaddr_in from = {.sin_family = AF_INET, .sin_port = 0};
            from.sin_addr.s_addr = own;
            REAL(bind)(fd, (const struct sockaddr *)&from, sizeof from);
        }
        errno = saved_errno;
    }
    return REAL(connect)(fd, addr, len);
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
    if (booked.rate > 0 && to_socket && (!node_scope() || leaves_node(fd))) {
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
