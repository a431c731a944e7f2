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
 * holds the winner of its two children at the current step, decided with Megatron's own double
 * expression and its tie rule (the left child, of lower indices, wins a tie). Between picks an
 * error is a line in t, so a node's decision holds until the loser, if it grows faster, can
 * catch up. That moment is bounded conservatively: every computed error is within E of the
 * exact line (E, below, bounds both roundings for every step of the build), so while the exact
 * gap stays above 2E the computed comparison cannot change. A node is re-decided, with the
 * exact expression again, at the first step where that is no longer certain (and at every step
 * while two errors are within a few E of each other, as for weights whose products round to
 * the same double); a node whose two winners have the same weight never flips (the same
 * product, minus different integers, keeps its order). Each node keeps the earliest step at
 * which it or a node below it must be re-decided, so a step re-decides only those nodes, then
 * the path of the dataset just drawn: O(log datasets) per sample instead of O(datasets).
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
/* Up to this many datasets Megatron's plain loop is the faster (measured: the tree costs about
 * 270 ns a sample from 200 datasets to 300, the loop 1.1 ns a dataset) */
#define PLAIN_DATASETS 256

typedef struct {
    double w; /* weight */
    double c; /* count, as Megatron casts it to double; a spent dataset or padding: w 0, c +inf */
} line_t;

typedef struct {
    line_t *line;   /* the leaves, one a dataset: [0, n), padding up to `leaves` */
    int64_t *idx;   /* per internal node (1-based heap order, [1, leaves); leaf i is node
                     * leaves + i): the winner below it */
    int64_t *until; /* per internal node: the first step at which its decision may no longer
                     * hold (NEVER: it holds until its inputs change) */
    int64_t *next;  /* per internal node: the doubly linked list of its wheel slot */
    int64_t *prev;
    int64_t *slot;  /* the wheel: slot u & (wheel - 1) lists the nodes whose `until` is u */
    int64_t wheel;  /* a power of two */
    int64_t leaves; /* a power of two >= n */
    double margin;  /* E: the most a computed error differs from the exact line */
} tournament_t;

/* prev[k]: the node before k in its slot's list; UNLISTED; or HEAD(u): first of slot u */
#define UNLISTED (-1)
#define HEAD(u) (-3 - (u))

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

/* The first step at which a decision taken at step t may no longer hold, for a winner and a
 * loser of these weights, `gap` apart (the winner's error minus the loser's): while the loser
 * grows faster, the exact gap stays above 2E for (gap - 5E) / faster more steps (a step moves
 * max(t, 1) by at most 1); a loser that grows more slowly only falls behind; the same weight
 * gives the same product, minus counts that keep their order; too close to call: next step.
 * A side with no dataset left (error -inf) loses to any dataset, and
 * two of them, of equal weight 0, are never re-decided. */
static inline int64_t
holds_until(double margin, double w_winner, double w_loser, double gap, int64_t t)
{
    double faster = w_loser - w_winner;
    double steps = (gap - 5.0 * margin) / faster * (1.0 - 1e-12);
    steps = steps > 0.0 ? steps : 0.0; /* maxsd; NaN (a 0/0 of the cases below) gives 0 */
    int64_t until = t + 1 + (int64_t)(steps < 9.0e18 ? steps : 0.0);
    /* integer selects, which compilers make conditional moves */
    until = steps < 9.0e18 ? until : NEVER;
    until = faster < 0.0 ? NEVER : until;
    until = gap > 6.0 * margin ? until : t + 1;
    until = w_loser == w_winner ? NEVER : until;
    return until;
}

/* Node k's decision holds until step `until`: list it in that step's slot of the wheel. A
 * slot holds the steps u, u + wheel, u + 2 wheel...: a later one waits its turn. */
static inline void
schedule(tournament_t *tour, int64_t k, int64_t until)
{
    int64_t next = tour->next[k], prev = tour->prev[k];
    if (prev != UNLISTED) { /* off its former slot's list */
        if (prev >= 0)
            tour->next[prev] = next;
        else
            tour->slot[-3 - prev] = next;
        if (next >= 0)
            tour->prev[next] = prev;
    }
    tour->until[k] = until;
    if (until == NEVER) {
        tour->prev[k] = tour->next[k] = UNLISTED;
        return;
    }
    int64_t u = until & (tour->wheel - 1), head = tour->slot[u];
    tour->next[k] = head;
    tour->prev[k] = HEAD(u);
    if (head >= 0)
        tour->prev[head] = k;
    tour->slot[u] = k;
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
    int left_wins = e_left >= e_right; /* Megatron keeps the first of equal errors */
    /* selects by indexing, which compilers make no branch of (a coin toss to predict) */
    const double w[2] = {right.w, left.w}, gaps[2] = {e_right - e_left, e_left - e_right};
    const int64_t winner[2] = {b, a};
    double w_winner = w[left_wins], w_loser = w[!left_wins], gap = gaps[left_wins];
    int64_t was = tour->idx[k];
    tour->idx[k] = winner[left_wins];
    schedule(tour, k, holds_until(tour->margin, w_winner, w_loser, gap, t));
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
    int64_t best = drawn, child = tour->leaves + drawn;
    double w = tour->line[drawn].w, e = w * s - tour->line[drawn].c;
    for (int64_t k = child / 2; k >= 1; child = k, k /= 2) {
        int64_t other = winner_of(tour, child ^ 1);
        line_t line = tour->line[other];
        double e_other = line.w * s - line.c;
        /* Megatron keeps the first of equal errors: the left side wins a tie */
        int stays = (e > e_other) | ((e == e_other) & ((child & 1) == 0));
        const double ws[2] = {line.w, w}, es[2] = {e_other, e}, gaps[2] = {e_other - e, e - e_other};
        const int64_t winner[2] = {other, best};
        double w_winner = ws[stays], w_loser = ws[!stays], gap = gaps[stays];
        best = winner[stays];
        w = w_winner;
        e = es[stays];
        tour->idx[k] = best;
        schedule(tour, k, holds_until(margin, w_winner, w_loser, gap, t));
    }
}

/* Decide again, at step t, every node whose decision may no longer hold at t, and the nodes
 * above each whose winner changed. `due` is room for every internal node. */
static void
refresh(tournament_t *tour, int64_t t, int64_t *due)
{
    int64_t count = 0;
    for (int64_t k = tour->slot[t & (tour->wheel - 1)]; k >= 0; k = tour->next[k])
        if (tour->until[k] <= t)
            due[count++] = k;
    for (int64_t i = 0; i < count; i++) {
        int64_t k = due[i];
        if (tour->until[k] > t) /* decided again meanwhile, from below */
            continue;
        while (decide(tour, k, t) && k > 1)
            k /= 2;
    }
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
    tour.next = malloc(nodes * sizeof(int64_t));
    tour.prev = malloc(nodes * sizeof(int64_t));
    tour.slot = malloc((size_t)tour.wheel * sizeof(int64_t));
    int64_t *due = malloc(nodes * sizeof(int64_t));
    int status = 0;
    if (!tour.line || !tour.idx || !tour.until || !tour.next || !tour.prev || !tour.slot || !due) {
        status = -1;
        goto free_tree;
    }
    for (int64_t i = 0; i < tour.leaves; i++) {
        tour.line[i].w = i < n ? weights[i] : 0.0;
        tour.line[i].c = i < n ? 0.0 : INFINITY;
        tour.idx[i] = -1;
        tour.prev[i] = tour.next[i] = UNLISTED;
    }
    for (int64_t u = 0; u < tour.wheel; u++)
        tour.slot[u] = -1;
    for (int64_t k = tour.leaves - 1; k >= 1; k--)
        decide(&tour, k, 0);

    for (int64_t t = 0; t < size; t++) {
        refresh(&tour, t, due);
        int64_t best = tour.idx[1];
        line_t *line = &tour.line[best];
        if (isinf(line->c)) { /* every dataset spent before `size` samples (exhaustive) */
            status = -2;
            goto free_tree;
        }
        if (index != NULL) {
            index[t] = (int16_t)best;
            sample[t] = count[best];
        }
        count[best]++;
        line->c = (double)count[best];
        if (sizes != NULL && (double)sizes[best] - line->c == 0) /* spent (exhaustive) */
            line->w = 0.0, line->c = INFINITY;
        climb(&tour, best, t + 1);
    }
free_tree:
    free(tour.line);
    free(tour.idx);
    free(tour.until);
    free(tour.next);
    free(tour.prev);
    free(tour.slot);
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
