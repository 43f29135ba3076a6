/* How the threads of one parallel region (the native decode step) meet and share work without libgomp's own
 * barriers, compiled with the other kernel sources into one library:
 *   sy_team_bytes / sy_team_reset   the shared state: size, and set it up before the region starts
 *   sy_team_barrier                 every thread of the region waits here until all nt have arrived
 *   sy_team_next                    the next unit of a dynamically shared loop (an atomic counter)
 *   sy_team_rewind                  that counter back to 0 (between two barriers, by one thread)
 *
 * Why not `#pragma omp barrier`: libgomp spins only ~100 times at a barrier, then sleeps on a futex, whenever it
 * counts more OpenMP threads in the process than cores -- and every thread that ever started a parallel region
 * keeps a pool that counts. torch and our kernels share that runtime, so a server whose event loop or loader
 * thread once ran a parallel op put every barrier of the step through a futex wake-up: SmolLM2 int8 batch 1
 * decoded at 8.3 ms per step on an engine thread beside the main thread's pool and 4.7 ms on the main thread
 * (2 cores, 330 barriers per step). These barriers spin (pause) for a bounded time, then yield the core, and
 * never sleep: a step's barriers are microseconds apart, and a yielding thread lets a preempted team mate or
 * the server's event loop run. */
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#include "switchyard_kernels.h" /* the declared interface: prototypes, shared structs and constants */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* pauses before a waiting thread starts yielding its core (~0.1 ms on current x86 cores) */
#define SPINS_BEFORE_YIELD 4096

typedef struct {
    _Alignas(64) atomic_int arrived; /* threads at the current barrier */
    _Alignas(64) atomic_int phase;   /* barriers completed: waiters watch it change */
    _Alignas(64) atomic_int next;    /* the dynamic loop's next unit */
} sy_team;

int64_t sy_team_bytes(void) { return (int64_t)sizeof(sy_team) + 64; /* + alignment of the caller's buffer */ }

/* The team state inside `buf` (sy_team_bytes() bytes), aligned. */
static inline sy_team *team_at(void *buf) { return (sy_team *)(((uintptr_t)buf + 63) & ~(uintptr_t)63); }

void *sy_team_reset(void *buf) {
    sy_team *t = team_at(buf);
    atomic_store_explicit(&t->arrived, 0, memory_order_relaxed);
    atomic_store_explicit(&t->phase, 0, memory_order_relaxed);
    atomic_store_explicit(&t->next, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    return t;
}

/* Sense by phase: a thread reads the phase before it arrives; the last to arrive resets the count and then
 * advances the phase (release), so what every thread wrote before the barrier is visible after it (acquire). */
void sy_team_barrier(void *team, int nt) {
    if (nt <= 1) return;
    sy_team *t = (sy_team *)team;
    const int phase = atomic_load_explicit(&t->phase, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&t->arrived, 1, memory_order_acq_rel) == nt - 1) {
        atomic_store_explicit(&t->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&t->phase, phase + 1, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&t->phase, memory_order_acquire) == phase;) {
        if (spins < SPINS_BEFORE_YIELD) {
            spins++;
            CPU_RELAX();
        } else {
            sched_yield();
        }
    }
}

int sy_team_next(void *team) { return atomic_fetch_add_explicit(&((sy_team *)team)->next, 1, memory_order_relaxed); }

void sy_team_rewind(void *team) { atomic_store_explicit(&((sy_team *)team)->next, 0, memory_order_relaxed); }
