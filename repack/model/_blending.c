#ifndef BLEND_TREE /* the module (the tree's code, read once per way, is at the end) */
/* repack.model._blending: Megatron's blending index, the same bytes, without the samples x datasets loop.
 *
 * megatron-core's helpers.cpp fills BlendedDataset's dataset_index (int16) and
 * dataset_sample_index (int64): for every sample t it computes, for every dataset i,
 *
 *     error_i = weights[i] * max(t, 1.0) - (double)count[i]
 *
 * and takes the first dataset with the largest error (ties go to the lower index). That is
 * samples x datasets: 9 s for 10^6 samples of 10,000 datasets, 21 minutes for 10^8.
 * build_exhaustive_blending_indices does the same over the datasets not yet spent, with
 * weights sizes[i] / total, until every dataset has given sizes[i] samples. Its x86-64 builds
 * round the error twice (the product, then the difference); its aarch64 builds round it once
 * (the compiler contracts the line into a fused multiply-subtract, fnmsub), and where two
 * errors nearly tie the two pick different datasets. Both are here, as one more axis of the
 * tree's code: each way of reading the children is built once per rounding (V_ERROR).
 *
 * Here the datasets are the leaves of a tournament tree (a "kinetic tournament"): every node
 * holds the winner below it at the current step, decided with Megatron's own double expression
 * and its tie rule (equal errors: the lower dataset wins). Between draws an error is a line in
 * t, so a node's decision holds until a loser that grows faster can catch up. That moment is
 * bounded conservatively, pair by pair: a computed error is within a noise of the exact line
 * that its rounding bounds (2^-53 of |w| s + |e| rounding twice, of |e| rounding once) and that
 * grows by a bounded amount a step, so while the exact gap between winner and loser stays
 * above both noises the computed comparison cannot change (see decide_vecs). A node is decided
 * again, with the exact expression, at the first step where that is no longer certain. A
 * loser that no rounding can lift above the winner never is: a weight no larger, a count no
 * smaller and a higher dataset (fl(w s) keeps the order of w, and fl(x - c) that of x - c).
 * Nodes wait for that step in a timing wheel; a step decides them and, above each, the nodes
 * whose winner changed, then the path of the dataset just drawn: O(log datasets) a sample
 * instead of O(datasets). The leaves are the datasets in order of weight: neighbours of like
 * weight seldom overtake one another between draws, which leaves the lower nodes nearly
 * nothing to decide again. Weights a few ulps apart, rounded twice, tie and part again at
 * steps only the rounding decides: where the tree decides again most of its nodes at every
 * step, Megatron's loop, four datasets at a time (scan), takes over for a span of steps, then
 * the tree again, each span twice the last (grow).
 *
 * The tree is wide: a node has 32 children where the processor has AVX2 (four doubles an
 * operation; the code is built for it under #pragma GCC target, chosen when a build starts),
 * else 16 (SSE2, two doubles; or one after the other where there is no SSE2), the root as few
 * as will do: 3 levels (4 with SSE2) at 10,000 datasets where a binary tree has 14. A node is
 * decided by a scan of its children: every child's error, the largest (a tree of maxima), the
 * first child of that error (a bit mask; equal errors compare datasets); its certificate is
 * the fewest steps over all its children, (winner's error - child's - both noises) /
 * (child's weight - winner's + the noises' growth), one division a vector (see holds_for). A
 * node's line is written as the vector its parent reads (a read that overlaps a narrower write
 * waits for it to reach the cache), every decision takes an entry of the wheel (were only those
 * that may end counted, each node of a path would wait on the one below's division), and the
 * drawn count comes from the drawn leaf's line.
 * Measured with callgrind and a C driver at 10,000 Dirichlet-weighted datasets: 831
 * instructions a sample with AVX2 (1,254 with SSE2), where the binary tree took 1,842; about
 * 115 ns a sample (150 with SSE2) where it took 235 (quiet machine, CPU time); the pair-by-pair
 * noise, the lazy ties and the scan's hand-over of issue 43 cost the easy weights about 30 ns a
 * sample more and bring every family of weights within 160-240 ns (docs/benchmarks.md). Tried
 * and left out: the drawn path decided in registers with memory read as it was (shorter chain,
 * more instructions: slower); a coarse certificate from the runner-up and the largest weight below
 * (four times as many nodes decided again); reciprocal estimates in place of the division;
 * the winner's line picked by masks instead of loaded by index.
 *
 * The bytes are Megatron's whatever the weights: no decision is taken on an estimate, only the
 * moment of re-deciding. Weights that are not finite go through Megatron's plain loop.
 * repack/model/blending.py holds the entry points (argument checks, the Python path).
 *
 * Built with -ffp-contract=off (setup.py): no multiply-add is fused but the ones asked for
 * (fma(), _mm256_fmsub_pd), so each rounding is the one its code says.
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
/* Up to this many datasets Megatron's plain loop is the faster (measured with the binary tree
 * this file had before, which cost about 150 ns a sample from 150 datasets to 250, the loop
 * 0.8 ns a dataset; not measured again with the wide tree) */
#define PLAIN_DATASETS 160
/* Up to this many, one dataset after the other (the vector loop costs about 19 ns a sample
 * at any number up to 16, Megatron's loop 9 ns at 4 datasets, 19 at 12, 23 at 16) */
#define SCALAR_DATASETS 14
/* Children of a node (the root's: as few as will do, a multiple of 4), read two at a time and
 * four at a time: measured best at 10,000 datasets (read by pairs, 32 children cost 162 ns a
 * sample against 149 for 16; by quads, 16 cost 134 against 116 for 32; 8 cost more either way) */
/* Every SCAN_WINDOW steps, the tree hands over to Megatron's loop (scan) if it decided more
 * than datasets / SCAN_RATIO + 4 nodes a step: a node (16 or 32 children) costs about what the
 * loop pays for 100 datasets, four at a time */
#define SCAN_WINDOW 1024
#define SCAN_RATIO 64
#define FAN_PAIRS 16
#define FAN_QUADS 32

/* The nodes are decided two doubles at a time with SSE2 where there is SSE2 (every x86-64),
 * four at a time with AVX2 where GCC can build both and the processor has AVX2 (chosen when
 * the build starts), else two at a time one double after the other. The tree's code (at the
 * end, BLEND_TREE) is read once per way, by this file including itself. */
#if (defined(__SSE2__) || defined(_M_X64)) && !defined(BLEND_PORTABLE)
#define BLEND_SSE2 1
#include <emmintrin.h>
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 6 &&        \
    !defined(BLEND_NO_AVX2)
#define BLEND_AVX2 1
#include <immintrin.h>
#endif
#else
static inline uint64_t
as_bits(double x)
{
    uint64_t bits;
    memcpy(&bits, &x, 8);
    return bits;
}

static inline double
as_double(uint64_t bits)
{
    double x;
    memcpy(&x, &bits, 8);
    return x;
}
#endif

#if defined(__GNUC__) || defined(__clang__)
#define LOWEST_BIT(x) __builtin_ctz(x)
#define INLINE static inline __attribute__((always_inline))
#else
static inline int
LOWEST_BIT(unsigned x)
{
    int i = 0;
    while (!(x & 1u))
        x >>= 1, i++;
    return i;
}
#define INLINE static inline
#endif

/* The tree, level by level: level 0 is the root, level `levels` the leaves; a node of level l
 * has fan[l] children, consecutive in level l + 1. Every place (a node or a leaf, numbered
 * level after level from base[l], a multiple of 4) holds the line of its winner: its weight,
 * its count, its dataset and its leaf; the children of a node are read 2 or 4 at a time. */
typedef struct {
    double *w;      /* weight; a spent dataset or padding: 0 */
    double *c;      /* count, as Megatron casts it to double; spent or padding: +inf */
    int64_t *id;    /* per leaf, its dataset (padding: INT64_MAX); nodes tell theirs by resolve() */
    double *key;    /* the lowest dataset the place may stand for at a step (a leaf: its own,
                     * as a double, exact below 2^53; padding: +inf): read as a vector */
    double *key_hi; /* the highest (its winner's key_hi: a node draws its winner or a lower
                     * dataset that ties it) */
    unsigned char *won;  /* per node: the child of its winner */
    uint32_t *ties;      /* per node: the other children that may tie its winner until it is
                          * decided again (resolve) */
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
    int64_t datasets;
    int levels;
    int64_t fan[LANES];
    int64_t width[LANES + 1]; /* places of each level */
    int64_t base[LANES + 1];  /* the first place of each level */
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
 * its step comes. A decision that holds until its inputs change (NEVER) is listed, without a
 * branch on it (a coin toss), in a slot of its own lane past the wheel's, never read. Every
 * decision takes an entry: were entries counted only for those that may end, the nodes of a
 * draw's path would wait on each other's division through that count. */
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

/* The entries are full: list the nodes again, one entry each (those that may end). */
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

#ifdef BLEND_SSE2
/* the lane of a pair, of a quad, that store_lane() writes: all bits */
static const uint64_t lane_bits[2][2] = {{~(uint64_t)0, 0}, {0, ~(uint64_t)0}};
#endif
#ifdef BLEND_AVX2
static const uint64_t quad_bits[4][4] = {{~(uint64_t)0, 0, 0, 0},
                                         {0, ~(uint64_t)0, 0, 0},
                                         {0, 0, ~(uint64_t)0, 0},
                                         {0, 0, 0, ~(uint64_t)0}};
#endif

/* `bytes` from *raw = malloc(bytes + 64), at an address a multiple of 64 (a read of 4 doubles
 * from a place a multiple of 4 then stays within a cache line) */
static void *
aligned_block(void **raw, size_t bytes)
{
    *raw = malloc(bytes + 64);
    if (*raw == NULL)
        return NULL;
    return (void *)(((uintptr_t)*raw + 63) & ~(uintptr_t)63);
}

/* The tree's code, once per way of reading the children and per rounding of the error: the
 * ways are pairs (SSE2, or one double after the other) and quads (AVX2), the roundings
 * twice (x86-64 builds of Megatron: w * s, then - c) and once (aarch64 builds: a fused
 * multiply-subtract, fma(w, s, -c)). grow_pairs_twice(), grow_pairs_once(),
 * grow_quads_twice(), grow_quads_once(). */
#define VW 2
#define FAN FAN_PAIRS
#define BLEND_TREE pairs
#define BLEND_ROUNDING twice
#include "_blending.c"
#undef BLEND_ROUNDING
#define BLEND_ROUNDING once
#define BLEND_ROUNDING_ONCE 1
#include "_blending.c"
#undef BLEND_ROUNDING_ONCE
#undef BLEND_ROUNDING
#undef BLEND_TREE
#undef VW
#undef FAN
#ifdef BLEND_AVX2
#define VW 4
#define FAN FAN_QUADS
#define BLEND_TREE quads
#pragma GCC push_options
#pragma GCC target("avx2")
#define BLEND_ROUNDING twice
#include "_blending.c"
#undef BLEND_ROUNDING
#pragma GCC pop_options
/* the fused error with the processor's own fused multiply-subtract (FMA3, which every
 * processor with AVX2 but a few has: checked when the build starts) */
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define BLEND_ROUNDING once
#define BLEND_ROUNDING_ONCE 1
#include "_blending.c"
#undef BLEND_ROUNDING_ONCE
#undef BLEND_ROUNDING
#pragma GCC pop_options
#undef BLEND_TREE
#undef VW
#undef FAN
#endif

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


/* scan() of the way and rounding asked (see the tree's code) */
static int
scan(int quads, int fused, double *w, double *c, int64_t m, const int64_t *sizes, int64_t size,
     int16_t *index, int64_t *sample, int64_t *count, double *errors)
{
#ifdef BLEND_AVX2
    if (quads && fused)
        return scan_quads_once(w, c, m, sizes, 0, size, index, sample, count, errors);
    if (quads)
        return scan_quads_twice(w, c, m, sizes, 0, size, index, sample, count, errors);
#endif
    (void)quads;
    if (fused)
        return scan_pairs_once(w, c, m, sizes, 0, size, index, sample, count, errors);
    return scan_pairs_twice(w, c, m, sizes, 0, size, index, sample, count, errors);
}

/* Megatron's error, in the rounding of the build reproduced: twice (fused == 0), or once */
INLINE double
error_of(double w, double s, double c, int fused)
{
    return fused ? fma(w, s, -c) : w * s - c;
}

/* Megatron's loop itself, one dataset after the other, in the rounding asked. Returns 0, or
 * -2 if every dataset is spent first (exhaustive). */
INLINE int
plain_loop(const double *restrict weights, const int64_t *restrict sizes, int64_t n,
           int64_t size, int16_t *restrict index, int64_t *restrict sample,
           int64_t *restrict count, int fused)
{
    for (int64_t t = 0; t < size; t++) {
        double s = step_value(t);
        int64_t best = -1;
        double top = 0.0;
        if (sizes == NULL) { /* helpers.cpp's build_blending_indices */
            best = 0;
            top = error_of(weights[0], s, (double)count[0], fused);
            for (int64_t i = 1; i < n; i++) {
                double error = error_of(weights[i], s, (double)count[i], fused);
                if (error > top)
                    top = error, best = i;
            }
        } else { /* its build_exhaustive_blending_indices, over the datasets not spent */
            for (int64_t i = 0; i < n; i++) {
                if ((double)sizes[i] - (double)count[i] == 0)
                    continue;
                double error = error_of(weights[i], s, (double)count[i], fused);
                if (best < 0 || error > top)
                    top = error, best = i;
            }
        }
        if (best < 0)
            return -2;
        if (index != NULL) {
            index[t] = (int16_t)best;
            sample[t] = count[best];
        }
        count[best]++;
    }
    return 0;
}

static int
plain(const double *weights, const int64_t *sizes, int64_t n, int64_t size, int16_t *index,
      int64_t *sample, int64_t *count, int fused)
{
    if (fused) /* (one loop per rounding: no test of it a dataset) */
        return plain_loop(weights, sizes, n, size, index, sample, count, 1);
    return plain_loop(weights, sizes, n, size, index, sample, count, 0);
}

#if defined(BLEND_AVX2)
/* the fused loop with the processor's FMA3: fma() becomes its instruction, not a call */
__attribute__((target("fma"))) static int
plain_fma(const double *weights, const int64_t *sizes, int64_t n, int64_t size, int16_t *index,
          int64_t *sample, int64_t *count)
{
    return plain_loop(weights, sizes, n, size, index, sample, count, 1);
}
#endif

/* The blending loop. sizes == NULL: build_blending_indices over `size` samples with `weights`;
 * else build_exhaustive_blending_indices (a dataset leaves once it gave sizes[i] samples).
 * index and sample: NULL, or `size` of each to fill; counts: NULL, or n to fill; fused: the
 * error rounded once (aarch64 builds of Megatron) rather than twice (x86-64 builds). */
static int
blend(const double *weights, const int64_t *sizes, int64_t n, int64_t size, int16_t *index,
      int64_t *sample, int64_t *counts, int fused)
{
    int64_t *count = calloc((size_t)(n > 0 ? n : 1), sizeof *count);
    if (count == NULL)
        return -1;
    int finite = 1;
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(weights[i]))
            finite = 0;
    int quads = 0;
#ifdef BLEND_AVX2
    /* the fused rounding four at a time needs the processor's FMA3 too (else: two at a
     * time, with fma() from the C library, exact, slower where there is no FMA3) */
    quads = __builtin_cpu_supports("avx2") && (!fused || __builtin_cpu_supports("fma"));
#endif
    if (finite && n > SCALAR_DATASETS && n <= PLAIN_DATASETS) { /* a vector at a time */
        int64_t m = (n + 3) & ~(int64_t)3;
        void *w_block, *c_block, *e_block;
        double *w = aligned_block(&w_block, (size_t)m * sizeof(double));
        double *c = aligned_block(&c_block, (size_t)m * sizeof(double));
        double *errors = aligned_block(&e_block, (size_t)m * sizeof(double));
        int status = -1;
        if (w != NULL && c != NULL && errors != NULL) {
            for (int64_t i = 0; i < m; i++)
                w[i] = i < n ? weights[i] : 0.0, c[i] = i < n ? 0.0 : INFINITY;
            status = scan(quads, fused, w, c, m, sizes, size, index, sample, count, errors);
        }
        free(w_block);
        free(c_block);
        free(e_block);
        if (status != 0) {
            free(count);
            return status;
        }
        goto done;
    }
    if (!finite || n <= SCALAR_DATASETS) {
        /* Megatron's own loop, one dataset after the other: for a few datasets the fastest,
         * and NaN and infinities compare in it as they compare in Megatron's */
        int status;
#if defined(BLEND_AVX2)
        if (fused && __builtin_cpu_supports("fma"))
            status = plain_fma(weights, sizes, n, size, index, sample, count);
        else
#endif
            status = plain(weights, sizes, n, size, index, sample, count, fused);
        if (status != 0) {
            free(count);
            return status;
        }
        goto done;
    }

    tournament_t tour;
    memset(&tour, 0, sizeof tour);
    /* levels of `fan` children below a root of as few as will do (a multiple of 4) */
    int64_t fan = quads ? FAN_QUADS : FAN_PAIRS;
    tour.datasets = n;
    int64_t below = 1;
    tour.levels = 1;
    while (below * fan < n)
        below *= fan, tour.levels++;
    tour.fan[0] = (n + below - 1) / below;
    tour.fan[0] = (tour.fan[0] + 3) & ~(int64_t)3;
    for (int l = 1; l < tour.levels; l++)
        tour.fan[l] = fan;
    tour.width[0] = 1;
    tour.base[0] = 0;
    for (int l = 0; l < tour.levels; l++) {
        tour.width[l + 1] = tour.width[l] * tour.fan[l];
        tour.base[l + 1] = tour.base[l] + ((tour.width[l] + 3) & ~(int64_t)3);
    }
    tour.nodes = tour.base[tour.levels];
    int64_t leaves = tour.width[tour.levels], places = tour.nodes + leaves;
    tour.wheel = 2;
    while (tour.wheel < tour.nodes)
        tour.wheel *= 2;
    void *w_block, *c_block, *key_block;
    tour.w = aligned_block(&w_block, (size_t)places * sizeof(double));
    tour.c = aligned_block(&c_block, (size_t)places * sizeof(double));
    tour.key = aligned_block(&key_block, (size_t)places * sizeof(double));
    tour.key_hi = malloc((size_t)places * sizeof(double));
    tour.won = calloc((size_t)tour.nodes + 1, 1);
    tour.ties = calloc((size_t)tour.nodes + 1, sizeof(uint32_t));
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
    if (!tour.w || !tour.c || !tour.key || !tour.key_hi || !tour.won || !tour.ties || !tour.id ||
        !tour.leaf || !tour.until || !tour.level ||
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
        tour.key[p] = tour.key_hi[p] = INFINITY;
        tour.id[p] = INT64_MAX;
        tour.leaf[p] = -1;
    }
    for (int64_t i = 0; i < leaves; i++) {
        tour.leaf[tour.nodes + i] = i;
        if (i < n) {
            tour.w[tour.nodes + i] = order[i].w;
            tour.c[tour.nodes + i] = 0.0;
            tour.id[tour.nodes + i] = order[i].id;
            tour.key[tour.nodes + i] = tour.key_hi[tour.nodes + i] = (double)order[i].id;
        }
    }
    for (int64_t k = 0; k < tour.nodes; k++)
        tour.until[k] = NEVER;
    for (int l = 0; l < tour.levels; l++)
        for (int64_t j = 0; j < tour.base[l + 1] - tour.base[l]; j++)
            tour.level[tour.base[l] + j] = (unsigned char)l;
    for (int64_t u = 0; u < tour.wheel + LANES; u++)
        tour.slot[u] = -1;
#ifdef BLEND_AVX2
    if (quads && fused)
        status = grow_quads_once(&tour, sizes, size, index, sample, count, due);
    else if (quads)
        status = grow_quads_twice(&tour, sizes, size, index, sample, count, due);
    else
#endif
    if (fused)
        status = grow_pairs_once(&tour, sizes, size, index, sample, count, due);
    else
        status = grow_pairs_twice(&tour, sizes, size, index, sample, count, due);
free_tree:
    free(w_block);
    free(c_block);
    free(key_block);
    free(tour.id);
    free(tour.leaf);
    free(tour.key_hi);
    free(tour.won);
    free(tour.ties);
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
    int status = 0, fused = 0;

    sizes.buf = index.buf = sample.buf = counts.buf = NULL;
    if (!PyArg_ParseTuple(args, "y*OnOOO|p:blend", &weights, &sizes_object, &size, &index_object,
                          &sample_object, &counts_object, &fused))
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
                   (int64_t *)counts.buf, fused);
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
     "blend(weights, sizes, size, dataset_index, dataset_sample_index, counts, fused=False):\n"
     "Megatron's blending index (sizes None) or its exhaustive one (sizes int64), the same\n"
     "bytes, in O(log n) a sample, without the GIL; counts gets the samples drawn of each\n"
     "dataset; fused: the error rounded once (aarch64 builds), else twice (x86-64 builds).\n"
     "Arguments are checked by repack.model.blending."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "repack.model._blending",
    "Megatron's blending index without the samples x datasets loop (repack.model.blending).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__blending(void)
{
    return PyModule_Create(&module);
}

#else /* BLEND_TREE */
/* The tree's code, for one way of reading the children (BLEND_TREE: pairs or quads): VW
 * doubles at a time, in a vec_t, FAN children a node (at most 32: a bit each in `best`); and
 * one rounding of Megatron's error (BLEND_ROUNDING: twice or once), which only V_ERROR
 * differs by: the certificates bound both roundings. NAME(x) is x_pairs_twice, ... */
#define NAME(x) NAME_OF(x, BLEND_TREE, BLEND_ROUNDING)
#define NAME_OF(x, way, rounding) NAME_JOIN(x, way, rounding)
#define NAME_JOIN(x, way, rounding) x##_##way##_##rounding

#if VW == 4
typedef __m256d NAME(vec_t);
#define V_LOAD(p) _mm256_loadu_pd(p)
#define V_STORE(p, a) _mm256_storeu_pd(p, a)
#define V_SET(x) _mm256_set1_pd(x)
#define V_MUL(a, b) _mm256_mul_pd(a, b)
#define V_SUB(a, b) _mm256_sub_pd(a, b)
#define V_DIV(a, b) _mm256_div_pd(a, b)
#define V_MAX(a, b) _mm256_max_pd(a, b) /* a > b ? a : b, lane by lane */
#define V_MIN(a, b) _mm256_min_pd(a, b) /* a < b ? a : b */
#define V_ADD(a, b) _mm256_add_pd(a, b)
#define V_EQ(a, b) _mm256_cmp_pd(a, b, _CMP_EQ_OQ)
#define V_LE(a, b) _mm256_cmp_pd(a, b, _CMP_LE_OQ)
#define V_GE(a, b) _mm256_cmp_pd(a, b, _CMP_GE_OQ)
#define V_GT(a, b) _mm256_cmp_pd(a, b, _CMP_GT_OQ)
#define V_ABS(a) _mm256_andnot_pd(_mm256_set1_pd(-0.0), a)
#define V_AND(a, b) _mm256_and_pd(a, b)
#define V_OR(a, b) _mm256_or_pd(a, b)
#define V_ANDNOT(a, b) _mm256_andnot_pd(a, b) /* ~a & b */
#define V_MASK(a) _mm256_movemask_pd(a)       /* bit i: lane i's comparison held */
#define V_FIRST(a) _mm_cvtsd_f64(_mm256_castpd256_pd128(a))
/* the halves swapped, then the neighbours: the largest, the smallest in every lane */
#define V_ACROSS(a, op) op(V_ACROSS_HALF(a, op), _mm256_permute_pd(V_ACROSS_HALF(a, op), 5))
#define V_ACROSS_HALF(a, op) op(a, _mm256_permute2f128_pd(a, a, 1))
#elif defined(BLEND_SSE2)
typedef __m128d NAME(vec_t);
#define V_LOAD(p) _mm_loadu_pd(p)
#define V_STORE(p, a) _mm_storeu_pd(p, a)
#define V_SET(x) _mm_set1_pd(x)
#define V_MUL(a, b) _mm_mul_pd(a, b)
#define V_SUB(a, b) _mm_sub_pd(a, b)
#define V_DIV(a, b) _mm_div_pd(a, b)
#define V_MAX(a, b) _mm_max_pd(a, b) /* a > b ? a : b, lane by lane */
#define V_MIN(a, b) _mm_min_pd(a, b) /* a < b ? a : b */
#define V_ADD(a, b) _mm_add_pd(a, b)
#define V_EQ(a, b) _mm_cmpeq_pd(a, b)
#define V_LE(a, b) _mm_cmple_pd(a, b)
#define V_GE(a, b) _mm_cmpge_pd(a, b)
#define V_GT(a, b) _mm_cmpgt_pd(a, b)
#define V_ABS(a) _mm_andnot_pd(_mm_set1_pd(-0.0), a)
#define V_AND(a, b) _mm_and_pd(a, b)
#define V_OR(a, b) _mm_or_pd(a, b)
#define V_ANDNOT(a, b) _mm_andnot_pd(a, b) /* ~a & b */
#define V_MASK(a) _mm_movemask_pd(a)       /* bit i: lane i's comparison held */
#define V_FIRST(a) _mm_cvtsd_f64(a)
#define V_ACROSS(a, op) op(a, _mm_shuffle_pd(a, a, 1))
#else
/* one double after the other, as SSE2 would */
typedef struct {
    double x[2];
} NAME(vec_t);
static inline NAME(vec_t)
NAME(vec_of)(double a, double b)
{
    NAME(vec_t) r = {{a, b}};
    return r;
}
#define V_OF NAME(vec_of)
#define V_LOAD(p) V_OF((p)[0], (p)[1])
#define V_STORE(p, a) ((p)[0] = (a).x[0], (p)[1] = (a).x[1])
#define V_SET(v) V_OF(v, v)
#define V_MUL(a, b) V_OF((a).x[0] * (b).x[0], (a).x[1] * (b).x[1])
#define V_SUB(a, b) V_OF((a).x[0] - (b).x[0], (a).x[1] - (b).x[1])
#define V_ADD(a, b) V_OF((a).x[0] + (b).x[0], (a).x[1] + (b).x[1])
#define V_ABS(a) V_OF(fabs((a).x[0]), fabs((a).x[1]))
#define V_DIV(a, b) V_OF((a).x[0] / (b).x[0], (a).x[1] / (b).x[1])
#define V_MAX(a, b)                                                                            \
    V_OF((a).x[0] > (b).x[0] ? (a).x[0] : (b).x[0], (a).x[1] > (b).x[1] ? (a).x[1] : (b).x[1])
#define V_MIN(a, b)                                                                            \
    V_OF((a).x[0] < (b).x[0] ? (a).x[0] : (b).x[0], (a).x[1] < (b).x[1] ? (a).x[1] : (b).x[1])
#define V_TEST(c) as_double((c) ? ~(uint64_t)0 : 0)
#define V_EQ(a, b) V_OF(V_TEST((a).x[0] == (b).x[0]), V_TEST((a).x[1] == (b).x[1]))
#define V_LE(a, b) V_OF(V_TEST((a).x[0] <= (b).x[0]), V_TEST((a).x[1] <= (b).x[1]))
#define V_GE(a, b) V_OF(V_TEST((a).x[0] >= (b).x[0]), V_TEST((a).x[1] >= (b).x[1]))
#define V_GT(a, b) V_OF(V_TEST((a).x[0] > (b).x[0]), V_TEST((a).x[1] > (b).x[1]))
#define V_ANDNOT(a, b)                                                                         \
    V_OF(as_double(~as_bits((a).x[0]) & as_bits((b).x[0])),                                    \
         as_double(~as_bits((a).x[1]) & as_bits((b).x[1])))
#define V_BITS(a, b, op)                                                                       \
    V_OF(as_double(as_bits((a).x[0]) op as_bits((b).x[0])),                                    \
         as_double(as_bits((a).x[1]) op as_bits((b).x[1])))
#define V_AND(a, b) V_BITS(a, b, &)
#define V_OR(a, b) V_BITS(a, b, |)
#define V_MASK(a) ((int)(as_bits((a).x[0]) >> 63) | (int)(as_bits((a).x[1]) >> 63) << 1)
#define V_FIRST(a) ((a).x[0])
#define V_ACROSS(a, op) op(a, V_OF((a).x[1], (a).x[0]))
#endif
#define vec_t NAME(vec_t)

/* Megatron's error of VW children, w * s - c (p: their weights, q: their counts), in the
 * rounding of the build reproduced: twice (the product, then the difference: x86-64 builds),
 * or once (a fused multiply-subtract: aarch64 builds; the processor's own with AVX2, else C's
 * fma(), exact everywhere and compiled to the instruction where there is one) */
#if BLEND_ROUNDING_ONCE
#if VW == 4
#define V_ERROR(p, vs, s, q) _mm256_fmsub_pd(V_LOAD(p), vs, V_LOAD(q))
#elif defined(BLEND_SSE2)
#define V_ERROR(p, vs, s, q) _mm_set_pd(fma((p)[1], s, -(q)[1]), fma((p)[0], s, -(q)[0]))
#else
#define V_ERROR(p, vs, s, q) V_OF(fma((p)[0], s, -(q)[0]), fma((p)[1], s, -(q)[1]))
#endif
#else
#define V_ERROR(p, vs, s, q) V_SUB(V_MUL(V_LOAD(p), vs), V_LOAD(q))
#endif
/* The noise of a pair (decide_vecs), per rounding: PRODUCT_NOISE, the share of |w| s (the
 * rounding of the product: none where it is fused), and GROWTH, of |w| a step */
#if BLEND_ROUNDING_ONCE
#define PRODUCT_NOISE 0.0
#define GROWTH 0x1p-51
#define S_ERROR(w, s, c) fma(w, s, -(c))
#else
#define PRODUCT_NOISE 0x1p-51
#define GROWTH 0x1p-50
#define S_ERROR(w, s, c) ((w) * (s) - (c))
#endif

/* a[k] = x, written with its neighbours as the vector that the parent reads: a read of a
 * vector where part of it was just written waits for the write to reach the cache (the
 * processor forwards a store to a load of the same place and size only) */
static inline void
NAME(store_lane)(double *a, int64_t k, double x)
{
#if VW == 4
    double *p = a + (k & ~(int64_t)3);
    __m256d m = _mm256_loadu_pd((const double *)quad_bits[k & 3]);
    V_STORE(p, V_OR(V_AND(m, V_SET(x)), V_ANDNOT(m, V_LOAD(p))));
#elif defined(BLEND_SSE2)
    double *p = a + (k & ~(int64_t)1);
    __m128d m = _mm_loadu_pd((const double *)lane_bits[k & 1]);
    V_STORE(p, V_OR(V_AND(m, V_SET(x)), V_ANDNOT(m, V_LOAD(p))));
#else
    a[k] = x;
#endif
}

/* The children of a node, as read: their errors at step value s, the first of the largest
 * (the lowest dataset among equal errors). */
typedef struct {
    vec_t error[FAN / VW];
    vec_t top; /* the largest error, in every lane */
    int win;   /* the child that wins */
} NAME(look_t);

INLINE void
NAME(look)(const tournament_t *tour, int64_t first, double s, int vecs, NAME(look_t) *at)
{
    const double *w = tour->w + first, *c = tour->c + first;
    vec_t vs = V_SET(s);
    (void)vs; /* unused where the error is C's fma() */
    for (int p = 0; p < vecs; p++) /* Megatron's expression, child by child */
        at->error[p] = V_ERROR(w + VW * p, vs, s, c + VW * p);
    /* the largest, as a tree of vectors (a chain of them is as long as the children) */
    vec_t top[FAN / VW];
    int count = vecs;
    for (int p = 0; p < vecs; p++)
        top[p] = at->error[p];
    while (count > 1) {
        for (int p = 0; p < count / 2; p++)
            top[p] = V_MAX(top[2 * p], top[2 * p + 1]);
        if (count & 1)
            top[count / 2] = top[count - 1];
        count = (count + 1) / 2;
    }
    at->top = V_ACROSS(top[0], V_MAX);
    unsigned best = 0;
    for (int p = 0; p < vecs; p++)
        best |= (unsigned)V_MASK(V_EQ(at->error[p], at->top)) << (VW * p);
    if (best & (best - 1)) {
        /* equal errors: the heaviest, then the fewest drawn, then the lowest, vector by
         * vector (no branch: ties are everywhere where weights are equal). The others then
         * never pass it (a weight no larger, a count no smaller), and which of them a step
         * draws is told when it is asked (resolve) */
        const double *key = tour->key_hi + first;
        int f = LOWEST_BIT(best);
        vec_t tied[FAN / VW], w0 = V_SET(w[f]), c0 = V_SET(c[f]), differ = V_SET(0.0);
        for (int p = 0; p < vecs; p++) {
            tied[p] = V_EQ(at->error[p], at->top);
            vec_t same = V_AND(V_EQ(V_LOAD(w + VW * p), w0), V_EQ(V_LOAD(c + VW * p), c0));
            differ = V_OR(differ, V_ANDNOT(same, tied[p]));
        }
        if (V_MASK(differ)) { /* (equal weights and counts, the usual ties, skip this) */
            vec_t most = V_SET(-INFINITY), least = V_SET(INFINITY);
            for (int p = 0; p < vecs; p++)
                most = V_MAX(most, V_OR(V_AND(tied[p], V_LOAD(w + VW * p)),
                                        V_ANDNOT(tied[p], V_SET(-INFINITY))));
            most = V_ACROSS(most, V_MAX);
            for (int p = 0; p < vecs; p++) {
                tied[p] = V_AND(tied[p], V_EQ(V_LOAD(w + VW * p), most));
                least = V_MIN(least, V_OR(V_AND(tied[p], V_LOAD(c + VW * p)),
                                          V_ANDNOT(tied[p], V_SET(INFINITY))));
            }
            least = V_ACROSS(least, V_MIN);
            for (int p = 0; p < vecs; p++)
                tied[p] = V_AND(tied[p], V_EQ(V_LOAD(c + VW * p), least));
        }
        vec_t lowest = V_SET(INFINITY);
        for (int p = 0; p < vecs; p++)
            lowest = V_MIN(lowest, V_OR(V_AND(tied[p], V_LOAD(key + VW * p)),
                                        V_ANDNOT(tied[p], V_SET(INFINITY))));
        lowest = V_ACROSS(lowest, V_MIN);
        unsigned chosen = 0;
        for (int p = 0; p < vecs; p++)
            chosen |= (unsigned)V_MASK(V_AND(tied[p], V_EQ(V_LOAD(key + VW * p), lowest)))
                      << (VW * p);
        best = chosen ? chosen : best; /* (none: every error NaN; the first, as Megatron) */
    }
    at->win = LOWEST_BIT(best);
}

/* How many more steps a decision holds against losers whose computed error is `below` less
 * than the winner's less both noises (below = (top - error) - noise), and whose noise and
 * gap together close by at most `closing` a step (closing = faster + rate), lane by lane:
 *   closing > 0: below / closing, or none if below <= 0;
 *   closing <= 0: for ever (+inf) if below > 0 (the gap only widens), else none.
 * One division does both: below / max(closing, +0) is +inf, -inf or NaN where closing <= 0;
 * the maximum with 0 makes the last two none (NaN: the maximum returns its second operand). */
static inline vec_t
NAME(holds_for)(vec_t below, vec_t closing)
{
    vec_t zero = V_SET(0.0);
    return V_MAX(V_DIV(below, V_MAX(closing, zero)), zero);
}

/* The decision holds for `steps` (a vector) more steps from step t: the first step at which it
 * may no longer hold. The smallest lane, a little less: the division rounds (its relative
 * error, 2^-53, is far within what the factor leaves). */
static inline int64_t
NAME(until_after)(vec_t steps, int64_t t)
{
    double more = V_FIRST(V_ACROSS(steps, V_MIN)) * (1.0 - 1.0 / 1024);
    return more >= 9.0e18 ? NEVER : t + 1 + (int64_t)more;
}

/* Decide node j of level l at step t (value s) from its children's winners, `vecs` vectors of
 * them; returns whether its winner changed. */
INLINE int
NAME(decide_vecs)(tournament_t *tour, int l, int64_t j, double s, int64_t t, int64_t lane,
                  int vecs)
{
    int64_t k = tour->base[l] + j, first = tour->base[l + 1] + j * (VW * vecs);
    NAME(look_t) at;
    NAME(look)(tour, first, s, vecs, &at);
    int64_t win = first + at.win;
    double ww = tour->w[win], top = V_FIRST(at.top);
    /* The certificate: the fewest steps over the children X that the winner W keeps beating.
     * Noise: a computed error e is within 2^-53 (|w| s + |e|) (1 + 2^-52) of the exact line
     * w s - c rounding twice, within 2^-53 |e| (1 + 2^-52) rounding once, and that bound grows
     * by at most 2^-52 |w| (once: 2^-53 |w|) a step while the count stays; so W beats X while
     * the exact gap, (e_W - e_X) less both noises now, less (w_X - w_W) a step, stays above
     * both noises then. The noises here, 2^-51 (|w_W| s + |w_X| s) (PRODUCT_NOISE; none
     * once) + 2^-51 (|e_W| + |e_X|) + 2^-1070 (subnormals) and their growth, GROWTH
     * (|w_W| + |w_X|) a step, are those with room for the rounding of this arithmetic. For
     * ever, whatever the noise: X spent or padding (an error of -inf, which stays), and X
     * under W, which no rounding can lift above it: w_X <= w_W (so fl(w_X s) <= fl(w_W s)) and
     * c_X >= c_W (the winner itself too); of those, X dominated (every dataset it may stand for
     * above W's) never wins a tie either, and the others may tie W at any step (ties). */
    vec_t vw = V_SET(ww), vc = V_SET(tour->c[win]), vkey = V_SET(tour->key_hi[win]);
    vec_t vtop = V_SET(top), unit = V_SET(0x1p-51), inf = V_SET(INFINITY), zero = V_SET(0.0);
    vec_t product = V_SET(PRODUCT_NOISE * s), growth = V_SET(GROWTH);
    vec_t noise_w = V_SET(PRODUCT_NOISE * fabs(ww) * s + 0x1p-51 * fabs(top) + 0x1p-1070);
    vec_t rate_w = V_SET(GROWTH * fabs(ww)), steps = inf;
    unsigned ties = 0;
    for (int p = 0; p < vecs; p++) {
        vec_t wx = V_LOAD(tour->w + first + VW * p), e = at.error[p], awx = V_ABS(wx);
        vec_t noise = V_ADD(noise_w, V_ADD(V_MUL(awx, product), V_MUL(V_ABS(e), unit)));
        vec_t below = V_SUB(V_SUB(vtop, e), noise);
        vec_t closing = V_ADD(V_SUB(wx, vw), V_ADD(rate_w, V_MUL(awx, growth)));
        /* under the winner for ever: a weight no larger and a count no smaller. Of those,
         * the ones whose datasets are all above the winner's never win a tie either
         * (dominated); the others, once within the noises, may tie it at any step but never
         * pass it: the node's error stays the winner's, and which dataset a tie draws is
         * told when asked (ties, resolve) */
        vec_t under = V_AND(V_LE(wx, vw), V_GE(V_LOAD(tour->c + first + VW * p), vc));
        vec_t dominated = V_AND(under, V_GE(V_LOAD(tour->key + first + VW * p), vkey));
        vec_t spent = V_EQ(e, V_SET(-INFINITY)), clear = V_GT(below, zero);
        vec_t forever = V_OR(V_OR(dominated, spent), V_ANDNOT(clear, under));
        steps = V_MIN(steps, V_MAX(NAME(holds_for)(below, closing), V_AND(forever, inf)));
        /* those that may tie the winner until the node is decided again: within the noises,
         * neither dominated nor spent */
        unsigned tie = ~(unsigned)V_MASK(V_OR(V_OR(clear, dominated), spent));
        ties |= (tie & ((1u << VW) - 1)) << (VW * p);
    }
    ties &= ~(1u << at.win);
    double key = tour->key[win]; /* the lowest dataset the node may stand for */
    for (unsigned rest = ties; rest; rest &= rest - 1) {
        double other = tour->key[first + LOWEST_BIT(rest)];
        key = other < key ? other : key;
    }
    int64_t until = NAME(until_after)(steps, t);
    int64_t was = tour->leaf[k];
    double was_key = tour->key[k];
    NAME(store_lane)(tour->w, k, ww);
    NAME(store_lane)(tour->c, k, tour->c[win]);
    NAME(store_lane)(tour->key, k, key);
    tour->key_hi[k] = tour->key_hi[win];
    tour->leaf[k] = tour->leaf[win];
    tour->won[k] = (unsigned char)at.win;
    tour->ties[k] = ties;
    schedule(tour, k, until, lane);
    return tour->leaf[k] != was || key != was_key;
}

/* The dataset that node j of level l draws at step value s, and its leaf: Megatron's first of
 * the largest errors below it. Its winner's, unless a child that may tie it (ties) does tie it
 * and stands for a lower dataset (the rounding alone decides, step by step, among weights a
 * few ulps apart: they are told only when asked). */
static int64_t NAME(resolve_ties)(const tournament_t *tour, int l, int64_t j, double s,
                                  int64_t *leaf);

INLINE int64_t
NAME(resolve)(const tournament_t *tour, int l, int64_t j, double s, int64_t *leaf)
{
    while (l < tour->levels && tour->ties[tour->base[l] + j] == 0) /* its winner's */
        j = j * tour->fan[l] + tour->won[tour->base[l] + j], l++;
    if (l == tour->levels) {
        *leaf = tour->leaf[tour->base[l] + j];
        return tour->id[tour->base[l] + j];
    }
    return NAME(resolve_ties)(tour, l, j, s, leaf);
}

/* resolve() at a node whose winner other children may tie */
static int64_t
NAME(resolve_ties)(const tournament_t *tour, int l, int64_t j, double s, int64_t *leaf)
{
    int64_t k = tour->base[l] + j, below = j * tour->fan[l];
    int64_t best = NAME(resolve)(tour, l + 1, below + tour->won[k], s, leaf);
    unsigned ties = tour->ties[k];
    if (ties) {
        const double *w = tour->w + tour->base[l + 1] + below;
        const double *c = tour->c + tour->base[l + 1] + below;
        const double *key = tour->key + tour->base[l + 1] + below;
        double top = S_ERROR(tour->w[k], s, tour->c[k]);
        for (; ties; ties &= ties - 1) {
            int i = LOWEST_BIT(ties);
            if (key[i] < (double)best && S_ERROR(w[i], s, c[i]) == top) {
                int64_t other_leaf, other = NAME(resolve)(tour, l + 1, below + i, s, &other_leaf);
                if (other < best)
                    best = other, *leaf = other_leaf;
            }
        }
    }
    return best;
}

/* decide_vecs() for node j of level l, its number of children made a constant (unrolled) */
static int
NAME(decide)(tournament_t *tour, int l, int64_t j, double s, int64_t t, int64_t lane)
{
    switch (tour->fan[l] / VW) {
#define DECIDE_CASE(vecs)                                                                      \
    case vecs:                                                                                 \
        return NAME(decide_vecs)(tour, l, j, s, t, lane, (vecs) <= FAN / VW ? (vecs) : 1);
        DECIDE_CASE(1) DECIDE_CASE(2) DECIDE_CASE(3) DECIDE_CASE(4) DECIDE_CASE(5)
        DECIDE_CASE(6) DECIDE_CASE(7)
#undef DECIDE_CASE
    default:
        return NAME(decide_vecs)(tour, l, j, s, t, lane, FAN / VW);
    }
}

/* Decide again, at step t, every node whose decision may no longer hold at t, and the nodes
 * above each whose winner changed. `due` is room for every node. */
static int64_t
NAME(refresh)(tournament_t *tour, int64_t t, int64_t *due)
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
        while (NAME(decide)(tour, l, j, s, t, 0) && l > 0)
            j /= tour->fan[--l];
    }
    return count;
}

/* Megatron's loop itself, VW datasets at a time, from step t0: every error (w: the weights,
 * 0 where spent; c: the counts as doubles, +inf where spent; m of each, a multiple of VW,
 * padded so), the largest, then the first dataset of that error (Megatron's strict >: the
 * first of the largest). For a few datasets, and for weights that keep the tree deciding
 * again most of its nodes at every step (grow). Returns 0, or -2 if every dataset is spent
 * first (exhaustive). */
static int
NAME(scan)(double *w, double *c, int64_t m, const int64_t *sizes, int64_t t0, int64_t size,
           int16_t *index, int64_t *sample, int64_t *count, double *errors)
{
    for (int64_t t = t0; t < size; t++) {
        double s = step_value(t);
        vec_t vs = V_SET(s), most = V_SET(-INFINITY);
        (void)vs;
        for (int64_t i = 0; i < m; i += VW) {
            vec_t e = V_ERROR(w + i, vs, s, c + i);
            V_STORE(errors + i, e);
            most = V_MAX(most, e);
        }
        double top = V_FIRST(V_ACROSS(most, V_MAX));
        if (top == -INFINITY) /* every dataset spent (exhaustive) */
            return -2;
        vec_t vtop = V_SET(top);
        int64_t best = 0;
        for (int64_t i = 0;; i += VW) {
            int mask = V_MASK(V_EQ(V_LOAD(errors + i), vtop));
            if (mask) {
                best = i + LOWEST_BIT((unsigned)mask);
                break;
            }
        }
        if (index != NULL) {
            index[t] = (int16_t)best;
            sample[t] = count[best];
        }
        count[best]++;
        c[best] = (double)count[best];
        if (sizes != NULL && (double)sizes[best] - c[best] == 0) /* spent */
            w[best] = 0.0, c[best] = INFINITY;
    }
    return 0;
}

/* Draw steps t0 to `size` with the tree: decide every node, then at each step decide again the
 * nodes due, draw the root's winner, decide its path, leaf to root. Returns `size`; or, where
 * the weights keep the tree deciding again more than datasets / SCAN_RATIO nodes a step over
 * SCAN_WINDOW steps (a node costs about what scan() pays for 100 datasets), the step it
 * stopped at, not drawn; or -2 if every dataset is spent first (exhaustive). */
static int64_t
NAME(run)(tournament_t *tour, const int64_t *sizes, int64_t t0, int64_t size, int16_t *index,
          int64_t *sample, int64_t *count, int64_t *due)
{
    for (int l = tour->levels - 1; l >= 0; l--)
        for (int64_t j = 0; j < tour->width[l]; j++)
            NAME(decide)(tour, l, j, step_value(t0), t0, 0);
    int64_t decided = 0;
    for (int64_t t = t0; t < size; t++) {
        decided += NAME(refresh)(tour, t, due);
        if (((t - t0) & (SCAN_WINDOW - 1)) == SCAN_WINDOW - 1) {
            if (decided > SCAN_WINDOW * (tour->datasets / SCAN_RATIO + 4))
                return t;
            decided = 0;
        }
        if (isinf(tour->c[0])) /* every dataset spent before `size` samples (exhaustive) */
            return -2;
        int64_t leaf, best = NAME(resolve)(tour, 0, 0, step_value(t), &leaf);
        /* the drawn dataset's new count, as Megatron casts it (exact below 2^53), from its
         * leaf's line rather than from count[] (one load less on the chain of samples) */
        double drawn = tour->c[tour->nodes + leaf] + 1.0;
        if (index != NULL) {
            index[t] = (int16_t)best;
            sample[t] = count[best];
        }
        count[best]++;
        if (sizes != NULL && (double)sizes[best] - drawn == 0) { /* spent (exhaustive) */
            NAME(store_lane)(tour->w, tour->nodes + leaf, 0.0);
            drawn = INFINITY;
        }
        NAME(store_lane)(tour->c, tour->nodes + leaf, drawn);
        /* the path, leaf to root, for step t + 1 */
        double s = step_value(t + 1);
        int64_t j = leaf;
        for (int l = tour->levels - 1; l > 0; l--) {
            j /= FAN;
            NAME(decide_vecs)(tour, l, j, s, t + 1, tour->levels - l, FAN / VW);
        }
        NAME(decide)(tour, 0, 0, s, t + 1, tour->levels);
    }
    return size;
}

/* Draw `size` samples: with the tree (run) while it decides few nodes a step; where the weights
 * tie so nearly that rounding decides (weights a few ulps apart, rounded twice), with
 * Megatron's loop (scan) for a span of steps, then the tree again, each span twice the last:
 * never much slower than the faster of the two. Returns 0, -1 (no memory) or -2 (every
 * dataset spent first: exhaustive). */
static int
NAME(grow)(tournament_t *tour, const int64_t *sizes, int64_t size, int16_t *index,
           int64_t *sample, int64_t *count, int64_t *due)
{
    int64_t n = tour->datasets, m = (n + 3) & ~(int64_t)3, span = SCAN_WINDOW, t = 0;
    void *w_block = NULL, *c_block = NULL, *e_block = NULL;
    double *w = NULL, *c = NULL, *errors = NULL;
    int status = 0;
    for (;;) {
        t = NAME(run)(tour, sizes, t, size, index, sample, count, due);
        if (t < 0 || t >= size) {
            status = t < 0 ? (int)t : 0;
            break;
        }
        if (w == NULL) {
            w = aligned_block(&w_block, (size_t)m * sizeof(double));
            c = aligned_block(&c_block, (size_t)m * sizeof(double));
            errors = aligned_block(&e_block, (size_t)m * sizeof(double));
            if (w == NULL || c == NULL || errors == NULL) {
                status = -1;
                break;
            }
            for (int64_t i = n; i < m; i++)
                w[i] = 0.0, c[i] = INFINITY;
        }
        for (int64_t p = tour->nodes; p < tour->nodes + n; p++) { /* the leaves, by dataset */
            w[tour->id[p]] = tour->w[p];
            c[tour->id[p]] = tour->c[p];
        }
        int64_t end = size - t > span ? t + span : size;
        status = NAME(scan)(w, c, m, sizes, t, end, index, sample, count, errors);
        if (status != 0 || end == size)
            break;
        for (int64_t p = tour->nodes; p < tour->nodes + n; p++) {
            tour->w[p] = w[tour->id[p]];
            tour->c[p] = c[tour->id[p]];
        }
        for (int64_t u = 0; u < tour->wheel + LANES; u++) /* the wheel, empty */
            tour->slot[u] = -1;
        tour->used = 0;
        t = end;
        span *= 2;
    }
    free(w_block);
    free(c_block);
    free(e_block);
    return status;
}

#undef vec_t
#undef V_OF
#undef V_LOAD
#undef V_STORE
#undef V_SET
#undef V_MUL
#undef V_SUB
#undef V_ADD
#undef V_ABS
#undef V_LE
#undef V_GE
#undef V_GT
#undef V_ERROR
#undef PRODUCT_NOISE
#undef S_ERROR
#undef GROWTH
#undef V_DIV
#undef V_MAX
#undef V_MIN
#undef V_TEST
#undef V_EQ
#undef V_BITS
#undef V_AND
#undef V_OR
#undef V_ANDNOT
#undef V_MASK
#undef V_FIRST
#undef V_ACROSS
#undef V_ACROSS_HALF
#undef NAME
#undef NAME_OF
#undef NAME_JOIN
#endif /* BLEND_TREE */
