/* repack._blending: Megatron's blending index, the same bytes, without the samples x datasets loop.
 *
 * megatron-core's helpers.cpp fills BlendedDataset's dataset_index (int16) and
 * dataset_sample_index (int64): for every sample t it computes, for every dataset i,
 *
 *     error_i = weights[i] * max(t, 1.0) - (double)count[i]        (two roundings, no FMA)
 *
 * and takes the first dataset with the largest error (ties go to the lower index). That is
 * samples x datasets: 9 s for 10^6 samples of 10,000 datasets, 21 minutes for 10^8.
 * build_exhaustive_blending_indices does the same over the datasets not yet spent, with
 * weights sizes[i] / total, until every dataset has given sizes[i] samples.
 *
 * Here the datasets are the leaves of a tournament tree (a "kinetic tournament"): every node
 * holds the winner below it at the current step, decided with Megatron's own double expression
 * and its tie rule (equal errors: the lower dataset wins). Between draws an error is a line in
 * t, so a node's decision holds until the loser, if it grows faster, can catch up. That moment
 * is bounded conservatively: every computed error is within E of the exact line (E, below,
 * bounds both roundings for every step of the build), so while the exact gap stays above 2E
 * the computed comparison cannot change. A node is decided again, with the exact expression,
 * at the first step where that is no longer certain (and at every step while two errors are
 * within a few E of each other, as for weights whose products round to the same double); a
 * node whose two winners have the same weight never flips (the same product, minus different
 * integers, keeps its order). Nodes wait for that step in a timing wheel; a step decides them
 * and, above each, the nodes whose winner changed, then the path of the dataset just drawn:
 * O(log datasets) a sample instead of O(datasets). The leaves are the datasets in order of
 * weight: neighbours of like weight seldom overtake one another between draws, which leaves
 * the lower nodes nearly nothing to decide again. The path of a draw is decided without a
 * branch on the data (which side wins, whether a decision holds: coin tosses for the
 * processor's predictor), and with the processor's reciprocal estimate in place of a
 * division. Together: 225 ns a sample at 10,000 Dirichlet-weighted datasets, from 510.
 *
 * The bytes are Megatron's whatever the weights: no decision is taken on an estimate, only the
 * moment of re-deciding. Weights that are not finite go through Megatron's plain loop.
 * repack/model/blending.py holds the entry points (argument checks, the Python path).
 *
 * Built with -ffp-contract=off (setup.py): a fused multiply-add would round once where
 * Megatron's x86-64 build rounds twice.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NEVER INT64_MAX
#define DUE (-1) /* until of a node found due, in refresh() */
#define LANES 64 /* more than the levels of any tree */
/* Up to this many datasets Megatron's plain loop is the faster (measured: the tree costs about
 * 150 ns a sample from 150 datasets to 250, the loop 0.8 ns a dataset) */
#define PLAIN_DATASETS 160
#ifndef FAN
#define FAN 16 /* children of a node (the root's: as few as will do), even */
#endif

/* Two doubles at a time: SSE2 where there is SSE2 (every x86-64), else the same operations one
 * double after the other. */
#if (defined(__SSE2__) || defined(_M_X64)) && !defined(BLEND_PORTABLE)
#define BLEND_SSE2 1
#include <emmintrin.h>
typedef __m128d pair_t;
#define PAIR_LOAD(p) _mm_loadu_pd(p)
#define PAIR_STORE(p, a) _mm_storeu_pd(p, a)
#define PAIR_SET(x) _mm_set1_pd(x)
#define PAIR_PACK(a, b) _mm_set_pd(b, a)
#define PAIR_MUL(a, b) _mm_mul_pd(a, b)
#define PAIR_SUB(a, b) _mm_sub_pd(a, b)
#define PAIR_DIV(a, b) _mm_div_pd(a, b)
#define PAIR_MAX(a, b) _mm_max_pd(a, b) /* a > b ? a : b, lane by lane (no NaN here) */
#define PAIR_MIN(a, b) _mm_min_pd(a, b)
#define PAIR_EQ(a, b) _mm_cmpeq_pd(a, b)
#define PAIR_GT(a, b) _mm_cmpgt_pd(a, b)
#define PAIR_AND(a, b) _mm_and_pd(a, b)
#define PAIR_OR(a, b) _mm_or_pd(a, b)
#define PAIR_ANDNOT(a, b) _mm_andnot_pd(a, b) /* ~a & b */
#define PAIR_SWAP(a) _mm_shuffle_pd(a, a, 1)
#define PAIR_FIRST(a) _mm_cvtsd_f64(a)
#define PAIR_MASK(a) _mm_movemask_pd(a) /* bit i: lane i's comparison held */
#else
typedef struct {
    double x[2];
} pair_t;
static inline pair_t
pair_of(double a, double b)
{
    pair_t r = {{a, b}};
    return r;
}
static inline double
as_double(uint64_t bits)
{
    double x;
    memcpy(&x, &bits, 8);
    return x;
}
static inline uint64_t
as_bits(double x)
{
    uint64_t bits;
    memcpy(&bits, &x, 8);
    return bits;
}
#define PAIR_LOAD(p) pair_of((p)[0], (p)[1])
#define PAIR_STORE(p, a) ((p)[0] = (a).x[0], (p)[1] = (a).x[1])
#define PAIR_SET(v) pair_of(v, v)
#define PAIR_PACK(a, b) pair_of(a, b)
#define PAIR_LANES(expr_a, expr_b) pair_of(expr_a, expr_b)
#define PAIR_MUL(a, b) pair_of((a).x[0] * (b).x[0], (a).x[1] * (b).x[1])
#define PAIR_SUB(a, b) pair_of((a).x[0] - (b).x[0], (a).x[1] - (b).x[1])
#define PAIR_DIV(a, b) pair_of((a).x[0] / (b).x[0], (a).x[1] / (b).x[1])
#define PAIR_MAX(a, b)                                                                         \
    pair_of((a).x[0] > (b).x[0] ? (a).x[0] : (b).x[0], (a).x[1] > (b).x[1] ? (a).x[1] : (b).x[1])
#define PAIR_MIN(a, b)                                                                         \
    pair_of((a).x[0] < (b).x[0] ? (a).x[0] : (b).x[0], (a).x[1] < (b).x[1] ? (a).x[1] : (b).x[1])
#define PAIR_TEST(c) as_double((c) ? ~(uint64_t)0 : 0)
#define PAIR_EQ(a, b) pair_of(PAIR_TEST((a).x[0] == (b).x[0]), PAIR_TEST((a).x[1] == (b).x[1]))
#define PAIR_GT(a, b) pair_of(PAIR_TEST((a).x[0] > (b).x[0]), PAIR_TEST((a).x[1] > (b).x[1]))
#define PAIR_BITS(a, b, op)                                                                    \
    pair_of(as_double(as_bits((a).x[0]) op as_bits((b).x[0])),                                 \
            as_double(as_bits((a).x[1]) op as_bits((b).x[1])))
#define PAIR_AND(a, b) PAIR_BITS(a, b, &)
#define PAIR_OR(a, b) PAIR_BITS(a, b, |)
#define PAIR_ANDNOT(a, b)                                                                      \
    pair_of(as_double(~as_bits((a).x[0]) & as_bits((b).x[0])),                                 \
            as_double(~as_bits((a).x[1]) & as_bits((b).x[1])))
#define PAIR_SWAP(a) pair_of((a).x[1], (a).x[0])
#define PAIR_FIRST(a) ((a).x[0])
#define PAIR_MASK(a) ((int)(as_bits((a).x[0]) >> 63) | (int)(as_bits((a).x[1]) >> 63) << 1)
#endif

#if defined(__GNUC__) || defined(__clang__)
#define LOWEST_BIT(x) __builtin_ctz(x)
#else
static inline int
LOWEST_BIT(unsigned x)
{
    int i = 0;
    while (!(x & 1u))
        x >>= 1, i++;
    return i;
}
#endif

/* The tree, level by level: level 0 is the root, level `levels` the leaves; a node of level l
 * has fan[l] children, consecutive in level l + 1. Every place (a node or a leaf, numbered
 * level after level, from base[l]) holds the line of its winner: its weight, its count, its
 * dataset and its leaf; the children of a node are read two at a time. */
typedef struct {
    double *w;      /* weight; a spent dataset or padding: 0 */
    double *c;      /* count, as Megatron casts it to double; spent or padding: +inf */
    int64_t *id;    /* the dataset (padding: INT64_MAX), which decides a tie: the lower wins */
    int64_t *leaf;  /* the leaf (datasets by weight, padding up to the last) */
    int64_t *until; /* per node: the first step at which its decision may no longer hold
                     * (NEVER: it holds until its inputs change) */
    unsigned char *level; /* per node: its level */
    int64_t *slot;  /* the wheel: per slot u, its last entry (-1: none); then LANES more,
                     * written and never read (see schedule) */
    int64_t *entry; /* the entries: a node listed in a slot, for a step u, u + wheel, ... */
    int64_t *older; /* the slot's entry before this one */
    int64_t used;   /* entries in use */
    int64_t room;   /* entries there is room for */
    int64_t wheel;  /* a power of two */
    int64_t nodes;  /* places above the leaves: base[levels] */
    int levels;
    int64_t fan[LANES];
    int64_t width[LANES + 1]; /* places of each level */
    int64_t base[LANES + 1];  /* the first place of each level (even) */
    double margin;            /* E: the most a computed error differs from the exact line */
} tournament_t;

static inline double
step_value(int64_t t)
{
    return t > 1 ? (double)t : 1.0; /* Megatron's std::max(static_cast<double>(t), 1.0) */
}

/* c ? a : b, which compilers make a conditional move for integers: no branch (whether a node's
 * decision holds is a coin toss for the predictor) */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 9
#define COIN_TOSS(c) __builtin_expect_with_probability((c) != 0, 1, 0.5)
#elif defined(__clang__)
#define COIN_TOSS(c) __builtin_unpredictable((c) != 0)
#else
#define COIN_TOSS(c) ((c) != 0)
#endif

static inline int64_t
pick(int c, int64_t a, int64_t b)
{
    return COIN_TOSS(c) ? a : b;
}

/* Node k's decision holds until step `until`: list it in that step's slot of the wheel (a slot
 * holds the steps u, u + wheel, u + 2 wheel...: a later one waits its turn). An entry is never
 * taken off: `until` says whether it still counts, and the slot drops those that do not when
 * its step comes. A decision that holds until its inputs change takes no entry: without a
 * branch on it (a coin toss), it writes one that is not kept, into a slot of its own lane past
 * the wheel's, never read. */
static void compact(tournament_t *tour);

static inline void
schedule(tournament_t *tour, int64_t k, int64_t until, int64_t lane)
{
    int holds = until == NEVER;
    tour->until[k] = until;
    int64_t u = pick(holds, tour->wheel + lane, until & (tour->wheel - 1)), e = tour->used;
    tour->entry[e] = k;
    tour->older[e] = tour->slot[u];
    tour->slot[u] = e;
    tour->used = e + 1;
    if (tour->used == tour->room)
        compact(tour);
}

/* The entries are full: list the nodes again, one entry each. */
static void
compact(tournament_t *tour)
{
    for (int64_t u = 0; u < tour->wheel; u++)
        tour->slot[u] = -1;
    tour->used = 0;
    for (int64_t k = 0; k < tour->nodes; k++)
        if (tour->until[k] != NEVER)
            schedule(tour, k, tour->until[k], 0);
}

/* a[k] = x, written with its neighbour as the pair that the parent reads: a pair read where
 * one half of it was just written waits for the write to reach the cache (the processor
 * forwards a store to a load of the same place and size only) */
#ifdef BLEND_SSE2
static const uint64_t lane_bits[2][2] = {{~(uint64_t)0, 0}, {0, ~(uint64_t)0}};
#endif

static inline void
store_lane(double *a, int64_t k, double x)
{
#ifdef BLEND_SSE2
    double *p = a + (k & ~(int64_t)1);
    __m128d m = _mm_loadu_pd((const double *)lane_bits[k & 1]);
    _mm_storeu_pd(p, _mm_or_pd(_mm_and_pd(m, _mm_set1_pd(x)), _mm_andnot_pd(m, _mm_loadu_pd(p))));
#else
    a[k] = x;
#endif
}

/* The children of a node, as read: their errors at step value s, the first of the largest
 * (the lowest dataset among equal errors). */
typedef struct {
    pair_t error[FAN / 2];
    pair_t top; /* the largest error, in both lanes */
    int win;    /* the child that wins */
} look_t;

static inline __attribute__((always_inline)) void
look(const tournament_t *tour, int64_t first, double s, int pairs, look_t *at)
{
    const double *w = tour->w + first, *c = tour->c + first;
    pair_t vs = PAIR_SET(s);
    for (int p = 0; p < pairs; p++)
        at->error[p] = PAIR_SUB(PAIR_MUL(PAIR_LOAD(w + 2 * p), vs), PAIR_LOAD(c + 2 * p));
    /* the largest, as a tree of pairs (a chain of them is as long as the children) */
    pair_t top[FAN / 2];
    int count = pairs;
    for (int p = 0; p < pairs; p++)
        top[p] = at->error[p];
    while (count > 1) {
        for (int p = 0; p < count / 2; p++)
            top[p] = PAIR_MAX(top[2 * p], top[2 * p + 1]);
        if (count & 1)
            top[count / 2] = top[count - 1];
        count = (count + 1) / 2;
    }
    at->top = PAIR_MAX(top[0], PAIR_SWAP(top[0]));
    unsigned best = 0;
    for (int p = 0; p < pairs; p++)
        best |= (unsigned)PAIR_MASK(PAIR_EQ(at->error[p], at->top)) << (2 * p);
    int win = LOWEST_BIT(best);
    if (best & (best - 1)) { /* equal errors: the lowest dataset */
        for (unsigned rest = best & (best - 1); rest; rest &= rest - 1) {
            int i = LOWEST_BIT(rest);
            if (tour->id[first + i] < tour->id[first + win])
                win = i;
        }
    }
    at->win = win;
}

/* How many more steps a decision holds against losers whose error is `below` less than
 * top - 6E (the winner's error less 6E: below = top - 6E - error, rounded twice, within E/4 of
 * the exact gap less 6E) and whose weight exceeds the winner's by `faster`, lane by lane:
 *   faster > 0: below / faster, or none if below <= 0 (the exact gap stays above 2E: it
 *   loses at most faster a step);
 *   faster < 0: for ever (+inf) if below > 0 (the loser only falls behind), else none;
 *   faster == 0 (the same weight; the winner itself): for ever (the same product, minus
 *   counts that keep their order).
 * One division does the first two: below / max(faster, +0) is +inf, -inf or NaN where
 * faster <= 0; the maximum with 0 (+inf where faster == 0) makes the last two none (NaN: maxpd
 * returns its second operand). */
static inline pair_t
holds_for(pair_t below, pair_t faster)
{
    pair_t zero = PAIR_SET(0.0);
    pair_t x = PAIR_DIV(below, PAIR_MAX(faster, zero));
    return PAIR_MAX(x, PAIR_AND(PAIR_EQ(faster, zero), PAIR_SET(INFINITY)));
}

/* The decision holds for `steps` (a pair) more steps from step t: the first step at which it
 * may no longer hold. The smaller lane, a little less: the division rounds (its relative
 * error, 2^-53, is far within the slack of E the bound keeps). */
static inline int64_t
until_after(pair_t steps, int64_t t)
{
    double more = PAIR_FIRST(PAIR_MIN(steps, PAIR_SWAP(steps))) * (1.0 - 1.0 / 1024);
    return more >= 9.0e18 ? NEVER : t + 1 + (int64_t)more;
}

/* The certificate of a node whose children were read into `at` and whose winner has weight
 * `ww` and error `top`: the fewest steps over the children. */
static inline __attribute__((always_inline)) pair_t
children_hold(const tournament_t *tour, int64_t first, int pairs, const look_t *at, double ww,
              double top)
{
    pair_t vw = PAIR_SET(ww), steps = PAIR_SET(INFINITY);
    pair_t floor = PAIR_SET(top - 6.0 * tour->margin);
    for (int p = 0; p < pairs; p++) {
        pair_t below = PAIR_SUB(floor, at->error[p]);
        pair_t faster = PAIR_SUB(PAIR_LOAD(tour->w + first + 2 * p), vw);
        steps = PAIR_MIN(steps, holds_for(below, faster));
    }
    return steps;
}

/* Decide node j of level l at step t (value s) from its children's winners; returns whether
 * its winner changed. */
static inline __attribute__((always_inline)) int
decide_pairs(tournament_t *tour, int l, int64_t j, double s, int64_t t, int64_t lane, int pairs)
{
    int64_t k = tour->base[l] + j, first = tour->base[l + 1] + j * (2 * pairs);
    look_t at;
    look(tour, first, s, pairs, &at);
    int64_t win = first + at.win;
    double ww = tour->w[win];
    int64_t until = until_after(children_hold(tour, first, pairs, &at, ww, PAIR_FIRST(at.top)), t);
    int64_t was = tour->leaf[k];
    store_lane(tour->w, k, ww);
    store_lane(tour->c, k, tour->c[win]);
    tour->id[k] = tour->id[win];
    tour->leaf[k] = tour->leaf[win];
    schedule(tour, k, until, lane);
    return tour->leaf[k] != was;
}

/* decide_pairs() for node j of level l, its number of children made a constant (unrolled) */
static int
decide(tournament_t *tour, int l, int64_t j, double s, int64_t t, int64_t lane)
{
    switch (tour->fan[l]) {
#define DECIDE_CASE(pairs)                                                                     \
    case 2 * (pairs):                                                                          \
        return decide_pairs(tour, l, j, s, t, lane, (pairs) <= FAN / 2 ? (pairs) : 1);
        DECIDE_CASE(1) DECIDE_CASE(2) DECIDE_CASE(3) DECIDE_CASE(4) DECIDE_CASE(5)
        DECIDE_CASE(6) DECIDE_CASE(7) DECIDE_CASE(8) DECIDE_CASE(9) DECIDE_CASE(10)
        DECIDE_CASE(11) DECIDE_CASE(12) DECIDE_CASE(13) DECIDE_CASE(14) DECIDE_CASE(15)
        DECIDE_CASE(16)
#undef DECIDE_CASE
    default:
        return decide_pairs(tour, l, j, s, t, lane, FAN / 2);
    }
}

/* Decide the path of leaf `drawn` (whose count was just written), leaf to root, for step t. */
static void
climb(tournament_t *tour, int64_t drawn, int64_t t)
{
    double s = step_value(t);
    int64_t j = drawn;
    for (int l = tour->levels - 1; l > 0; l--) {
        j /= FAN;
        decide_pairs(tour, l, j, s, t, tour->levels - l, FAN / 2);
    }
    decide(tour, 0, 0, s, t, tour->levels);
}

/* Decide again, at step t, every node whose decision may no longer hold at t, and the nodes
 * above each whose winner changed. `due` is room for every node. */
static void
refresh(tournament_t *tour, int64_t t, int64_t *due)
{
    int64_t count = 0, u = t & (tour->wheel - 1), kept = -1;
    for (int64_t e = tour->slot[u], older; e >= 0; e = older) {
        int64_t k = tour->entry[e], until = tour->until[k];
        older = tour->older[e];
        if (until <= t) {
            if (until != DUE) /* not listed twice for one step */
                due[count++] = k;
            tour->until[k] = DUE;
        } else if (until != NEVER && (until & (tour->wheel - 1)) == u) { /* a later turn */
            tour->older[e] = kept;
            kept = e;
        } /* else listed again since, elsewhere */
    }
    tour->slot[u] = kept;
    double s = step_value(t);
    for (int64_t i = 0; i < count; i++) {
        int64_t k = due[i];
        if (tour->until[k] > t) /* decided again meanwhile, from below, or listed twice */
            continue;
        int l = tour->level[k];
        int64_t j = k - tour->base[l];
        while (decide(tour, l, j, s, t, 0) && l > 0)
            j /= tour->fan[--l];
    }
}

typedef struct {
    double w;
    int64_t id;
} weighed_t;

static int
by_weight(const void *a, const void *b)
{
    const weighed_t *x = a, *y = b;
    return x->w < y->w ? -1 : x->w > y->w ? 1 : (x->id > y->id) - (x->id < y->id);
}

/* The blending loop. sizes == NULL: build_blending_indices over `size` samples with `weights`;
 * else build_exhaustive_blending_indices (a dataset leaves once it gave sizes[i] samples).
 * index and sample: NULL, or `size` of each to fill; counts: NULL, or n to fill. */
static int
blend(const double *weights, const int64_t *sizes, int64_t n, int64_t size, int16_t *index,
      int64_t *sample, int64_t *counts)
{
    int64_t *count = calloc((size_t)(n > 0 ? n : 1), sizeof *count);
    if (count == NULL)
        return -1;
    int finite = 1;
    double largest = 0.0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(weights[i]))
            finite = 0;
        else if (fabs(weights[i]) > largest)
            largest = fabs(weights[i]);
    }
    if (!finite || n <= PLAIN_DATASETS) {
        /* Megatron's own loop: for a handful of datasets it is the faster, and NaN and
         * infinities compare in it as they compare in Megatron's */
        for (int64_t t = 0; t < size; t++) {
            double s = step_value(t);
            int64_t best = -1;
            double top = 0.0;
            if (sizes == NULL) { /* helpers.cpp's build_blending_indices */
                best = 0;
                top = weights[0] * s - (double)count[0];
                for (int64_t i = 1; i < n; i++) {
                    double error = weights[i] * s - (double)count[i];
                    if (error > top)
                        top = error, best = i;
                }
            } else { /* its build_exhaustive_blending_indices, over the datasets not spent */
                for (int64_t i = 0; i < n; i++) {
                    if ((double)sizes[i] - (double)count[i] == 0)
                        continue;
                    double error = weights[i] * s - (double)count[i];
                    if (best < 0 || error > top)
                        top = error, best = i;
                }
            }
            if (best < 0) {
                free(count);
                return -2;
            }
            if (index != NULL) {
                index[t] = (int16_t)best;
                sample[t] = count[best];
            }
            count[best]++;
        }
        goto done;
    }

    tournament_t tour;
    memset(&tour, 0, sizeof tour);
    /* levels of FAN below a root of as few children as will do (an even number) */
    int64_t below = 1;
    tour.levels = 1;
    while (below * FAN < n)
        below *= FAN, tour.levels++;
    tour.fan[0] = (n + below - 1) / below;
    tour.fan[0] += tour.fan[0] & 1;
    for (int l = 1; l < tour.levels; l++)
        tour.fan[l] = FAN;
    tour.width[0] = 1;
    tour.base[0] = 0;
    for (int l = 0; l < tour.levels; l++) {
        tour.width[l + 1] = tour.width[l] * tour.fan[l];
        tour.base[l + 1] = tour.base[l] + tour.width[l] + (tour.width[l] & 1);
    }
    tour.nodes = tour.base[tour.levels];
    int64_t leaves = tour.width[tour.levels], places = tour.nodes + leaves;
    tour.wheel = 2;
    while (tour.wheel < tour.nodes)
        tour.wheel *= 2;
    /* |computed - exact| <= 2^-53 (|w s| + |w s - c|) <= 2^-52 (largest + 1) size, for every
     * step of this build (s <= size, c <= size); four times that */
    double span = (double)(size > 1 ? size : 1) + 1.0;
    tour.margin = ldexp((largest + 1.0) * span, -50);
    tour.w = malloc((size_t)places * sizeof(double));
    tour.c = malloc((size_t)places * sizeof(double));
    tour.id = malloc((size_t)places * sizeof(int64_t));
    tour.leaf = malloc((size_t)places * sizeof(int64_t));
    tour.until = malloc((size_t)tour.nodes * sizeof(int64_t));
    tour.level = malloc((size_t)tour.nodes);
    tour.room = 8 * tour.nodes + 2 * LANES;
    tour.slot = malloc((size_t)(tour.wheel + LANES) * sizeof(int64_t));
    tour.entry = malloc((size_t)tour.room * sizeof(int64_t));
    tour.older = malloc((size_t)tour.room * sizeof(int64_t));
    int64_t *due = malloc((size_t)tour.nodes * sizeof(int64_t));
    weighed_t *order = malloc((size_t)n * sizeof *order);
    int status = 0;
    if (!tour.w || !tour.c || !tour.id || !tour.leaf || !tour.until || !tour.level ||
        !tour.slot || !tour.entry || !tour.older || !due || !order) {
        status = -1;
        goto free_tree;
    }
    /* the leaves in order of weight: neighbours of like weight rarely overtake one another
     * between draws, so the lower nodes are seldom decided again (the tie rule compares the
     * datasets themselves, not their places) */
    for (int64_t i = 0; i < n; i++)
        order[i].w = weights[i], order[i].id = i;
    qsort(order, (size_t)n, sizeof *order, by_weight);
    for (int64_t p = 0; p < places; p++) { /* padding (and the places between levels) */
        tour.w[p] = 0.0;
        tour.c[p] = INFINITY;
        tour.id[p] = INT64_MAX;
        tour.leaf[p] = -1;
    }
    for (int64_t i = 0; i < leaves; i++) {
        tour.leaf[tour.nodes + i] = i;
        if (i < n) {
            tour.w[tour.nodes + i] = order[i].w;
            tour.c[tour.nodes + i] = 0.0;
            tour.id[tour.nodes + i] = order[i].id;
        }
    }
    for (int l = 0; l < tour.levels; l++)
        for (int64_t j = 0; j < tour.width[l] + (tour.width[l] & 1); j++) {
            tour.level[tour.base[l] + j] = (unsigned char)l;
            tour.until[tour.base[l] + j] = NEVER;
        }
    for (int64_t u = 0; u < tour.wheel + LANES; u++)
        tour.slot[u] = -1;
    for (int l = tour.levels - 1; l >= 0; l--)
        for (int64_t j = 0; j < tour.width[l]; j++)
            decide(&tour, l, j, step_value(0), 0, 0);

    for (int64_t t = 0; t < size; t++) {
        refresh(&tour, t, due);
        int64_t leaf = tour.leaf[0];
        /* the drawn dataset's new count, as Megatron casts it (exact below 2^53), from the
         * winner's line rather than from count[] (one load less on the chain of samples) */
        double drawn = tour.c[0] + 1.0;
        if (isinf(drawn)) { /* every dataset spent before `size` samples (exhaustive) */
            status = -2;
            goto free_tree;
        }
        int64_t best = tour.id[0];
        if (index != NULL) {
            index[t] = (int16_t)best;
            sample[t] = count[best];
        }
        count[best]++;
        if (sizes != NULL && (double)sizes[best] - drawn == 0) { /* spent (exhaustive) */
            store_lane(tour.w, tour.nodes + leaf, 0.0);
            drawn = INFINITY;
        }
        store_lane(tour.c, tour.nodes + leaf, drawn);
        climb(&tour, leaf, t + 1);
    }
free_tree:
    free(tour.w);
    free(tour.c);
    free(tour.id);
    free(tour.leaf);
    free(tour.until);
    free(tour.level);
    free(tour.slot);
    free(tour.entry);
    free(tour.older);
    free(due);
    free(order);
    if (status != 0) {
        free(count);
        return status;
    }
done:
    if (counts != NULL)
        memcpy(counts, count, (size_t)n * sizeof *count);
    free(count);
    return 0;
}

/* A buffer from `object` (None: none wanted) of at least `items` of `itemsize` bytes. */
static int
get_buffer(PyObject *object, Py_buffer *view, int writable, Py_ssize_t items,
           Py_ssize_t itemsize, const char *name)
{
    view->buf = NULL;
    if (object == Py_None)
        return 1;
    if (PyObject_GetBuffer(object, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return 0;
    if (view->len < items * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, at least %zd needed", name, view->len,
                     items * itemsize);
        return 0;
    }
    return 1;
}

/* blend(weights, sizes, size, dataset_index, dataset_sample_index, counts): weights float64 (n
 * of them), sizes int64 (n) or None, dataset_index int16 and dataset_sample_index int64 (size
 * of each) or both None, counts int64 (n) or None: C-contiguous buffers, checked by
 * repack/model/blending.py. */
static PyObject *
py_blend(PyObject *module, PyObject *args)
{
    Py_buffer weights, sizes, index, sample, counts;
    PyObject *sizes_object, *index_object, *sample_object, *counts_object, *result = NULL;
    Py_ssize_t size;
    int status = 0;

    sizes.buf = index.buf = sample.buf = counts.buf = NULL;
    if (!PyArg_ParseTuple(args, "y*OnOOO:blend", &weights, &sizes_object, &size, &index_object,
                          &sample_object, &counts_object))
        return NULL;
    Py_ssize_t n = weights.len / 8;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "size: negative");
        goto done;
    }
    if (!get_buffer(sizes_object, &sizes, 0, n, 8, "sizes") ||
        !get_buffer(index_object, &index, 1, size, 2, "dataset_index") ||
        !get_buffer(sample_object, &sample, 1, size, 8, "dataset_sample_index") ||
        !get_buffer(counts_object, &counts, 1, n, 8, "counts"))
        goto done;
    if ((index.buf == NULL) != (sample.buf == NULL)) {
        PyErr_SetString(PyExc_ValueError, "dataset_index and dataset_sample_index: both or none");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    status = blend((const double *)weights.buf, (const int64_t *)sizes.buf, (int64_t)n,
                   (int64_t)size, (int16_t *)index.buf, (int64_t *)sample.buf,
                   (int64_t *)counts.buf);
    Py_END_ALLOW_THREADS
    if (status == -1)
        PyErr_NoMemory();
    else if (status == -2)
        PyErr_SetString(PyExc_ValueError, "every dataset spent before the last sample");
    else {
        result = Py_None;
        Py_INCREF(result);
    }
done:
    PyBuffer_Release(&weights);
    if (sizes.buf != NULL)
        PyBuffer_Release(&sizes);
    if (index.buf != NULL)
        PyBuffer_Release(&index);
    if (sample.buf != NULL)
        PyBuffer_Release(&sample);
    if (counts.buf != NULL)
        PyBuffer_Release(&counts);
    return result;
}

static PyMethodDef methods[] = {
    {"blend", py_blend, METH_VARARGS,
     "blend(weights, sizes, size, dataset_index, dataset_sample_index, counts): Megatron's\n"
     "blending index (sizes None) or its exhaustive one (sizes int64), the same bytes, in\n"
     "O(log n) a sample, without the GIL; counts gets the samples drawn of each dataset.\n"
     "Arguments are checked by repack.model.blending."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "repack._blending",
    "Megatron's blending index without the samples x datasets loop (repack.model.blending).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__blending(void)
{
    return PyModule_Create(&module);
}
