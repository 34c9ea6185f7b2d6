/* Where the native decoder's time goes, per thread and phase (csrc/decoder/fused_decoder.c).
 *
 * Off by default: each mark is then one predictable branch. `kvserve bench profile`
 * switches it on (kvserve_decoder_profile_enable) for a few extra steps and reads the
 * sums back (kvserve_decoder_profile_read). A mark charges the time since the
 * thread's previous mark to a phase; waiting at a barrier is a phase of its own, so
 * the matmul phases hold only the thread's own rows and one thread's sums add up
 * to its wall time inside the call.
 */
#ifndef KVSERVE_PHASE_TIMER_H
#define KVSERVE_PHASE_TIMER_H

#include <stdint.h>
#include <string.h>
#include <time.h>

enum {
    PHASE_NORMS,    /* norms, residual adds, the gate activation, copies */
    PHASE_QUANTIZE, /* rounding a matmul's input (int8/int16 blocks, bfloat16, the panel's) */
    PHASE_QKV,
    PHASE_ATTENTION, /* Q/K norms, RoPE, K/V write, paged attention */
    PHASE_O,
    PHASE_GATE_UP,
    PHASE_DOWN,
    PHASE_HEAD,
    PHASE_WAIT,       /* at a barrier */
    PHASE_ALL_REDUCE, /* thread 0 in the tensor-parallel all-reduce (the others wait at a barrier) */
    PHASE_COUNT
};

#define PHASE_MAX_THREADS 64

typedef struct {
    int on;
    double last, sum[PHASE_COUNT];
} PhaseTimer;

static int phase_enabled;
static int64_t phase_calls;
static double phase_totals[PHASE_MAX_THREADS][PHASE_COUNT];

static inline double phase_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline void phase_start(PhaseTimer *t) {
    memset(t, 0, sizeof(*t));
    t->on = __atomic_load_n(&phase_enabled, __ATOMIC_RELAXED);
    if (t->on) t->last = phase_now();
}

static inline void phase_mark(PhaseTimer *t, int phase) {
    if (!t->on) return;
    double now = phase_now();
    t->sum[phase] += now - t->last;
    t->last = now;
}

/* Adds thread tid's sums to the totals (each thread its own row: no race). */
static inline void phase_finish(const PhaseTimer *t, int tid) {
    if (!t->on || tid >= PHASE_MAX_THREADS) return;
    for (int k = 0; k < PHASE_COUNT; k++) phase_totals[tid][k] += t->sum[k];
    if (tid == 0) phase_calls++;
}

/* Switches the timer on or off (not while a call runs) and clears the totals. */
void kvserve_decoder_profile_enable(int on) {
    memset(phase_totals, 0, sizeof(phase_totals));
    phase_calls = 0;
    __atomic_store_n(&phase_enabled, on, __ATOMIC_RELAXED);
}

/* Seconds per thread and phase since the timer was switched on: out [max_threads, PHASE_COUNT].
 * Returns the number of calls timed. */
int64_t kvserve_decoder_profile_read(double *out, int max_threads) {
    int n = max_threads < PHASE_MAX_THREADS ? max_threads : PHASE_MAX_THREADS;
    memcpy(out, phase_totals, sizeof(double) * (size_t)(n * PHASE_COUNT));
    return phase_calls;
}

#endif
