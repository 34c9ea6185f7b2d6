/* A float32 sum all-reduce between the tensor-parallel ranks of one host through a
 * shared memory segment (kvserve/model/shm_all_reduce.py maps it in every rank).
 *
 * The native decoder all-reduces twice per layer; over gloo each is a loopback TCP
 * round trip through gloo's threads, and on a small machine each wake-up of a thread
 * costs far more than the sum. Here a rank copies its part into its own slot, publishes
 * its sequence number, waits (spinning, then yielding) for every rank's, and sums the
 * slots in rank order, so every rank computes the same bits.
 *
 * Segment: `world` flags of FLAG_STRIDE bytes (a rank's latest sequence number, each
 * on its own cache line), then two sets of `world` slots of `capacity` floats. The sets
 * alternate by sequence number: a rank writes set (seq & 1) only after every rank has
 * published seq - 1, so every rank has finished reading that set's previous use (seq - 2).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "kvserve.h"

#define FLAG_STRIDE 64


static _Atomic int64_t *rank_flag(const ShmAllReduce *c, int r) {
    return (_Atomic int64_t *)(c->base + (int64_t)r * FLAG_STRIDE);
}

static float *rank_slot(const ShmAllReduce *c, int64_t set, int r) {
    return (float *)(c->base + (int64_t)c->world * FLAG_STRIDE) + (set * c->world + r) * c->capacity;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Until rank r has published `seq`: 0, or 1 past the timeout. */
static int wait_for_rank(const ShmAllReduce *c, int r, int64_t seq, int64_t deadline_ns) {
    for (unsigned spins = 0; atomic_load_explicit(rank_flag(c, r), memory_order_acquire) < seq; spins++) {
        if (spins < (1u << 12)) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
            continue;
        }
        /* a rank that is not running needs this core more than the spin does */
        sched_yield();
        if ((spins & 255) == 0 && now_ns() > deadline_ns) return 1;
    }
    return 0;
}

/* buf [count] summed over the ranks, in place (every rank calls it with the same count).
 * Returns 0; 1 when count exceeds the slots; 2 when a rank did not arrive in time. After
 * a failure the segment is out of step: every later call fails with the same code. */
int32_t kvserve_shm_all_reduce(void *ctx, float *buf, int64_t count) {
    ShmAllReduce *c = (ShmAllReduce *)ctx;
    if (c->error) return c->error;
    if (count < 0 || count > c->capacity) return c->error = 1;
    const int64_t seq = ++c->seq, set = seq & 1, deadline_ns = now_ns() + c->timeout_ns;
    memcpy(rank_slot(c, set, c->rank), buf, sizeof(float) * (size_t)count);
    atomic_store_explicit(rank_flag(c, c->rank), seq, memory_order_release);
    for (int r = 0; r < c->world; r++)
        if (r != c->rank && wait_for_rank(c, r, seq, deadline_ns)) return c->error = 2;
    const float *first = rank_slot(c, set, 0);
    for (int64_t i = 0; i < count; i++) buf[i] = first[i];
    for (int r = 1; r < c->world; r++) {
        const float *part = rank_slot(c, set, r);
        for (int64_t i = 0; i < count; i++) buf[i] += part[i];
    }
    return 0;
}
