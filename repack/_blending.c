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

typedef struct {
    double w;   /* weight */
    double c;   /* count, as Megatron casts it to double; a spent dataset or padding: w 0, c +inf */
    int64_t id; /* the dataset (padding: INT64_MAX), which decides a tie: the lower wins */
} line_t;

typedef struct {
    line_t *line;   /* the leaves, the datasets by weight, padding up to `leaves` */
    int64_t *idx;   /* per internal node (1-based heap order, [1, leaves); leaf i is node
                     * leaves + i): the leaf that wins below it */
    int64_t *until; /* per internal node: the first step at which its decision may no longer
                     * hold (NEVER: it holds until its inputs change) */
    int64_t *slot;  /* the wheel: per slot u, its last entry (-1: none); then LANES more,
                     * written and never read (see schedule) */
    int64_t *entry; /* the entries: a node listed in a slot, for a step u, u + wheel, ... */
    int64_t *older; /* the slot's entry before this one */
    int64_t used;   /* entries in use */
    int64_t room;   /* entries there is room for */
    int64_t wheel;  /* a power of two */
    int64_t leaves; /* a power of two >= n */
    double margin;  /* E: the most a computed error differs from the exact line */
} tournament_t;


static inline double
step_value(int64_t t)
{
    return t > 1 ? (double)t : 1.0; /* Megatron's std::max(static_cast<double>(t), 1.0) */
}

static inline int64_t
winner_of(const tournament_t *tour, int64_t k)
{
    return k >= tour->leaves ? k - tour->leaves : tour->idx[k];
}

/* A number no larger than 1 / x, for x > 0 (any value for the others, which the caller does not
 * use). A division per node of every draw's path cost half the time of a draw; the processor's
 * reciprocal estimate (relative error below 1.5 * 2^-12), taken 2^-10 lower, costs a few
 * cycles. Where x is below float's range (2^-126) the estimate is +inf: the decision then
 * holds past the end of any build (its gap exceeds 2^-50 size, see holds_until), as NEVER says. */
#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
static inline double
reciprocal_below(double x)
{
    return (double)_mm_cvtss_f32(_mm_rcp_ss(_mm_set_ss((float)x))) * (1.0 - 1.0 / 1024);
}

static inline double
larger(double a, double b) /* maxsd: compilers branch on a ?: of doubles */
{
    return _mm_cvtsd_f64(_mm_max_sd(_mm_set_sd(a), _mm_set_sd(b)));
}

static inline double
clamp_steps(double steps) /* maxsd and minsd, as larger() */
{
    __m128d v = _mm_max_sd(_mm_set_sd(steps), _mm_setzero_pd()); /* NaN: 0 */
    return _mm_cvtsd_f64(_mm_min_sd(v, _mm_set_sd(9.0e18)));
}
#else
static inline double
reciprocal_below(double x)
{
    return 1.0 / x * (1.0 - 1e-12);
}

static inline double
larger(double a, double b)
{
    return a > b ? a : b;
}

static inline double
clamp_steps(double steps)
{
    return steps > 0.0 ? (steps < 9.0e18 ? steps : 9.0e18) : 0.0;
}
#endif

/* c ? a : b, which compilers make a conditional move for integers: no branch (which way a
 * node goes is a coin toss for the predictor) */
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

/* The first step at which a decision taken at step t may no longer hold, for a winner and a
 * loser of these weights, `gap` apart (the winner's error minus the loser's): while the loser
 * grows faster, the exact gap stays above 2E for (gap - 5E) / faster more steps (a step moves
 * max(t, 1) by at most 1); a loser that grows more slowly only falls behind; the same weight
 * gives the same product, minus counts that keep their order; too close to call: next step.
 * A side with no dataset left (error -inf) loses to any dataset, and
 * two of them, of equal weight 0, are never re-decided. */
static inline int64_t
holds_until(double margin, double faster, double gap, int same_weight, int64_t t)
{
    double steps = clamp_steps((gap - 5.0 * margin) * reciprocal_below(faster));
    int64_t until = t + 1 + (int64_t)steps;
    until = pick(steps >= 9.0e18, NEVER, until);
    until = pick(faster < 0.0, NEVER, until);
    until = pick(gap > 6.0 * margin, until, t + 1);
    return pick(same_weight, NEVER, until);
}

/* Whether holds_until() is NEVER for a reason known without its division (it is NEVER for
 * another only past 9e18 steps). */
static inline int
holds(double margin, double faster, double gap, int same_weight)
{
    return same_weight | ((faster < 0.0) & (gap > 6.0 * margin));
}

/* a ? x : y for doubles, without a branch (compilers branch on a double select) */
static inline double
select_double(int a, double x, double y)
{
    uint64_t bx, by, mask = (uint64_t)0 - (uint64_t)(a != 0);
    memcpy(&bx, &x, 8);
    memcpy(&by, &y, 8);
    bx = (bx & mask) | (by & ~mask);
    memcpy(&x, &bx, 8);
    return x;
}

/* -x if `flip`, else x, without a branch */
static inline double
flip_sign(double x, int flip)
{
    uint64_t bits;
    memcpy(&bits, &x, 8);
    bits ^= (uint64_t)(flip != 0) << 63;
    memcpy(&x, &bits, 8);
    return x;
}

/* Node k's decision holds until step `until`: list it in that step's slot of the wheel (a slot
 * holds the steps u, u + wheel, u + 2 wheel...: a later one waits its turn). An entry is never
 * taken off: `until` says whether it still counts, and the slot drops those that do not when
 * its step comes. `holds`: the decision holds until its inputs change, known without the
 * division that `until` waits for; such a node takes no entry. (Listed as `until` comes, the
 * nodes of a draw's path waited on each other's division: the processor cannot tell whether
 * one node's slot is the next one's before it ends.) */
static void compact(tournament_t *tour);

static inline void
schedule(tournament_t *tour, int64_t k, int64_t until, int holds, int64_t lane)
{
    /* without a branch on `holds` (a coin toss): a node that holds writes an entry that is not
     * kept, into a slot of its own lane past the wheel's, never read */
    tour->until[k] = until;
    int64_t u = pick(holds, tour->wheel + lane, until & (tour->wheel - 1)), e = tour->used;
    tour->entry[e] = k;
    tour->older[e] = tour->slot[u];
    tour->slot[u] = e;
    tour->used = e + !holds;
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
    for (int64_t k = 1; k < tour->leaves; k++)
        schedule(tour, k, tour->until[k], tour->until[k] == NEVER, 0);
}

/* Decide node k at step t from its children's winners; returns whether its winner changed. */
static inline int
decide(tournament_t *tour, int64_t k, int64_t t)
{
    int64_t a = winner_of(tour, 2 * k), b = winner_of(tour, 2 * k + 1);
    line_t left = tour->line[a], right = tour->line[b];
    double s = step_value(t);
    double e_left = left.w * s - left.c;
    double e_right = right.w * s - right.c;
    /* Megatron keeps the first of equal errors */
    int left_wins = (e_left > e_right) | ((e_left == e_right) & (left.id < right.id));
    double faster = select_double(left_wins, right.w - left.w, left.w - right.w);
    int64_t was = tour->idx[k];
    tour->idx[k] = left_wins ? a : b;
    double gap = fabs(e_left - e_right);
    int same = left.w == right.w;
    schedule(tour, k, holds_until(tour->margin, faster, gap, same, t),
             holds(tour->margin, faster, gap, same), 0);
    return tour->idx[k] != was;
}

/* Decide the path of dataset `drawn` (whose count just changed), leaf to root, for step t.
 * decide() for each node in turn would do, but keeps the running winner in registers: every
 * node of the path compares it with the winner of the other side, which is read and valued
 * independently of the levels below, so the processor overlaps the levels. */
static void
climb(tournament_t *tour, int64_t drawn, int64_t t)
{
    double s = step_value(t), margin = tour->margin;
    const line_t *line = tour->line;
    int64_t best = drawn, id = line[drawn].id, child = tour->leaves + drawn;
    double w = line[drawn].w, e = w * s - line[drawn].c;
    int64_t other = drawn ^ 1; /* the other leaf, then the winner of the other side */
    for (int64_t k = child / 2, lane = 1; k >= 1; child = k, k /= 2, lane++) {
        line_t them = line[other];
        double e_other = them.w * s - them.c;
        /* Megatron keeps the first of equal errors */
        int stays = (e > e_other) | ((e == e_other) & (id < them.id));
        /* the loser's weight less the winner's: them.w - w, negated if they win */
        double faster = flip_sign(them.w - w, !stays);
        double gap = fabs(e - e_other);
        int same = them.w == w;
        int64_t until = holds_until(margin, faster, gap, same, t);
        int hold = holds(margin, faster, gap, same);
        best = stays ? best : other;
        id = stays ? id : them.id;
        w = select_double(stays, w, them.w);
        e = larger(e, e_other); /* the winner's (equal errors: either) */
        tour->idx[k] = best;
        schedule(tour, k, until, hold, lane);
        other = k > 1 ? tour->idx[k ^ 1] : 0;
    }
}

/* Decide again, at step t, every node whose decision may no longer hold at t, and the nodes
 * above each whose winner changed. `due` is room for every internal node. */
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
    for (int64_t i = 0; i < count; i++) {
        int64_t k = due[i];
        if (tour->until[k] > t) /* decided again meanwhile, from below, or listed twice */
            continue;
        while (decide(tour, k, t) && k > 1)
            k /= 2;
    }
}

static int
by_weight(const void *a, const void *b)
{
    const line_t *x = a, *y = b;
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
    tour.leaves = 2;
    while (tour.leaves < n)
        tour.leaves *= 2;
    tour.wheel = tour.leaves;
    /* |computed - exact| <= 2^-53 (|w s| + |w s - c|) <= 2^-52 (largest + 1) size, for every
     * step of this build (s <= size, c <= size); four times that */
    double span = (double)(size > 1 ? size : 1) + 1.0;
    tour.margin = ldexp((largest + 1.0) * span, -50);
    size_t nodes = (size_t)tour.leaves;
    tour.line = malloc(nodes * sizeof *tour.line);
    tour.idx = malloc(nodes * sizeof(int64_t));
    tour.until = malloc(nodes * sizeof(int64_t));
    tour.room = 8 * tour.leaves;
    tour.used = 0;
    tour.slot = malloc((size_t)(tour.wheel + LANES) * sizeof(int64_t));
    tour.entry = malloc((size_t)tour.room * sizeof(int64_t));
    tour.older = malloc((size_t)tour.room * sizeof(int64_t));
    int64_t *due = malloc(nodes * sizeof(int64_t));
    int status = 0;
    if (!tour.line || !tour.idx || !tour.until || !tour.slot || !tour.entry || !tour.older ||
        !due) {
        status = -1;
        goto free_tree;
    }
    /* the leaves in order of weight: neighbours of like weight rarely overtake one another
     * between draws, so the lower nodes are seldom decided again (the tie rule compares the
     * datasets themselves, not their places) */
    for (int64_t i = 0; i < tour.leaves; i++) {
        tour.line[i].w = i < n ? weights[i] : 0.0;
        tour.line[i].c = i < n ? 0.0 : INFINITY;
        tour.line[i].id = i < n ? i : INT64_MAX;
        tour.idx[i] = -1;
        tour.until[i] = NEVER;
    }
    qsort(tour.line, (size_t)n, sizeof *tour.line, by_weight);
    for (int64_t u = 0; u < tour.wheel; u++)
        tour.slot[u] = -1;
    for (int64_t k = tour.leaves - 1; k >= 1; k--)
        decide(&tour, k, 0);

    for (int64_t t = 0; t < size; t++) {
        refresh(&tour, t, due);
        int64_t leaf = tour.idx[1];
        line_t *line = &tour.line[leaf];
        if (isinf(line->c)) { /* every dataset spent before `size` samples (exhaustive) */
            status = -2;
            goto free_tree;
        }
        int64_t best = line->id;
        if (index != NULL) {
            index[t] = (int16_t)best;
            sample[t] = count[best];
        }
        count[best]++;
        line->c = (double)count[best];
        if (sizes != NULL && (double)sizes[best] - line->c == 0) /* spent (exhaustive) */
            line->w = 0.0, line->c = INFINITY;
        climb(&tour, leaf, t + 1);
    }
free_tree:
    free(tour.line);
    free(tour.idx);
    free(tour.until);
    free(tour.slot);
    free(tour.entry);
    free(tour.older);
    free(due);
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
