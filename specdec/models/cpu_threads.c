/* The worker threads of specdec's CPU kernels, made for a CPU shared with other processes.
 *
 * OpenMP's parallel loops end at a barrier that every thread of the team must reach, so a worker the
 * scheduler has not run yet holds the whole call up for a time slice. A decode step makes ~120 such
 * calls; on the 2-core CI machine under a load of 5, a decode forward of the default model took
 * 1.6 s on 2 OpenMP threads against 0.14 s on one. Here the caller takes tasks too, from one shared
 * counter, and then waits only for tasks other threads have already taken: a worker that wakes late
 * finds nothing left and goes back to waiting. Which thread runs a task never changes what the task
 * computes (each task writes its own outputs), so results do not depend on the threads either.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_WORKERS 63
#define SPINS 100    /* polls with a pause, then... */
#define YIELDS 2000  /* ...polls that give the core away (about a millisecond) before an idle worker sleeps */

typedef void (*task_fn)(void *ctx, int task);

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; /* the job's fields, starting and sleeping workers */
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t calling = PTHREAD_MUTEX_INITIALIZER; /* one job at a time; a concurrent caller runs alone */
static int workers, sleepers;
static task_fn job_fn;
static void *job_ctx;
static int job_tasks, job_helpers;
static _Atomic uint32_t job;    /* id of the latest job */
static _Atomic uint64_t claim;  /* (job id << 32) | next task of that job */
static _Atomic int pending;     /* tasks of the latest job not finished yet */

/* Wait a little, the i-th time in a row: first on the core, then letting other threads (the one we
 * wait for, or other processes on a busy machine) have it. */
static inline void relax(int i) {
    if (i >= SPINS) {
        sched_yield();
        return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Take and run tasks of job `id` until none is left (or a newer job has replaced it). */
static void run_tasks(uint32_t id, task_fn fn, void *ctx, int tasks) {
    uint64_t c = atomic_load(&claim);
    while ((uint32_t)(c >> 32) == id && (int)(uint32_t)c < tasks) {
        if (atomic_compare_exchange_weak(&claim, &c, c + 1)) {
            fn(ctx, (int)(uint32_t)c);
            atomic_fetch_sub(&pending, 1);
            c = atomic_load(&claim);
        }
    }
}

static void *work(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&job);
    for (;;) {
        for (int i = 0; i < SPINS + YIELDS && atomic_load(&job) == seen; i++) relax(i);
        pthread_mutex_lock(&lock);
        while (atomic_load(&job) == seen) {
            sleepers++;
            pthread_cond_wait(&wake, &lock);
            sleepers--;
        }
        seen = atomic_load(&job);
        const task_fn fn = job_fn;
        void *const ctx = job_ctx;
        const int tasks = job_tasks, helpers = job_helpers;
        pthread_mutex_unlock(&lock);
        if (index < helpers) run_tasks(seen, fn, ctx, tasks);
    }
    return NULL;
}

/* A forked child has none of the parent's workers, and the locks may have been held by one. */
static void forget_workers(void) {
    pthread_mutex_init(&lock, NULL);
    pthread_mutex_init(&calling, NULL);
    pthread_cond_init(&wake, NULL);
    workers = sleepers = 0;
}

static void watch_forks(void) { pthread_atfork(NULL, NULL, forget_workers); }

/* fn(ctx, t) for t = 0 .. tasks-1, on up to `threads` threads (the caller's included). */
void specdec_parallel(int tasks, int threads, task_fn fn, void *ctx) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, watch_forks);
    threads = threads > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : threads;
    if (threads <= 1 || tasks <= 1 || pthread_mutex_trylock(&calling) != 0) {
        for (int t = 0; t < tasks; t++) fn(ctx, t);
        return;
    }
    pthread_mutex_lock(&lock);
    for (pthread_t thread; workers < threads - 1 && pthread_create(&thread, NULL, work, (void *)(intptr_t)workers) == 0; workers++)
        pthread_detach(thread);
    const uint32_t id = atomic_load(&job) + 1;
    job_fn = fn, job_ctx = ctx, job_tasks = tasks, job_helpers = threads - 1;
    atomic_store(&pending, tasks);
    atomic_store(&claim, (uint64_t)id << 32);
    atomic_store(&job, id);
    if (sleepers) pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
    run_tasks(id, fn, ctx, tasks);
    for (int i = 0; atomic_load(&pending) > 0; i++) relax(i);
    pthread_mutex_unlock(&calling);
}

/* A buffer of at least n floats private to the calling thread, kept for its next calls. */
float *specdec_scratch(size_t n) {
    static _Thread_local float *buffer;
    static _Thread_local size_t size;
    if (n > size) {
        free(buffer);
        buffer = malloc(n * sizeof(float));
        size = buffer ? n : 0;
        if (!buffer) abort();
    }
    return buffer;
}
