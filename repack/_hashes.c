/* repack._hashes: the XXH3-64 of many byte ranges of one buffer in one call, without the GIL.
 *
 * A document fingerprint is the XXH3-64 of the document's token bytes (docs/format.md 2.11).
 * One Python call of xxhash.xxh3_64_intdigest per document costs about 0.2-0.3 us whatever
 * the document's size, which made a merge with fingerprints 1.3x `cat` and the doctor's
 * --duplicates on 10^8 short documents 35x `cat`; this loop costs the bytes alone, and lets
 * the copy thread run while it hashes. Optional: where it was not built, repack hashes in
 * Python (repack/fingerprints.py), the same values.
 *
 * xxh3_64_ranges(data, starts, ends, out): for every i, out[i] = XXH3_64bits(data[starts[i]
 * : ends[i]]); data any C-contiguous bytes-like object, starts and ends int64 and out uint64
 * native-endian contiguous buffers (numpy arrays) of the same length. Raises ValueError,
 * writing nothing past the bad range, when a range is not within data.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
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

static PyMethodDef methods[] = {
    {"xxh3_64_ranges", xxh3_64_ranges, METH_VARARGS,
     "xxh3_64_ranges(data, starts, ends, out): out[i] = XXH3-64 of data[starts[i]:ends[i]]\n"
     "for every i (int64 starts and ends, uint64 out, all of one length), without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "repack._hashes",
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
