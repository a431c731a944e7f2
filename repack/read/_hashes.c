/* repack.read._hashes: the XXH3-64 of many byte ranges of one buffer in one call, without the GIL;
 * and a radix sort of 32-bit values (sort_u32, below), for the doctor's duplicate analysis.
 *
 * A document fingerprint is the XXH3-64 of the document's token bytes (docs/format.md 2.11).
 * One Python call of xxhash.xxh3_64_intdigest per document costs about 0.2-0.3 us whatever
 * the document's size, which made a merge with fingerprints 1.3x `cat` and the doctor's
 * --duplicates on 10^8 short documents 35x `cat`; this loop costs the bytes alone, and lets
 * the copy thread run while it hashes. Optional: where it was not built, repack hashes in
 * Python (repack/read/fingerprints.py), the same values.
 *
 * xxh3_64_ranges(data, starts, ends, out): for every i, out[i] = XXH3_64bits(data[starts[i]
 * : ends[i]]); data any C-contiguous bytes-like object, starts and ends int64 and out uint64
 * native-endian contiguous buffers (numpy arrays) of the same length. Raises ValueError,
 * writing nothing past the bad range, when a range is not within data.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

static int
same_length(Py_buffer *view, Py_ssize_t count, const char *name)
{
    if (view->len != count * 8) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd (8 per range)", name,
                     view->len, count * 8);
        return 0;
    }
    return 1;
}

static PyObject *
xxh3_64_ranges(PyObject *module, PyObject *args)
{
    Py_buffer data, starts, ends, out;
    PyObject *result = NULL;
    Py_ssize_t count, bad = -1, i;

    if (!PyArg_ParseTuple(args, "y*y*y*w*:xxh3_64_ranges", &data, &starts, &ends, &out))
        return NULL;
    if (starts.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "starts: not a whole number of int64");
        goto done;
    }
    count = starts.len / 8;
    if (!same_length(&ends, count, "ends") || !same_length(&out, count, "out"))
        goto done;

    Py_BEGIN_ALLOW_THREADS
    const char *bytes = (const char *)data.buf;
    const char *lo = (const char *)starts.buf, *hi = (const char *)ends.buf;
    char *dst = (char *)out.buf;
    for (i = 0; i < count; i++) {
        int64_t start, end;
        uint64_t hash;
        memcpy(&start, lo + 8 * i, 8); /* no alignment assumed */
        memcpy(&end, hi + 8 * i, 8);
        if (start < 0 || end < start || end > (int64_t)data.len) {
            bad = i;
            break;
        }
        hash = XXH3_64bits(bytes + start, (size_t)(end - start));
        memcpy(dst + 8 * i, &hash, 8);
    }
    Py_END_ALLOW_THREADS

    if (bad >= 0) {
        int64_t start, end;
        memcpy(&start, (const char *)starts.buf + 8 * bad, 8);
        memcpy(&end, (const char *)ends.buf + 8 * bad, 8);
        PyErr_Format(PyExc_ValueError, "range %zd: [%lld, %lld) is not within %zd bytes", bad,
                     (long long)start, (long long)end, data.len);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&ends);
    PyBuffer_Release(&out);
    return result;
}

/* sort_u32(values, scratch): sort the uint32 buffer values in place, least significant byte
 * first (4 counting passes; a pass whose byte is the same in every value is skipped), through
 * scratch, a writable buffer of at least the same size. numpy's sort is as fast on most CPUs,
 * but its AVX-512 sort of 32-bit values runs 6-7x slower on AMD Zen 4 (a microcoded
 * compress-to-memory instruction): 4 s for the 10^8 fingerprints of docs/benchmarks.md's
 * duplicate benchmark, against 0.6 s here. */
static PyObject *
sort_u32(PyObject *module, PyObject *args)
{
    Py_buffer values, scratch;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "w*w*:sort_u32", &values, &scratch))
        return NULL;
    if (values.len % 4 != 0) {
        PyErr_SetString(PyExc_ValueError, "values: not a whole number of uint32");
        goto done;
    }
    if (scratch.len < values.len) {
        PyErr_Format(PyExc_ValueError, "scratch: %zd bytes, at least %zd needed", scratch.len,
                     values.len);
        goto done;
    }
    Py_ssize_t count = values.len / 4;
    size_t(*counts)[256] = calloc(4, sizeof *counts);
    if (counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    uint32_t *from = (uint32_t *)values.buf, *to = (uint32_t *)scratch.buf;
    Py_ssize_t i;
    for (i = 0; i < count; i++) {
        uint32_t v = from[i];
        counts[0][v & 0xff]++;
        counts[1][(v >> 8) & 0xff]++;
        counts[2][(v >> 16) & 0xff]++;
        counts[3][v >> 24]++;
    }
    for (int pass = 0; pass < 4; pass++) {
        size_t *c = counts[pass], total = 0;
        int shift = 8 * pass, digit;
        if (count == 0 || c[(from[0] >> shift) & 0xff] == (size_t)count)
            continue; /* one value of this byte: already in order by it */
        for (digit = 0; digit < 256; digit++) {
            size_t n = c[digit];
            c[digit] = total;
            total += n;
        }
        for (i = 0; i < count; i++) {
            uint32_t v = from[i];
            to[c[(v >> shift) & 0xff]++] = v;
        }
        uint32_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != (uint32_t *)values.buf)
        memcpy(values.buf, from, (size_t)count * 4);
    Py_END_ALLOW_THREADS
    free(counts);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&scratch);
    return result;
}

static PyMethodDef methods[] = {
    {"sort_u32", sort_u32, METH_VARARGS,
     "sort_u32(values, scratch): sort the uint32 array values in place (a radix sort through\n"
     "scratch, a writable buffer at least as large), without the GIL."},
    {"xxh3_64_ranges", xxh3_64_ranges, METH_VARARGS,
     "xxh3_64_ranges(data, starts, ends, out): out[i] = XXH3-64 of data[starts[i]:ends[i]]\n"
     "for every i (int64 starts and ends, uint64 out, all of one length), without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "repack.read._hashes",
    "XXH3-64 of many byte ranges in one call (repack's document fingerprints).", -1, methods,
};

PyMODINIT_FUNC
PyInit__hashes(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "XXH_VERSION", XXH_VERSION_NUMBER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
