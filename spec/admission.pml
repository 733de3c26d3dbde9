/*
 * Admission with aging, as the `priority` policy of cadence.statemachine does it.
 *
 * One seat: each scheduling round the scheduler admits the waiting request with
 * the smallest key  priority * AGING + arrival  (ties: the earlier arrival),
 * serves it, and it leaves. Time is the round counter; arrivals are kept
 * relative to now as ages (rounds waited), capped where the cap can no longer
 * change a comparison: an age of MAXAGE already beats any newer request.
 *
 * Two clients at priority 0 re-submit as soon as they are served, so a
 * priority-0 request is always waiting: the adversary of a priority-1 request.
 * Property: under weak fairness, every waiting request is eventually served.
 */

#define N       3
#define AGING   2                  /* rounds per priority level (aging_steps) */
#define MAXAGE  (AGING + 1)        /* ages beyond this change no comparison */
#define NONE    255

byte prio[N];
byte age[N];
bool waiting[N];

inline key(i, k) {
    k = prio[i] * AGING + MAXAGE - age[i]
}

active [N] proctype Client() {
    byte me = _pid;
    do
    :: atomic { !waiting[me] -> waiting[me] = true; age[me] = 0 }
    od
}

active proctype Scheduler() {
    byte i, best, kb, ki;
    do
    :: atomic {
        best = NONE;
        for (i : 0 .. N - 1) {
            if
            :: waiting[i] ->
                key(i, ki);
                if
                :: best == NONE -> best = i; kb = ki
                :: best != NONE && (ki < kb || (ki == kb && age[i] > age[best])) ->
                    best = i; kb = ki
                :: else -> skip
                fi
            :: else -> skip
            fi
        }
        if
        :: best != NONE ->
            waiting[best] = false;
            for (i : 0 .. N - 1) {
                if
                :: waiting[i] && age[i] < MAXAGE -> age[i]++
                :: else -> skip
                fi
            }
        :: else -> skip
        fi
       }
    od
}

init {
    prio[0] = 0; prio[1] = 0; prio[2] = 1
}

ltl low_priority_served { [] (waiting[2] -> <> !waiting[2]) }
