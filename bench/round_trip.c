/* Nanoseconds for one cache line to go from a thread on one CPU to a thread on another and back, averaged over
 * `trips`: tens where the two CPUs share a last-level cache, several times that where they do not (another CCD
 * of an AMD EPYC, another socket). Returns -1 where a thread cannot be made or pinned to its CPU. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define ABANDONED -2

static _Alignas(64) atomic_long turn;

typedef struct {
    int cpu, parity;
    long trips;
} player;

/* takes the turns of its parity: waits for the line to hold its turn, then hands the next one over */
static void *play(void *argument)
{
    const player *me = argument;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(me->cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set)) {
        atomic_store(&turn, ABANDONED);
        return (void *)1;
    }
    for (long t = me->parity; t < 2 * me->trips; t += 2) {
        long now;
        while ((now = atomic_load_explicit(&turn, memory_order_acquire)) != t)
            if (now == ABANDONED)
                return (void *)1;
        atomic_store_explicit(&turn, t + 1, memory_order_release);
    }
    return NULL;
}

double tandem_round_trip_ns(int first_cpu, int second_cpu, long trips)
{
    player players[2] = {{first_cpu, 0, trips}, {second_cpu, 1, trips}};
    pthread_t threads[2];
    void *failed[2] = {(void *)1, (void *)1};
    struct timespec start, end;
    atomic_store(&turn, -1);
    int made = 0;
    while (made < 2 && !pthread_create(&threads[made], NULL, play, &players[made]))
        made++;
    clock_gettime(CLOCK_MONOTONIC, &start);
    long expected = -1;
    atomic_compare_exchange_strong(&turn, &expected, made == 2 ? 0 : ABANDONED);
    for (int i = 0; i < made; i++)
        pthread_join(threads[i], &failed[i]);
    clock_gettime(CLOCK_MONOTONIC, &end);
    if (made < 2 || failed[0] || failed[1])
        return -1;
    return ((end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec)) / trips;
}
