/* kvplug._speedups: the compiled kernels of kvplug.speedups (see that module for the reference
 * Python versions, which define the behaviour; tests run both).
 *
 * Why C: the radix tree's per-request cost is Python bytecode over ~60-120 nodes (the walk, the
 * lock walks, the hit stamps) and a dozen small NumPy calls for the allocator's checks. Each
 * kernel here is one call doing that loop.
 *
 * Node fields are read and written through the offsets of their __slots__ (what the slot's
 * member descriptor does), found once per node class by bind_node_type(). A node whose exact
 * type is not the bound class is refused with TypeError (the Python side never passes one).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

/* -- node layout ------------------------------------------------------------------------------ */

enum { F_CHILDREN, F_KEY, F_NUM_TOKENS, F_PARENT, F_LOCK_REF, F_LAST_ACCESS, F_HIT_COUNT, F_COUNT };
static const char *field_names[F_COUNT] = {
    "children", "key", "num_tokens", "parent", "lock_ref", "last_access_time", "hit_count"};

static PyTypeObject *node_type = NULL; /* strong reference */
static Py_ssize_t offsets[F_COUNT];

static PyObject *bind_node_type(PyObject *Py_UNUSED(self), PyObject *cls) {
    Py_ssize_t found[F_COUNT];
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "bind_node_type takes a class");
        return NULL;
    }
    for (int i = 0; i < F_COUNT; i++) {
        PyObject *d = PyObject_GetAttrString(cls, field_names[i]);
        if (d == NULL) return NULL;
        if (!Py_IS_TYPE(d, &PyMemberDescr_Type) ||
            ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
            Py_DECREF(d);
            PyErr_Format(PyExc_TypeError, "%R.%s is not a __slots__ field", cls, field_names[i]);
            return NULL;
        }
        found[i] = ((PyMemberDescrObject *)d)->d_member->offset;
        Py_DECREF(d);
    }
    Py_INCREF(cls);
    Py_XSETREF(node_type, (PyTypeObject *)cls);
    memcpy(offsets, found, sizeof(offsets));
    Py_RETURN_NONE;
}

#define SLOT(obj, f) (*(PyObject **)((char *)(obj) + offsets[f]))

static int check_node(PyObject *node) {
    if (node_type == NULL || Py_TYPE(node) != node_type) {
        PyErr_Format(PyExc_TypeError, "expected a bound node (%R), got %R",
                     (PyObject *)node_type, (PyObject *)Py_TYPE(node));
        return -1;
    }
    return 0;
}

/* A field's value (borrowed); AttributeError when the slot is unset. */
static PyObject *get_field(PyObject *node, int f) {
    PyObject *v = SLOT(node, f);
    if (v == NULL) PyErr_Format(PyExc_AttributeError, "node field '%s' is not set", field_names[f]);
    return v;
}

static void set_field(PyObject *node, int f, PyObject *value) { /* steals value */
    Py_XSETREF(SLOT(node, f), value);
}

static int get_long_field(PyObject *node, int f, long long *out) {
    PyObject *v = get_field(node, f);
    if (v == NULL) return -1;
    *out = PyLong_AsLongLong(v);
    if (*out == -1 && PyErr_Occurred()) return -1;
    return 0;
}

static int set_long_field(PyObject *node, int f, long long value) {
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL) return -1;
    set_field(node, f, v);
    return 0;
}

/* -- walk ------------------------------------------------------------------------------------- */

/* The key being walked: a tuple of ints, or a 1-D buffer of int64 (SGLang's array('q') of a
 * request's tokens), read in place so no token is boxed unless a dict lookup needs it. */
typedef struct {
    PyObject *tuple; /* NULL for a buffer */
    Py_buffer view;
    const int64_t *buf;
    Py_ssize_t len;
} Tokens;

/* A 1-D C-contiguous buffer of int64 ("q" or "l" items of 8 bytes); TypeError `error` if not. */
static int open_int64(PyObject *obj, Py_buffer *view, const char *error) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_SetString(PyExc_TypeError, error);
        return -1;
    }
    const char *f = view->format;
    if (view->ndim != 1 || view->itemsize != 8 || f == NULL ||
        (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, error);
        return -1;
    }
    return 0;
}

static int tokens_open(PyObject *ids, Tokens *t) {
    t->tuple = NULL;
    t->buf = NULL;
    if (PyTuple_Check(ids)) {
        t->tuple = ids;
        t->len = PyTuple_GET_SIZE(ids);
        return 0;
    }
    if (open_int64(ids, &t->view, "walk: ids must be a tuple or a 1-D int64 buffer") < 0)
        return -1;
    t->buf = (const int64_t *)t->view.buf;
    t->len = t->view.shape[0];
    return 0;
}

static void tokens_close(Tokens *t) {
    if (t->tuple == NULL) PyBuffer_Release(&t->view);
}

/* ids[pos:pos+n] as a new tuple (the dict key of a page). */
static PyObject *tokens_slice(const Tokens *t, Py_ssize_t pos, Py_ssize_t n) {
    if (t->tuple != NULL) return PyTuple_GetSlice(t->tuple, pos, pos + n);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(t->buf[pos + i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* 1 when ids[pos:pos+n] equals the tuple `key` of length n, 0 when not, -1 on error. */
static int range_equal(const Tokens *t, Py_ssize_t pos, PyObject *key, Py_ssize_t n) {
    PyObject **b = &PyTuple_GET_ITEM(key, 0);
    if (t->tuple != NULL) {
        PyObject **a = &PyTuple_GET_ITEM(t->tuple, pos);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (a[i] == b[i]) continue;
            int eq = PyObject_RichCompareBool(a[i], b[i], Py_EQ);
            if (eq <= 0) return eq;
        }
        return 1;
    }
    const int64_t *a = t->buf + pos;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyLong_CheckExact(b[i])) { /* the tree's keys: plain ints */
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(b[i], &overflow);
            if (v == -1 && PyErr_Occurred()) return -1;
            if (overflow || v != a[i]) return 0;
            continue;
        }
        PyObject *v = PyLong_FromLongLong(a[i]); /* another int-like key element */
        if (v == NULL) return -1;
        int eq = PyObject_RichCompareBool(v, b[i], Py_EQ);
        Py_DECREF(v);
        if (eq <= 0) return eq;
    }
    return 1;
}

/* A buffer key's child by pages among few children: each child's dict key (its first page, under
 * the root with the namespace) is compared with ids[pos:pos+page] in place, so no page tuple is
 * built; the dict keys are distinct, so this finds the child the dict lookup would. */
enum { SCAN_CHILDREN = 8 };

static PyObject *scan_children(PyObject *children, const Tokens *t, Py_ssize_t pos,
                               Py_ssize_t page, PyObject *extra_key) {
    Py_ssize_t i = 0;
    PyObject *key, *child;
    while (PyDict_Next(children, &i, &key, &child)) {
        PyObject *first = key;
        if (extra_key != NULL) {
            if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) continue;
            int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(key, 0), extra_key, Py_EQ);
            if (same < 0) return NULL;
            if (!same) continue;
            first = PyTuple_GET_ITEM(key, 1);
        }
        if (!PyTuple_Check(first) || PyTuple_GET_SIZE(first) != page) continue;
        int eq = range_equal(t, pos, first, page);
        if (eq < 0) return NULL;
        if (eq) return child;
    }
    return NULL;
}

/* The child of `node` that starts at ids[pos] (borrowed), or NULL with no error when none. */
static PyObject *child_at(PyObject *node, const Tokens *t, Py_ssize_t pos, Py_ssize_t page,
                          PyObject *extra_key) {
    PyObject *children = get_field(node, F_CHILDREN), *first, *key, *child;
    if (children == NULL) return NULL;
    if (!PyDict_Check(children)) {
        PyErr_SetString(PyExc_TypeError, "node.children must be a dict");
        return NULL;
    }
    if (page > 1 && t->tuple == NULL && PyDict_GET_SIZE(children) <= SCAN_CHILDREN)
        return scan_children(children, t, pos, page, extra_key);
    if (page == 1 && t->tuple != NULL) {
        first = PyTuple_GET_ITEM(t->tuple, pos);
        Py_INCREF(first);
    } else if (page == 1) {
        first = PyLong_FromLongLong(t->buf[pos]);
    } else {
        first = tokens_slice(t, pos, page);
    }
    if (first == NULL) return NULL;
    if (extra_key != NULL) {
        key = PyTuple_Pack(2, extra_key, first);
        Py_DECREF(first);
        if (key == NULL) return NULL;
    } else {
        key = first;
    }
    child = PyDict_GetItemWithError(children, key);
    Py_DECREF(key);
    return child;
}

static PyObject *walk(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *root, *node, *ids, *extra_key, *child, *path, *mismatch = Py_None;
    Py_ssize_t pos, end, page;
    Tokens t;
    if (!PyArg_ParseTuple(args, "OOOnnnO:walk", &root, &node, &ids, &pos, &end, &page,
                          &extra_key))
        return NULL;
    if (tokens_open(ids, &t) < 0) return NULL;
    if (page < 1 || pos < 0 || end > t.len) {
        tokens_close(&t);
        PyErr_SetString(PyExc_ValueError, "walk: bad page size or range");
        return NULL;
    }
    path = PyList_New(0);
    if (path == NULL) goto fail;
    if (pos < end) {
        if (check_node(node) < 0) goto fail;
        child = child_at(node, &t, pos, page, node == root ? extra_key : NULL);
        while (child != NULL) {
            long long num_tokens;
            PyObject *key;
            if (check_node(child) < 0 || get_long_field(child, F_NUM_TOKENS, &num_tokens) < 0)
                goto fail;
            key = get_field(child, F_KEY);
            if (key == NULL) goto fail;
            if (pos + num_tokens > end || !PyTuple_Check(key) ||
                PyTuple_GET_SIZE(key) != num_tokens) {
                mismatch = child; /* the match ends inside this node: the caller splits it */
                break;
            }
            int eq = range_equal(&t, pos, key, (Py_ssize_t)num_tokens);
            if (eq < 0) goto fail;
            if (!eq) {
                mismatch = child;
                break;
            }
            if (PyList_Append(path, child) < 0) goto fail;
            node = child;
            pos += (Py_ssize_t)num_tokens;
            if (pos >= end) break;
            child = child_at(node, &t, pos, page, NULL);
        }
        if (PyErr_Occurred()) goto fail;
    }
    tokens_close(&t);
    return Py_BuildValue("(OnNO)", node, pos, path, mismatch);
fail:
    tokens_close(&t);
    Py_XDECREF(path);
    return NULL;
}

/* -- statistics and locks --------------------------------------------------------------------- */

static PyObject *stamp_hits(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *path, *now;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "O!nO:stamp_hits", &PyList_Type, &path, &count, &now)) return NULL;
    if (count > PyList_GET_SIZE(path)) count = PyList_GET_SIZE(path);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *node = PyList_GET_ITEM(path, i);
        long long hits;
        if (check_node(node) < 0 || get_long_field(node, F_HIT_COUNT, &hits) < 0) return NULL;
        if (set_long_field(node, F_HIT_COUNT, hits + 1) < 0) return NULL;
        Py_INCREF(now);
        set_field(node, F_LAST_ACCESS, now);
    }
    Py_RETURN_NONE;
}

static PyObject *lock_path(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *node, *root;
    int delta;
    long long moved = 0;
    if (!PyArg_ParseTuple(args, "OOi:lock_path", &node, &root, &delta)) return NULL;
    if (delta != 1 && delta != -1) {
        PyErr_SetString(PyExc_ValueError, "lock_path: delta is 1 or -1");
        return NULL;
    }
    /* checked first: a failure changes nothing */
    for (PyObject *up = node; up != root; up = SLOT(up, F_PARENT)) {
        long long lock_ref, num_tokens;
        if (up == NULL || up == Py_None) {
            PyErr_SetString(PyExc_ValueError, "lock_path: the node is not under this root");
            return NULL;
        }
        if (check_node(up) < 0 || get_long_field(up, F_LOCK_REF, &lock_ref) < 0 ||
            get_long_field(up, F_NUM_TOKENS, &num_tokens) < 0)
            return NULL;
        if (delta < 0 && lock_ref < 1) {
            PyErr_SetString(PyExc_ValueError, "lock_path: a lock count would go negative");
            return NULL;
        }
    }
    for (PyObject *up = node; up != root; up = SLOT(up, F_PARENT)) {
        long long lock_ref, num_tokens;
        get_long_field(up, F_LOCK_REF, &lock_ref);
        get_long_field(up, F_NUM_TOKENS, &num_tokens);
        if (delta > 0 && lock_ref == 0) moved += num_tokens;
        if (delta < 0 && lock_ref == 1) moved += num_tokens;
        if (set_long_field(up, F_LOCK_REF, lock_ref + delta) < 0) return NULL;
    }
    return PyLong_FromLongLong(moved);
}

/* -- allocator checks ------------------------------------------------------------------------- */

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable,
                      const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT |
                                          (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->itemsize != itemsize || view->ndim != 1) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s: a 1-D array of %zd-byte items is needed", what,
                     itemsize);
        return -1;
    }
    return 0;
}

/* Paged slots come as runs of consecutive ids, a page (or many) at a time. One pass finds the
 * extremes and, when there are at most MAX_RUNS runs, the runs themselves; on them the checks
 * below need one step per page instead of one per slot. */
#define MAX_RUNS 256

typedef struct {
    Py_ssize_t start, end; /* positions: idx[start:end] are consecutive ids */
} slot_run;

/* lo / hi of idx[0:n] (0 / -1 when empty), and its runs into runs[]; returns how many, or -1
 * when there are more than MAX_RUNS (lo / hi are still right). */
static Py_ssize_t scan_runs(const int64_t *idx, Py_ssize_t n, long long *lo, long long *hi,
                            slot_run *runs) {
    Py_ssize_t r = 0;
    *lo = 0;
    *hi = -1;
    if (n == 0) return 0;
    *lo = *hi = idx[0];
    for (Py_ssize_t i = 0, j; i < n; i = j) {
        if (r == MAX_RUNS) { /* too many runs: the rest's extremes, slot by slot */
            for (; i < n; i++) {
                if (idx[i] < *lo) *lo = idx[i];
                if (idx[i] > *hi) *hi = idx[i];
            }
            return -1;
        }
        for (j = i + 1; j < n && idx[j - 1] < INT64_MAX && idx[j] == idx[j - 1] + 1; j++) {
        }
        if (idx[i] < *lo) *lo = idx[i];
        if (idx[j - 1] > *hi) *hi = idx[j - 1];
        runs[r].start = i;
        runs[r++].end = j;
    }
    return r;
}

/* The per-page checks on the runs of ids in range (>= 0), for div > 1: when no page is touched
 * by two runs, the ids are distinct (a run's ids are, and runs on distinct pages share none) and
 * the owner check reads each page once. Each page of each run gets its run's start position in
 * unit_scratch (longer than hi / div), then reads it back. Returns 0 when two runs share a page
 * (the caller scans slot by slot); 1 when decided: *first_bad is the first position whose page
 * fails (state[u] == 0 when require < 0, else state[u] != require; -1: none, or no state). */
static int check_page_runs(const int64_t *idx, const slot_run *runs, Py_ssize_t r, long long div,
                           int64_t *unit_scratch, const int8_t *state, long long require,
                           long long *first_bad) {
    for (Py_ssize_t k = 0; k < r; k++)
        for (int64_t u = idx[runs[k].start] / div; u <= idx[runs[k].end - 1] / div; u++)
            unit_scratch[u] = runs[k].start;
    *first_bad = -1;
    for (Py_ssize_t k = 0; k < r; k++) {
        int64_t first = idx[runs[k].start];
        for (int64_t u = first / div; u <= idx[runs[k].end - 1] / div; u++) {
            if (unit_scratch[u] != runs[k].start) return 0;
            if (state && *first_bad < 0 && (require < 0 ? state[u] == 0 : state[u] != require))
                *first_bad = runs[k].start + (u * div > first ? u * div - first : 0);
        }
    }
    return 1;
}

/* check_slots(idx int64[n], state int8[units], div, require, low, high, scratch int64[],
 * set_to) -> (lo, hi, first_dup, first_bad). lo/hi are the extremes; when one is outside
 * [low, high] the other two are -1 and nothing else was read. first_dup: the first position
 * whose slot appears again later in idx; first_bad: the first position whose unit
 * (slot // div) is FREE (require < 0) or not in state `require`. -1: none. When every check
 * passed and set_to >= 0, each unit's state becomes set_to (a checked ownership change). */
static PyObject *check_slots(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *idx_obj, *state_obj, *scratch_obj;
    long long div, require, low, high, set_to = -1;
    Py_buffer idx_b, state_b, scratch_b;
    slot_run runs[MAX_RUNS];
    if (!PyArg_ParseTuple(args, "OOLLLLO|L:check_slots", &idx_obj, &state_obj, &div, &require,
                          &low, &high, &scratch_obj, &set_to))
        return NULL;
    if (div < 1) {
        PyErr_SetString(PyExc_ValueError, "check_slots: div must be >= 1");
        return NULL;
    }
    if (get_buffer(idx_obj, &idx_b, 8, 0, "check_slots idx") < 0) return NULL;
    const int64_t *idx = (const int64_t *)idx_b.buf;
    Py_ssize_t n = idx_b.shape[0];
    long long lo, hi, first_dup = -1, first_bad = -1;
    Py_ssize_t r = scan_runs(idx, n, &lo, &hi, runs);
    if (n == 0 || lo < low || hi > high || state_obj == Py_None) {
        PyBuffer_Release(&idx_b);
        return Py_BuildValue("(LLLL)", lo, hi, first_dup, first_bad);
    }
    if (get_buffer(state_obj, &state_b, 1, set_to >= 0, "check_slots state") < 0) {
        PyBuffer_Release(&idx_b);
        return NULL;
    }
    if (get_buffer(scratch_obj, &scratch_b, 8, 1, "check_slots scratch") < 0) {
        PyBuffer_Release(&idx_b);
        PyBuffer_Release(&state_b);
        return NULL;
    }
    const int8_t *state = (const int8_t *)state_b.buf;
    int64_t *scratch = (int64_t *)scratch_b.buf;
    if (hi >= scratch_b.shape[0] || hi / div >= state_b.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "check_slots: scratch or state is too short");
    } else {
        /* scratch (longer than hi) also holds the page check's hi / div units */
        int by_pages = div > 1 && lo >= 0 && r >= 0 &&
                       check_page_runs(idx, runs, r, div, scratch, state, require, &first_bad);
        if (!by_pages) {
            first_bad = -1;
            for (Py_ssize_t i = 0; i < n; i++) scratch[idx[i]] = i;
            for (Py_ssize_t i = 0; i < n; i++) {
                if (first_dup < 0 && scratch[idx[i]] != i) first_dup = i;
                if (first_bad < 0) {
                    int8_t s = state[idx[i] / div];
                    if (require < 0 ? s == 0 : s != require) first_bad = i;
                }
                if (first_dup >= 0 && first_bad >= 0) break;
            }
        }
        if (set_to >= 0 && first_dup < 0 && first_bad < 0) {
            int8_t *out = (int8_t *)state_b.buf;
            if (by_pages) {
                for (Py_ssize_t k = 0; k < r; k++)
                    for (int64_t u = idx[runs[k].start] / div; u <= idx[runs[k].end - 1] / div;
                         u++)
                        out[u] = (int8_t)set_to;
            } else {
                for (Py_ssize_t i = 0; i < n; i++) out[idx[i] / div] = (int8_t)set_to;
            }
        }
    }
    PyBuffer_Release(&idx_b);
    PyBuffer_Release(&state_b);
    PyBuffer_Release(&scratch_b);
    if (PyErr_Occurred()) return NULL;
    return Py_BuildValue("(LLLL)", lo, hi, first_dup, first_bad);
}

/* release_slots(idx int64[n], state int8[] | None, div, low, high, scratch int64[],
 * unit_scratch int64[], units_out int64[], ids int64[], top) -> (lo, hi, first_dup, first_bad, k):
 * a checked free into a free-id stack, in one call. The checks of check_slots with require = not
 * FREE; when all pass, the distinct units (slot // div; every slot when div == 1) are counted
 * (k) and, when k <= top, written to ids[top - k:top] and marked FREE in state. The caller moves
 * its top down by k. Any failed check, or k > top, changes nothing. */
static PyObject *release_slots(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *idx_obj, *state_obj, *scratch_obj, *unit_scratch_obj, *units_obj, *ids_obj;
    long long div, low, high, top, lo = 0, hi = -1, first_dup = -1, first_bad = -1, k = 0;
    Py_buffer b[6];
    slot_run runs[MAX_RUNS];
    int got = 0, ok = 1;
    if (!PyArg_ParseTuple(args, "OOLLLOOOOL:release_slots", &idx_obj, &state_obj, &div, &low,
                          &high, &scratch_obj, &unit_scratch_obj, &units_obj, &ids_obj, &top))
        return NULL;
    if (div < 1 || top < 0) {
        PyErr_SetString(PyExc_ValueError, "release_slots: div must be >= 1 and top >= 0");
        return NULL;
    }
    PyObject *objs[6] = {idx_obj, state_obj, scratch_obj, unit_scratch_obj, units_obj, ids_obj};
    const Py_ssize_t sizes[6] = {8, 1, 8, 8, 8, 8};
    const int writable[6] = {0, 1, 1, 1, 1, 1};
    for (; got < 6; got++) {
        if (got == 1 && state_obj == Py_None) {
            b[got].obj = NULL;
            continue;
        }
        if (get_buffer(objs[got], &b[got], sizes[got], writable[got], "release_slots") < 0) break;
    }
    if (got < 6) goto done;
    const int64_t *idx = (const int64_t *)b[0].buf;
    int8_t *state = state_obj == Py_None ? NULL : (int8_t *)b[1].buf;
    int64_t *scratch = (int64_t *)b[2].buf, *unit_scratch = (int64_t *)b[3].buf;
    int64_t *units = (int64_t *)b[4].buf, *ids = (int64_t *)b[5].buf;
    Py_ssize_t n = b[0].shape[0];
    Py_ssize_t r = scan_runs(idx, n, &lo, &hi, runs);
    if (n == 0 || lo < low || hi > high) goto done; /* nothing read or changed */
    if (top > b[5].shape[0] || (state && (hi >= b[2].shape[0] || hi / div >= b[1].shape[0])) ||
        (div > 1 && (hi / div >= b[3].shape[0] || b[4].shape[0] < n))) {
        PyErr_SetString(PyExc_ValueError, "release_slots: a buffer is too short");
        ok = 0;
        goto done;
    }
    /* pages touched by one run each: checked per page, and each page is a distinct unit, in
     * run order (the last-occurrence order of the slot-by-slot path below) */
    int by_pages = div > 1 && lo >= 0 && r >= 0 &&
                   check_page_runs(idx, runs, r, div, unit_scratch, state, -1, &first_bad);
    if (state && !by_pages) {
        first_bad = -1;
        for (Py_ssize_t i = 0; i < n; i++) scratch[idx[i]] = i;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (first_dup < 0 && scratch[idx[i]] != i) first_dup = i;
            if (first_bad < 0 && state[idx[i] / div] == 0) first_bad = i;
            if (first_dup >= 0 && first_bad >= 0) break;
        }
    }
    if (first_dup >= 0 || first_bad >= 0) goto done;
    if (div == 1) {
        k = n;
        if (k > top) goto done;
        for (Py_ssize_t i = 0; i < n; i++) ids[top - k + i] = idx[i];
    } else if (by_pages) {
        for (Py_ssize_t q = 0; q < r; q++)
            for (int64_t u = idx[runs[q].start] / div; u <= idx[runs[q].end - 1] / div; u++)
                units[k++] = u;
        if (k > top) goto done;
        for (long long i = 0; i < k; i++) ids[top - k + i] = units[i];
    } else {
        for (Py_ssize_t i = 0; i < n; i++) unit_scratch[idx[i] / div] = i;
        for (Py_ssize_t i = 0; i < n; i++)
            if (unit_scratch[idx[i] / div] == i) units[k++] = idx[i] / div;
        if (k > top) goto done;
        for (long long i = 0; i < k; i++) ids[top - k + i] = units[i];
    }
    if (state)
        for (long long i = 0; i < k; i++) state[ids[top - k + i]] = 0;
done:
    for (int i = 0; i < got; i++)
        if (b[i].obj != NULL) PyBuffer_Release(&b[i]);
    if (!ok || PyErr_Occurred()) return NULL;
    return Py_BuildValue("(LLLLL)", lo, hi, first_dup, first_bad, k);
}

/* distinct_units(idx int64[n], div, scratch int64[], out int64[>= n]) -> k: the distinct units
 * (slot // div) of idx written to out[:k], each at the last position it occurs (in position
 * order): every position writes its number into its unit's scratch cell; the positions that
 * read their own number back keep their unit (one per unit, no sort). */
static PyObject *distinct_units(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *idx_obj, *scratch_obj, *out_obj;
    long long div;
    Py_buffer idx_b, scratch_b, out_b;
    if (!PyArg_ParseTuple(args, "OLOO:distinct_units", &idx_obj, &div, &scratch_obj, &out_obj))
        return NULL;
    if (div < 1) {
        PyErr_SetString(PyExc_ValueError, "distinct_units: div must be >= 1");
        return NULL;
    }
    if (get_buffer(idx_obj, &idx_b, 8, 0, "distinct_units idx") < 0) return NULL;
    if (get_buffer(scratch_obj, &scratch_b, 8, 1, "distinct_units scratch") < 0) {
        PyBuffer_Release(&idx_b);
        return NULL;
    }
    if (get_buffer(out_obj, &out_b, 8, 1, "distinct_units out") < 0) {
        PyBuffer_Release(&idx_b);
        PyBuffer_Release(&scratch_b);
        return NULL;
    }
    const int64_t *idx = (const int64_t *)idx_b.buf;
    int64_t *scratch = (int64_t *)scratch_b.buf, *out = (int64_t *)out_b.buf;
    Py_ssize_t n = idx_b.shape[0], k = 0;
    int ok = out_b.shape[0] >= n;
    for (Py_ssize_t i = 0; ok && i < n; i++)
        if (idx[i] < 0 || idx[i] / div >= scratch_b.shape[0]) ok = 0;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "distinct_units: an id is outside scratch, or out is short");
    } else {
        for (Py_ssize_t i = 0; i < n; i++) scratch[idx[i] / div] = i;
        for (Py_ssize_t i = 0; i < n; i++)
            if (scratch[idx[i] / div] == i) out[k++] = idx[i] / div;
    }
    PyBuffer_Release(&idx_b);
    PyBuffer_Release(&scratch_b);
    PyBuffer_Release(&out_b);
    if (!ok) return NULL;
    return PyLong_FromSsize_t(k);
}

/* expand_units(units int64[n], div, out int64[>= n * div]): out[i * div + j] = units[i] * div + j,
 * the slots of pages `units`, in order. */
static PyObject *expand_units(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *units_obj, *out_obj;
    long long div;
    Py_buffer units_b, out_b;
    if (!PyArg_ParseTuple(args, "OLO:expand_units", &units_obj, &div, &out_obj)) return NULL;
    if (div < 1) {
        PyErr_SetString(PyExc_ValueError, "expand_units: div must be >= 1");
        return NULL;
    }
    if (get_buffer(units_obj, &units_b, 8, 0, "expand_units units") < 0) return NULL;
    if (get_buffer(out_obj, &out_b, 8, 1, "expand_units out") < 0) {
        PyBuffer_Release(&units_b);
        return NULL;
    }
    const int64_t *units = (const int64_t *)units_b.buf;
    int64_t *out = (int64_t *)out_b.buf;
    Py_ssize_t n = units_b.shape[0];
    int ok = out_b.shape[0] >= n * div;
    if (ok)
        for (Py_ssize_t i = 0; i < n; i++)
            for (long long j = 0; j < div; j++) out[i * div + j] = units[i] * div + j;
    PyBuffer_Release(&units_b);
    PyBuffer_Release(&out_b);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "expand_units: out is short");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* -- token ids -------------------------------------------------------------------------------- */

/* check_token_ids(ids tuple, known tuple | None = None) -> bool: every element an int (or has
 * __index__, as array('q') accepts) that fits in int64; raises naming the first bad position,
 * as the Python reference does. Returns whether every element is an exact int. `known`: a tuple
 * that passed with True before; the leading positions of ids that hold the very objects known
 * holds there (an insert's key after its match's: a pointer compare, no object read) are not
 * read again. */
static PyObject *check_token_ids(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *ids, *known = Py_None;
    if (!PyArg_ParseTuple(args, "O|O:check_token_ids", &ids, &known)) return NULL;
    if (!PyTuple_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "check_token_ids takes a tuple");
        return NULL;
    }
    if (known != Py_None && !PyTuple_Check(known)) {
        PyErr_SetString(PyExc_TypeError, "check_token_ids: known must be a tuple or None");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(ids), i = 0;
    int exact = 1;
    if (known != Py_None) {
        Py_ssize_t m = PyTuple_GET_SIZE(known);
        PyObject *const *a = &PyTuple_GET_ITEM(ids, 0), *const *b = &PyTuple_GET_ITEM(known, 0);
        if (m > n) m = n;
        while (i < m && a[i] == b[i]) i++;
    }
    for (; i < n; i++) {
        PyObject *v = PyTuple_GET_ITEM(ids, i), *index;
        int overflow;
        if (PyLong_CheckExact(v)) {
            (void)PyLong_AsLongLongAndOverflow(v, &overflow);
            if (overflow) goto too_big;
            continue;
        }
        exact = 0;
        if (!PyIndex_Check(v)) {
            const char *name = Py_TYPE(v)->tp_name, *dot = strrchr(name, '.');
            PyErr_Format(PyExc_TypeError, "token ids must be ints: position %zd is %R (%s)", i, v,
                         dot ? dot + 1 : name);
            return NULL;
        }
        index = PyNumber_Index(v);
        if (index == NULL) return NULL;
        (void)PyLong_AsLongLongAndOverflow(index, &overflow);
        Py_DECREF(index);
        if (overflow) goto too_big;
        continue;
    too_big:
        PyErr_Format(PyExc_ValueError, "token ids must fit in int64: position %zd is %R", i, v);
        return NULL;
    }
    return PyBool_FromLong(exact);
}

/* pack_int64(ids, start, stop) -> bytes: ids[start:stop] as int64s in machine byte order, what
 * array('q', ids[start:stop]).tobytes() gives (the bytes kvplug's page digests and page
 * checksums cover), without building the array: tuples and lists element by element, 1-D int64
 * buffers (array('q')) by one copy, anything else through its slice. start and stop clamp as a
 * slice's do; the same TypeError / OverflowError as the array for a bad element. */
static int pack_items(PyObject *seq, Py_ssize_t start, Py_ssize_t stop, char *out) {
    for (Py_ssize_t i = start; i < stop; i++) {
        if (i >= PySequence_Fast_GET_SIZE(seq)) {  /* an __index__ shrank a list */
            PyErr_SetString(PyExc_RuntimeError, "pack_int64: the sequence changed size");
            return -1;
        }
        PyObject *v = PySequence_Fast_GET_ITEM(seq, i);
        long long x;
        int overflow = 0;
        if (PyLong_CheckExact(v)) {
            x = PyLong_AsLongLongAndOverflow(v, &overflow);
        } else {
            Py_INCREF(v);
            PyObject *index = PyNumber_Index(v);
            Py_DECREF(v);
            if (index == NULL) return -1;
            x = PyLong_AsLongLongAndOverflow(index, &overflow);
            Py_DECREF(index);
        }
        if (overflow) {
            PyErr_SetString(PyExc_OverflowError, "int too big to convert");  /* array's words */
            return -1;
        }
        if (x == -1 && PyErr_Occurred()) return -1;
        memcpy(out + 8 * (i - start), &x, 8);
    }
    return 0;
}

static PyObject *pack_int64(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *ids, *out = NULL;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "Onn:pack_int64", &ids, &start, &stop)) return NULL;
    if (start < 0 || stop < 0) {
        PyErr_SetString(PyExc_ValueError, "pack_int64: start and stop must be >= 0");
        return NULL;
    }
    if (PyTuple_Check(ids) || PyList_Check(ids)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
        if (stop > n) stop = n;
        if (start > stop) start = stop;
        out = PyBytes_FromStringAndSize(NULL, 8 * (stop - start));
        if (out != NULL && pack_items(ids, start, stop, PyBytes_AS_STRING(out)) < 0) Py_CLEAR(out);
        return out;
    }
    if (PyObject_CheckBuffer(ids)) {
        Py_buffer view;
        if (PyObject_GetBuffer(ids, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
            const char *f = view.format ? view.format : "B";
            if (f[0] == '@' || f[0] == '=') f++;
            if (view.ndim == 1 && view.itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0)) {
                Py_ssize_t n = view.len / 8;
                if (stop > n) stop = n;
                if (start > stop) start = stop;
                out = PyBytes_FromStringAndSize((const char *)view.buf + 8 * start,
                                                8 * (stop - start));
                PyBuffer_Release(&view);
                return out;
            }
            PyBuffer_Release(&view);
        } else {
            PyErr_Clear();
        }
    }
    PyObject *part = PySequence_GetSlice(ids, start, stop);
    if (part == NULL) return NULL;
    PyObject *seq = PySequence_Fast(part, "pack_int64 takes a sequence of ints");
    Py_DECREF(part);
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    out = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (out != NULL && pack_items(seq, 0, n, PyBytes_AS_STRING(out)) < 0) Py_CLEAR(out);
    Py_DECREF(seq);
    return out;
}

/* common_prefix(a, b, n): the length of the common prefix of a[:n] and b[:n], two 1-D int64
 * buffers at least n long (SGLang's token arrays); one pass, no token boxed. */
static PyObject *common_prefix(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *a_obj, *b_obj;
    Py_ssize_t n, i = 0;
    Py_buffer a, b;
    static const char error[] = "common_prefix: a and b must be 1-D int64 buffers";
    if (!PyArg_ParseTuple(args, "OOn:common_prefix", &a_obj, &b_obj, &n)) return NULL;
    if (open_int64(a_obj, &a, error) < 0) return NULL;
    if (open_int64(b_obj, &b, error) < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    int ok = n >= 0 && n <= a.shape[0] && n <= b.shape[0];
    if (ok) {
        const int64_t *x = (const int64_t *)a.buf, *y = (const int64_t *)b.buf;
        while (i < n && x[i] == y[i]) i++;
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "common_prefix: n must be within both buffers");
        return NULL;
    }
    return PyLong_FromSsize_t(i);
}

/* common_items(a, i, b, j, n): how many of a[i:i+n] equal b[j:j+n] from the start, a and b two
 * tuples (token ids: a radix node's key, a request's): a pointer compare per item (the slices of
 * one key share its int objects), a value compare only where the pointers differ. */
static PyObject *common_items(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *a, *b;
    Py_ssize_t i, j, n, k = 0;
    if (!PyArg_ParseTuple(args, "OnOnn:common_items", &a, &i, &b, &j, &n)) return NULL;
    if (!PyTuple_CheckExact(a) || !PyTuple_CheckExact(b)) {
        PyErr_SetString(PyExc_TypeError, "common_items: a and b must be tuples");
        return NULL;
    }
    if (i < 0 || j < 0 || n < 0 || n > PyTuple_GET_SIZE(a) - i || n > PyTuple_GET_SIZE(b) - j) {
        PyErr_SetString(PyExc_ValueError, "common_items: the ranges must be within both tuples");
        return NULL;
    }
    PyObject *const *x = &PyTuple_GET_ITEM(a, i), *const *y = &PyTuple_GET_ITEM(b, j);
    for (; k < n; k++) {
        if (x[k] == y[k]) continue;
        int eq = PyObject_RichCompareBool(x[k], y[k], Py_EQ);
        if (eq < 0) return NULL;
        if (!eq) break;
    }
    return PyLong_FromSsize_t(k);
}

/* -- page digests ------------------------------------------------------------------------------ */

/* SHA-256 (FIPS 180-4), for the chained page digests of kvplug.caches.block_hashing: digest i is
 * SHA-256(digest i-1 || page i's token bytes). hashlib costs a Python call, a bytes concatenation
 * and a digest object per page; this is one call for a run of pages (the GIL is released while
 * it hashes). */

typedef struct {
    uint32_t h[8];
    uint64_t length; /* bytes hashed so far */
    unsigned char block[64];
    size_t used; /* bytes in block */
} Sha256;

static const uint32_t sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_compress(uint32_t h[8], const unsigned char *p) {
    uint32_t w[64], a, b, c, d, e, f, g, k, t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = ((uint32_t)p[4 * i] << 24) | ((uint32_t)p[4 * i + 1] << 16) |
               ((uint32_t)p[4 * i + 2] << 8) | (uint32_t)p[4 * i + 3];
    for (i = 16; i < 64; i++) {
        uint32_t s0 = ROTR(w[i - 15], 7) ^ ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROTR(w[i - 2], 17) ^ ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (i = 0; i < 64; i++) {
        t1 = k + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + sha256_k[i] + w[i];
        t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

static void sha256_init(Sha256 *s) {
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, iv, sizeof iv);
    s->length = 0;
    s->used = 0;
}

static void sha256_update(Sha256 *s, const unsigned char *p, size_t n) {
    s->length += n;
    if (s->used) {
        size_t take = 64 - s->used < n ? 64 - s->used : n;
        memcpy(s->block + s->used, p, take);
        s->used += take, p += take, n -= take;
        if (s->used < 64) return;
        sha256_compress(s->h, s->block);
        s->used = 0;
    }
    for (; n >= 64; p += 64, n -= 64) sha256_compress(s->h, p);
    memcpy(s->block, p, n);
    s->used = n;
}

static void sha256_final(Sha256 *s, unsigned char out[32]) {
    uint64_t bits = s->length * 8;
    unsigned char pad = 0x80;
    static const unsigned char zeros[64] = {0};
    int i;
    sha256_update(s, &pad, 1);
    sha256_update(s, zeros, (s->used <= 56 ? 56 : 120) - s->used);
    for (i = 0; i < 8; i++) s->block[56 + i] = (unsigned char)(bits >> (56 - 8 * i));
    sha256_compress(s->h, s->block);
    for (i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(s->h[i] >> 24);
        out[4 * i + 1] = (unsigned char)(s->h[i] >> 16);
        out[4 * i + 2] = (unsigned char)(s->h[i] >> 8);
        out[4 * i + 3] = (unsigned char)s->h[i];
    }
}

/* sha256_chain(parent, data, start, count, size): the digests of pages start..start+count-1 of
 * data (size bytes each), chained from parent (32 bytes): a list of count 32-byte bytes. */
static PyObject *sha256_chain(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer parent, data;
    Py_ssize_t start, count, size, i;
    if (!PyArg_ParseTuple(args, "y*y*nnn:sha256_chain", &parent, &data, &start, &count, &size))
        return NULL;
    PyObject *out = NULL;
    unsigned char *digests = NULL;
    if (parent.len != 32 || start < 0 || count < 0 || size < 0 ||
        (size && (start > data.len / size || count > data.len / size - start))) {
        PyErr_SetString(PyExc_ValueError,
                        "sha256_chain: parent must be 32 bytes and the pages within data");
        goto done;
    }
    digests = PyMem_Malloc(count ? (size_t)count * 32 : 1);
    if (digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *prev = parent.buf, *page = (const unsigned char *)data.buf + start * size;
    for (i = 0; i < count; i++, page += size) {
        Sha256 s;
        sha256_init(&s);
        sha256_update(&s, prev, 32);
        sha256_update(&s, page, (size_t)size);
        sha256_final(&s, digests + 32 * i);
        prev = digests + 32 * i;
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(count);
    if (out == NULL) goto done;
    for (i = 0; i < count; i++) {
        PyObject *d = PyBytes_FromStringAndSize((const char *)digests + 32 * i, 32);
        if (d == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, d);
    }
done:
    PyMem_Free(digests);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return out;
}

/* -- vLLM's free-block list with a policy ------------------------------------------------------
 * kvplug.speedups.free_list_append / free_list_popleft / free_list_touch: the loops of
 * kvplug.integrations.vllm.block_pool.PolicyFreeBlockQueue over vLLM's KVCacheBlock objects
 * (read and written by attribute name), its per-block lists and its rank's methods. Each block
 * id is checked against the tracked bytearray's length, which every per-block list matches.
 */

/* The block fields, read through their __slots__ offsets when the block's class is slotted
 * (vLLM's KVCacheBlock is), by attribute name otherwise. The class is bound at the first call
 * that sees it (a class without these slots is read by name). */
enum { B_ID, B_HASH, B_PREV, B_NEXT, B_REF, B_NULL, B_COUNT };
static PyObject *block_names[B_COUNT];
static PyTypeObject *block_type = NULL; /* strong reference */
static Py_ssize_t block_offsets[B_COUNT];
static PyTypeObject *unslotted_type = NULL; /* the last class found without the slots (borrowed
                                               identity only, never dereferenced) */

static void bind_block_type(PyObject *obj) {
    PyTypeObject *cls = Py_TYPE(obj);
    if (cls == block_type || cls == unslotted_type) return;
    Py_ssize_t found[B_COUNT];
    for (int i = 0; i < B_COUNT; i++) {
        PyObject *d = _PyType_Lookup(cls, block_names[i]); /* borrowed */
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type) ||
            ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX ||
            cls->tp_getattro != PyObject_GenericGetAttr ||
            cls->tp_setattro != PyObject_GenericSetAttr) { /* read by name */
            unslotted_type = cls;
            return;
        }
        found[i] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    Py_INCREF(cls);
    Py_XSETREF(block_type, cls);
    memcpy(block_offsets, found, sizeof(block_offsets));
}

#define BSLOT(obj, f) (*(PyObject **)((char *)(obj) + block_offsets[f]))

/* A field's value (a new reference), NULL with an exception set. */
static PyObject *bget(PyObject *obj, int f) {
    if (Py_TYPE(obj) == block_type) {
        PyObject *v = BSLOT(obj, f);
        if (v == NULL) {
            PyErr_Format(PyExc_AttributeError, "block field '%U' is not set", block_names[f]);
            return NULL;
        }
        return Py_NewRef(v);
    }
    return PyObject_GetAttr(obj, block_names[f]);
}

static int bset(PyObject *obj, int f, PyObject *value) {
    if (Py_TYPE(obj) == block_type) {
        Py_XSETREF(BSLOT(obj, f), Py_NewRef(value));
        return 0;
    }
    return PyObject_SetAttr(obj, block_names[f], value);
}

static int intern_names(void) {
    static const char *names[B_COUNT] = {"block_id", "block_hash", "prev_free_block",
                                         "next_free_block", "ref_cnt", "is_null"};
    for (int i = 0; i < B_COUNT; i++) {
        block_names[i] = PyUnicode_InternFromString(names[i]);
        if (block_names[i] == NULL) return -1;
    }
    return 0;
}

/* The per-block lists of one call: lists of exactly n items (n: the tracked bytearray's size). */
static int check_lists(PyObject *tracked, Py_ssize_t *n, PyObject **lists, int count) {
    if (!PyByteArray_Check(tracked)) {
        PyErr_SetString(PyExc_TypeError, "free list: tracked must be a bytearray");
        return -1;
    }
    *n = PyByteArray_GET_SIZE(tracked);
    for (int i = 0; i < count; i++) {
        if (!PyList_Check(lists[i]) || PyList_GET_SIZE(lists[i]) != *n) {
            PyErr_SetString(PyExc_ValueError,
                            "free list: each per-block state must be a list of one item per block");
            return -1;
        }
    }
    return 0;
}

static int item_long(PyObject *list, Py_ssize_t i, long long *out) {
    *out = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_item_long(PyObject *list, Py_ssize_t i, long long value) {
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL) return -1;
    PyObject *old = PyList_GET_ITEM(list, i);
    PyList_SET_ITEM(list, i, v);
    Py_DECREF(old);
    return 0;
}

/* The block's id, checked to be in 0..n-1; -1 with an exception set otherwise. */
static Py_ssize_t block_id_of(PyObject *block, Py_ssize_t n) {
    PyObject *v = bget(block, B_ID);
    if (v == NULL) return -1;
    Py_ssize_t id = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    if (id == -1 && PyErr_Occurred()) return -1;
    if (id < 0 || id >= n) {
        PyErr_Format(PyExc_IndexError, "free list: block id %zd outside 0..%zd", id, n - 1);
        return -1;
    }
    return id;
}

/* 1 if the attribute is None, 0 if not, -1 on error. */
static int attr_is_none(PyObject *obj, int f) {
    PyObject *v = bget(obj, f);
    if (v == NULL) return -1;
    int none = v == Py_None;
    Py_DECREF(v);
    return none;
}

/* -- block ranks: the vLLM queue's candidate orders --------------------------------------------
 * Compiled versions of kvplug.integrations.vllm.ranks (the reference; its tests drive both
 * against the policies): BlockHeap (block ids by key; keyed from the per-block lists, it is
 * KeyedRank), S3FIFORank and ARCRank. They read the queue's per-block lists (BlockTable) and
 * make the same choices, float arithmetic included, as the Python classes.
 */

/* An indexed binary heap over block ids 0..n-1 (each at most once), ordered by (major, minor,
 * block id): the Python heaps' order (key, then id). Entries hold their keys (a comparison reads
 * no other memory). */
typedef struct {
    int64_t major, minor;
    int32_t id;
} HeapEntry;

typedef struct {
    Py_ssize_t n, size;
    HeapEntry *heap; /* heap[0..size) */
    int32_t *pos;    /* pos[id]: index in heap, -1 if absent */
} Heap;

static int heap_init(Heap *h, Py_ssize_t n) {
    Py_ssize_t m = n ? n : 1;
    h->n = n;
    h->size = 0;
    h->heap = PyMem_Malloc(m * sizeof(HeapEntry));
    h->pos = PyMem_Malloc(m * sizeof(int32_t));
    if (!h->heap || !h->pos) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) h->pos[i] = -1;
    return 0;
}

static void heap_free(Heap *h) {
    PyMem_Free(h->heap);
    PyMem_Free(h->pos);
    h->heap = NULL;
    h->pos = NULL;
}

static inline int entry_less(const HeapEntry *a, const HeapEntry *b) {
    if (a->major != b->major) return a->major < b->major;
    if (a->minor != b->minor) return a->minor < b->minor;
    return a->id < b->id;
}

static void heap_up(Heap *h, Py_ssize_t i) {
    HeapEntry e = h->heap[i];
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!entry_less(&e, &h->heap[parent])) break;
        h->heap[i] = h->heap[parent];
        h->pos[h->heap[i].id] = (int32_t)i;
        i = parent;
    }
    h->heap[i] = e;
    h->pos[e.id] = (int32_t)i;
}

static void heap_down(Heap *h, Py_ssize_t i) {
    HeapEntry e = h->heap[i];
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= h->size) break;
        if (child + 1 < h->size && entry_less(&h->heap[child + 1], &h->heap[child])) child++;
        if (!entry_less(&h->heap[child], &e)) break;
        h->heap[i] = h->heap[child];
        h->pos[h->heap[i].id] = (int32_t)i;
        i = child;
    }
    h->heap[i] = e;
    h->pos[e.id] = (int32_t)i;
}

/* Set a block's key (insert it, or re-key it where it is). */
static void heap_set(Heap *h, int32_t id, int64_t major, int64_t minor) {
    Py_ssize_t i = h->pos[id];
    if (i < 0) i = h->size++;
    h->heap[i].major = major;
    h->heap[i].minor = minor;
    h->heap[i].id = id;
    h->pos[id] = (int32_t)i;
    heap_up(h, i);
    heap_down(h, h->pos[id]);
}

static int heap_remove(Heap *h, int32_t id) {
    Py_ssize_t i = h->pos[id];
    if (i < 0) return 0;
    h->pos[id] = -1;
    HeapEntry moved = h->heap[--h->size];
    if (i < h->size) {
        h->heap[i] = moved;
        h->pos[moved.id] = (int32_t)i;
        heap_up(h, i);
        heap_down(h, h->pos[moved.id]);
    }
    return 1;
}

static inline int32_t heap_peek(const Heap *h) { return h->size ? h->heap[0].id : -1; }

static int32_t heap_pop(Heap *h) {
    int32_t id = heap_peek(h);
    if (id >= 0) heap_remove(h, id);
    return id;
}

static int rank_id(Py_ssize_t n, PyObject *arg, int32_t *out) {
    Py_ssize_t id = PyLong_AsSsize_t(arg);
    if (id == -1 && PyErr_Occurred()) return -1;
    if (id < 0 || id >= n) {
        PyErr_Format(PyExc_IndexError, "block rank: block id %zd outside 0..%zd", id, n - 1);
        return -1;
    }
    *out = (int32_t)id;
    return 0;
}

static int rank_contains_id(const Heap *a, const Heap *b, PyObject *arg) {
    if (!PyLong_Check(arg)) return 0;
    Py_ssize_t id = PyLong_AsSsize_t(arg);
    if (id == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (id < 0 || id >= a->n) return 0;
    return a->pos[id] >= 0 || (b != NULL && b->pos[id] >= 0);
}

/* Per-block lists of n items each (the queue's BlockTable), checked once. */
static int take_lists(PyObject **lists, PyObject **dest, int count, Py_ssize_t *n) {
    *n = -1;
    for (int i = 0; i < count; i++) {
        if (!PyList_Check(lists[i]) || (*n >= 0 && PyList_GET_SIZE(lists[i]) != *n)) {
            PyErr_SetString(PyExc_ValueError, "block rank: the per-block state must be lists of "
                                              "one item per block");
            return -1;
        }
        *n = PyList_GET_SIZE(lists[i]);
    }
    if (*n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "block rank: too many blocks");
        return -1;
    }
    for (int i = 0; i < count; i++) dest[i] = Py_NewRef(lists[i]);
    return 0;
}

/* Ghosts: evicted contents (block hashes), oldest first, at most `capacity`, each with a tag
 * (0/1): an OrderedDict's pop / set-as-newest / forget-the-oldest. `map` holds content ->
 * seq << 1 | tag; `ring` the contents in insertion order with their seq (an entry whose seq is
 * not the map's is stale and skipped). */
typedef struct {
    PyObject *map;
    PyObject **keys;
    int64_t *seqs;
    Py_ssize_t head, len, alloc;
    int64_t seq;
    Py_ssize_t capacity;
} Ghosts;

static int ghosts_init(Ghosts *g, Py_ssize_t capacity) {
    memset(g, 0, sizeof(*g));
    g->capacity = capacity;
    g->map = PyDict_New();
    return g->map ? 0 : -1;
}

static void ghosts_clear(Ghosts *g) {
    for (Py_ssize_t i = g->head; i < g->len; i++) Py_CLEAR(g->keys[i]);
    g->head = g->len = 0;
    Py_CLEAR(g->map);
}

static void ghosts_free(Ghosts *g) {
    ghosts_clear(g);
    PyMem_Free(g->keys);
    PyMem_Free(g->seqs);
    g->keys = NULL;
    g->seqs = NULL;
    g->alloc = 0;
}

static int ghosts_traverse(Ghosts *g, visitproc visit, void *arg) {
    Py_VISIT(g->map);
    for (Py_ssize_t i = g->head; i < g->len; i++) Py_VISIT(g->keys[i]);
    return 0;
}

/* The map's seq of `key`, -1 if absent, -2 on error. */
static int64_t ghosts_seq(Ghosts *g, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(g->map, key);
    if (v == NULL) return PyErr_Occurred() ? -2 : -1;
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -2;
    return (int64_t)x;
}

/* Remove `key`: its tag (0/1), -1 if it was not a ghost, -2 on error. */
static int ghosts_pop(Ghosts *g, PyObject *key) {
    if (PyDict_GET_SIZE(g->map) == 0) return -1;
    int64_t x = ghosts_seq(g, key);
    if (x < 0) return (int)x;
    if (PyDict_DelItem(g->map, key) < 0) return -2;
    return (int)(x & 1);
}

/* Keep only the live ring entries, in order (when stale ones dominate or the head moved far). */
static int ghosts_compact(Ghosts *g) {
    Py_ssize_t out = 0;
    for (Py_ssize_t i = g->head; i < g->len; i++) {
        PyObject *k = g->keys[i];
        int64_t x = ghosts_seq(g, k);
        if (x == -2) return -1;
        if (x >= 0 && (x >> 1) == g->seqs[i]) {
            g->keys[out] = k;
            g->seqs[out++] = g->seqs[i];
        } else {
            Py_DECREF(k);
        }
    }
    g->head = 0;
    g->len = out;
    return 0;
}

/* `key` becomes the newest ghost with `tag`; the oldest is forgotten beyond capacity. */
static int ghosts_leave(Ghosts *g, PyObject *key, int tag) {
    if (key == Py_None) return 0;
    if (g->len - g->head > 2 * PyDict_GET_SIZE(g->map) + 64 || g->head > g->alloc / 2) {
        if (ghosts_compact(g) < 0) return -1;
    }
    if (g->len == g->alloc) {
        Py_ssize_t alloc = g->alloc ? 2 * g->alloc : 64;
        PyObject **keys = PyMem_Realloc(g->keys, alloc * sizeof(PyObject *));
        if (keys == NULL) return PyErr_NoMemory(), -1;
        g->keys = keys;
        int64_t *seqs = PyMem_Realloc(g->seqs, alloc * sizeof(int64_t));
        if (seqs == NULL) return PyErr_NoMemory(), -1;
        g->seqs = seqs;
        g->alloc = alloc;
    }
    int64_t seq = ++g->seq;
    PyObject *v = PyLong_FromLongLong((long long)(seq << 1 | (tag ? 1 : 0)));
    if (v == NULL) return -1;
    /* set as the newest: a new seq (the key's older ring entry, if any, becomes stale) */
    int rc = PyDict_SetItem(g->map, key, v);
    Py_DECREF(v);
    if (rc < 0) return -1;
    g->keys[g->len] = Py_NewRef(key);
    g->seqs[g->len++] = seq;
    while (PyDict_GET_SIZE(g->map) > g->capacity && g->head < g->len) { /* the oldest goes */
        PyObject *k = g->keys[g->head];
        int64_t s = g->seqs[g->head++];
        int64_t x = ghosts_seq(g, k);
        if (x == -2) {
            Py_DECREF(k);
            return -1;
        }
        if (x >= 0 && (x >> 1) == s && PyDict_DelItem(g->map, k) < 0) {
            Py_DECREF(k);
            return -1;
        }
        Py_DECREF(k);
    }
    return 0;
}

/* -- BlockHeap: KeyedRank, block ids keyed from the per-block lists ----------------------- */

typedef struct {
    PyObject_HEAD
    Heap h;
    PyObject *last, *hits; /* lists of n ints */
    long long cap, div;
} BlockHeap;

/* The sort key of a keyed heap's block: (min(hits, cap) // div, last). */
static int bh_keyed(BlockHeap *self, int32_t id, int64_t *major, int64_t *minor) {
    long long hits, last;
    if (item_long(self->hits, id, &hits) < 0 || item_long(self->last, id, &last) < 0) return -1;
    *major = (hits < self->cap ? hits : self->cap) / self->div;
    *minor = last;
    return 0;
}

static PyObject *bh_add(BlockHeap *self, PyObject *arg) {
    int32_t id;
    int64_t major, minor;
    if (rank_id(self->h.n, arg, &id) < 0 || bh_keyed(self, id, &major, &minor) < 0) return NULL;
    heap_set(&self->h, id, major, minor);
    Py_RETURN_NONE;
}

static PyObject *bh_discard(BlockHeap *self, PyObject *arg) {
    int32_t id;
    if (rank_id(self->h.n, arg, &id) < 0) return NULL;
    heap_remove(&self->h, id);
    Py_RETURN_NONE;
}

static PyObject *bh_pop(BlockHeap *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(heap_pop(&self->h));
}

static PyObject *bh_peek(BlockHeap *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(heap_peek(&self->h));
}

/* add(id) then pop(): the victim, -2 on error. */
static int32_t bh_pushpop_id(BlockHeap *self, int32_t id) {
    int64_t major, minor;
    Heap *h = &self->h;
    if (bh_keyed(self, id, &major, &minor) < 0) return -2;
    if (h->pos[id] < 0) {
        HeapEntry e = {major, minor, id};
        if (!h->size || entry_less(&e, &h->heap[0]))
            return id; /* the next victim anyway: the heap is untouched */
    }
    heap_set(h, id, major, minor);
    return heap_pop(h);
}

static PyObject *bh_pushpop(BlockHeap *self, PyObject *arg) {
    int32_t id;
    if (rank_id(self->h.n, arg, &id) < 0) return NULL;
    id = bh_pushpop_id(self, id);
    return id == -2 ? NULL : PyLong_FromLong(id);
}

static Py_ssize_t bh_len(BlockHeap *self) { return self->h.size; }

static int bh_contains(BlockHeap *self, PyObject *arg) {
    return rank_contains_id(&self->h, NULL, arg);
}

static int bh_traverse(BlockHeap *self, visitproc visit, void *arg) {
    Py_VISIT(self->last);
    Py_VISIT(self->hits);
    return 0;
}

static int bh_clear(BlockHeap *self) {
    Py_CLEAR(self->last);
    Py_CLEAR(self->hits);
    return 0;
}

static void bh_dealloc(BlockHeap *self) {
    PyObject_GC_UnTrack(self);
    bh_clear(self);
    heap_free(&self->h);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int bh_init(BlockHeap *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"last", "hits", "cap", "div", NULL};
    PyObject *last, *hits;
    long long cap, div;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOLL", kwlist, &last, &hits, &cap, &div))
        return -1;
    if (self->h.heap != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "BlockHeap: already initialised");
        return -1;
    }
    if (div < 1 || cap < 0) {
        PyErr_SetString(PyExc_ValueError, "BlockHeap: cap must be >= 0 and div >= 1");
        return -1;
    }
    PyObject *lists[2] = {last, hits}, *dest[2];
    Py_ssize_t n;
    if (take_lists(lists, dest, 2, &n) < 0) return -1;
    self->last = dest[0];
    self->hits = dest[1];
    self->cap = cap;
    self->div = div;
    return heap_init(&self->h, n);
}

static PyMethodDef bh_methods[] = {
    {"add", (PyCFunction)bh_add, METH_O, "The block becomes a candidate (keyed from the lists)."},
    {"discard", (PyCFunction)bh_discard, METH_O, "The block leaves (no-op if absent)."},
    {"pop", (PyCFunction)bh_pop, METH_NOARGS, "Remove and return the smallest, -1 if none."},
    {"peek", (PyCFunction)bh_peek, METH_NOARGS, "The smallest, -1 if none."},
    {"pushpop", (PyCFunction)bh_pushpop, METH_O, "add(block_id) then pop()."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods bh_sequence = {
    .sq_length = (lenfunc)bh_len,
    .sq_contains = (objobjproc)bh_contains,
};

static PyTypeObject BlockHeapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvplug._speedups.BlockHeap",
    .tp_basicsize = sizeof(BlockHeap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Block ids by key, smallest first (see kvplug.integrations.vllm.ranks).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)bh_init,
    .tp_dealloc = (destructor)bh_dealloc,
    .tp_traverse = (traverseproc)bh_traverse,
    .tp_clear = (inquiry)bh_clear,
    .tp_methods = bh_methods,
    .tp_as_sequence = &bh_sequence,
};


/* -- S3FIFORank: the small and main FIFOs of s3fifo over block ids -------------------------- */

enum { T_HITS, T_CREATED, T_CONTENT, T_TOKENS, T_LAST, T_COUNT };

typedef struct {
    PyObject_HEAD
    PyObject *table[T_COUNT]; /* the BlockTable's lists (hits, created, content, tokens, last) */
    Py_ssize_t n;
    Heap small, main;
    long long small_tokens, main_tokens, clock;
    int64_t *stamp, *position, *seen_hits;
    int32_t *freq;
    char *in_main;
    double fraction;
    long long max_freq;
    Ghosts ghosts;
} S3FIFORank;

static int table_traverse(PyObject **table, visitproc visit, void *arg) {
    for (int i = 0; i < T_COUNT; i++) Py_VISIT(table[i]);
    return 0;
}

static void table_clear(PyObject **table) {
    for (int i = 0; i < T_COUNT; i++) Py_CLEAR(table[i]);
}

static int table_take(PyObject **table, PyObject *hits, PyObject *created, PyObject *content,
                      PyObject *tokens, PyObject *last, Py_ssize_t *n) {
    if (table[0] != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "block rank: already initialised");
        return -1;
    }
    PyObject *lists[T_COUNT] = {hits, created, content, tokens, last};
    return take_lists(lists, table, T_COUNT, n);
}

static inline long long tget(PyObject **table, int t, int32_t id, int *err) {
    long long v = PyLong_AsLongLong(PyList_GET_ITEM(table[t], id));
    if (v == -1 && PyErr_Occurred()) *err = 1;
    return v;
}

static void s3_leave(S3FIFORank *r, int32_t id, long long tokens) {
    if (!r->in_main[id]) {
        if (heap_remove(&r->small, id)) r->small_tokens -= tokens;
    } else if (heap_remove(&r->main, id)) {
        r->main_tokens -= tokens;
    }
}

static int s3_add(S3FIFORank *r, int32_t id) {
    int err = 0;
    long long hits = tget(r->table, T_HITS, id, &err);
    long long created = tget(r->table, T_CREATED, id, &err);
    long long tokens = tget(r->table, T_TOKENS, id, &err);
    if (err) return -1;
    if (r->stamp[id] != created) { /* new content: S's tail, M's if it returns */
        r->stamp[id] = created;
        r->clock += 1;
        int to_main = 0;
        int tag = ghosts_pop(&r->ghosts, PyList_GET_ITEM(r->table[T_CONTENT], id));
        if (tag == -2) return -1;
        if (tag >= 0) to_main = 1; /* evicted before: straight to M */
        r->in_main[id] = (char)to_main;
        r->position[id] = r->clock;
        r->freq[id] = 0;
    } else {
        if (hits > r->seen_hits[id] && r->freq[id] < r->max_freq) r->freq[id] += 1;
        s3_leave(r, id, tokens);
    }
    r->seen_hits[id] = hits;
    if (!r->in_main[id]) {
        heap_set(&r->small, id, 0, r->position[id]);
        r->small_tokens += tokens;
    } else {
        heap_set(&r->main, id, 0, r->position[id]);
        r->main_tokens += tokens;
    }
    return 0;
}

/* The next victim (removed when `remove`), promoting and re-queueing on the way; -1 if none,
 * -2 on error. */
static int32_t s3_victim(S3FIFORank *r, int remove) {
    for (;;) {
        int32_t id;
        int err = 0;
        if (r->small.size &&
            ((double)r->small_tokens > r->fraction * (double)(r->small_tokens + r->main_tokens) ||
             !r->main.size)) {
            id = heap_peek(&r->small);
            long long tokens = tget(r->table, T_TOKENS, id, &err);
            if (err) return -2;
            if (r->freq[id] > 0) { /* reused while in S: promote to M */
                heap_remove(&r->small, id);
                r->small_tokens -= tokens;
                r->clock += 1;
                r->in_main[id] = 1;
                r->position[id] = r->clock;
                r->freq[id] = 0;
                heap_set(&r->main, id, 0, r->clock);
                r->main_tokens += tokens;
                continue;
            }
            if (remove) {
                heap_remove(&r->small, id);
                r->small_tokens -= tokens;
            }
        } else {
            id = heap_peek(&r->main);
            if (id < 0) return -1;
            long long tokens = tget(r->table, T_TOKENS, id, &err);
            if (err) return -2;
            if (r->freq[id] > 0) { /* second chance: back to M's tail */
                heap_remove(&r->main, id);
                r->main_tokens -= tokens;
                r->clock += 1;
                r->in_main[id] = 1;
                r->position[id] = r->clock;
                r->freq[id] -= 1;
                heap_set(&r->main, id, 0, r->clock);
                r->main_tokens += tokens;
                continue;
            }
            if (remove) {
                heap_remove(&r->main, id);
                r->main_tokens -= tokens;
            }
        }
        if (remove) {
            r->stamp[id] = -1; /* evicted: its state goes, its ghost stays */
            if (ghosts_leave(&r->ghosts, PyList_GET_ITEM(r->table[T_CONTENT], id), 0) < 0)
                return -2;
        }
        return id;
    }
}

static PyObject *s3_add_m(S3FIFORank *r, PyObject *arg) {
    int32_t id;
    if (rank_id(r->n, arg, &id) < 0 || s3_add(r, id) < 0) return NULL;
    Py_RETURN_NONE;
}

static int s3_discard(S3FIFORank *r, int32_t id) {
    int err = 0;
    long long created = tget(r->table, T_CREATED, id, &err);
    long long tokens = tget(r->table, T_TOKENS, id, &err);
    if (err) return -1;
    if (r->stamp[id] == created) s3_leave(r, id, tokens);
    return 0;
}

static PyObject *s3_discard_m(S3FIFORank *r, PyObject *arg) {
    int32_t id;
    if (rank_id(r->n, arg, &id) < 0 || s3_discard(r, id) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *s3_pop_m(S3FIFORank *r, PyObject *Py_UNUSED(ignored)) {
    int32_t id = s3_victim(r, 1);
    return id == -2 ? NULL : PyLong_FromLong(id);
}

static PyObject *s3_peek_m(S3FIFORank *r, PyObject *Py_UNUSED(ignored)) {
    int32_t id = s3_victim(r, 0);
    return id == -2 ? NULL : PyLong_FromLong(id);
}

static PyObject *s3_pushpop_m(S3FIFORank *r, PyObject *arg) {
    int32_t id;
    if (rank_id(r->n, arg, &id) < 0 || s3_add(r, id) < 0) return NULL;
    return s3_pop_m(r, NULL);
}

static PyObject *s3_queue_of(S3FIFORank *r, PyObject *arg) {
    int32_t id;
    if (rank_id(r->n, arg, &id) < 0) return NULL;
    return PyUnicode_FromString(r->in_main[id] ? "main" : "small");
}

static Py_ssize_t s3_len(S3FIFORank *r) { return r->small.size + r->main.size; }

static int s3_contains(S3FIFORank *r, PyObject *arg) {
    return rank_contains_id(&r->small, &r->main, arg);
}

static int s3_traverse(S3FIFORank *r, visitproc visit, void *arg) {
    if (table_traverse(r->table, visit, arg)) return -1;
    return ghosts_traverse(&r->ghosts, visit, arg);
}

static int s3_clear(S3FIFORank *r) {
    table_clear(r->table);
    ghosts_clear(&r->ghosts);
    return 0;
}

static void s3_dealloc(S3FIFORank *r) {
    PyObject_GC_UnTrack(r);
    table_clear(r->table);
    ghosts_free(&r->ghosts);
    heap_free(&r->small);
    heap_free(&r->main);
    PyMem_Free(r->stamp);
    PyMem_Free(r->position);
    PyMem_Free(r->seen_hits);
    PyMem_Free(r->freq);
    PyMem_Free(r->in_main);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int s3_init(S3FIFORank *r, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"hits",           "created",  "content",       "tokens", "last",
                             "small_fraction", "max_freq", "ghost_entries", NULL};
    PyObject *hits, *created, *content, *tokens, *last;
    double fraction;
    long long max_freq;
    Py_ssize_t ghost_entries;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOdLn", kwlist, &hits, &created, &content,
                                     &tokens, &last, &fraction, &max_freq, &ghost_entries))
        return -1;
    if (table_take(r->table, hits, created, content, tokens, last, &r->n) < 0) return -1;
    Py_ssize_t m = r->n ? r->n : 1;
    r->stamp = PyMem_Malloc(m * sizeof(int64_t));
    r->position = PyMem_Calloc(m, sizeof(int64_t));
    r->seen_hits = PyMem_Calloc(m, sizeof(int64_t));
    r->freq = PyMem_Calloc(m, sizeof(int32_t));
    r->in_main = PyMem_Calloc(m, 1);
    if (!r->stamp || !r->position || !r->seen_hits || !r->freq || !r->in_main) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < r->n; i++) r->stamp[i] = -1;
    r->fraction = fraction;
    r->max_freq = max_freq;
    if (heap_init(&r->small, r->n) < 0 || heap_init(&r->main, r->n) < 0) return -1;
    return ghosts_init(&r->ghosts, ghost_entries);
}

static PyMethodDef s3_methods[] = {
    {"add", (PyCFunction)s3_add_m, METH_O, "The block became a candidate."},
    {"discard", (PyCFunction)s3_discard_m, METH_O, "The block is no longer a candidate."},
    {"pop", (PyCFunction)s3_pop_m, METH_NOARGS, "Remove and return the next victim, -1 if none."},
    {"peek", (PyCFunction)s3_peek_m, METH_NOARGS, "The next victim, -1 if none."},
    {"pushpop", (PyCFunction)s3_pushpop_m, METH_O, "add(block_id) then pop()."},
    {"queue_of", (PyCFunction)s3_queue_of, METH_O, "\"small\" or \"main\"."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods s3_sequence = {
    .sq_length = (lenfunc)s3_len,
    .sq_contains = (objobjproc)s3_contains,
};

static PyTypeObject S3FIFORankType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvplug._speedups.S3FIFORank",
    .tp_basicsize = sizeof(S3FIFORank),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "s3fifo over block ids (see kvplug.integrations.vllm.ranks.S3FIFORank).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)s3_init,
    .tp_dealloc = (destructor)s3_dealloc,
    .tp_traverse = (traverseproc)s3_traverse,
    .tp_clear = (inquiry)s3_clear,
    .tp_methods = s3_methods,
    .tp_as_sequence = &s3_sequence,
};

/* -- ARCRank: T1 and T2 of arc over block ids, p adapted on ghost hits ---------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *table[T_COUNT];
    Py_ssize_t n;
    Heap t1, t2;
    long long t1_tokens, t2_tokens, capacity;
    int64_t *stamp, *seen_hits;
    char *in_t2;
    double fraction, b1, b2, p;
    Ghosts ghosts;
} ARCRank;

static void arc_leave(ARCRank *r, int32_t id, long long tokens) {
    if (r->in_t2[id]) {
        if (heap_remove(&r->t2, id)) r->t2_tokens -= tokens;
    } else if (heap_remove(&r->t1, id)) {
        r->t1_tokens -= tokens;
    }
}

static int arc_add(ARCRank *r, int32_t id) {
    int err = 0;
    long long hits = tget(r->table, T_HITS, id, &err);
    long long created = tget(r->table, T_CREATED, id, &err);
    long long tokens = tget(r->table, T_TOKENS, id, &err);
    long long last = tget(r->table, T_LAST, id, &err);
    if (err) return -1;
    if (r->stamp[id] != created) { /* new content: T1, T2 if returning */
        r->stamp[id] = created;
        int tag = ghosts_pop(&r->ghosts, PyList_GET_ITEM(r->table[T_CONTENT], id));
        if (tag == -2) return -1;
        if (tag >= 0) {
            double size = (double)tokens, b1 = r->b1, b2 = r->b2;
            if (tag) { /* from T2: shrink T1's target */
                double d = 1.0 > b2 ? 1.0 : b2, q = b1 / d, x = r->p - size * (1.0 > q ? 1.0 : q);
                r->p = x > 0.0 ? x : 0.0;
            } else { /* from T1: recency was cut too short */
                double d = 1.0 > b1 ? 1.0 : b1, q = b2 / d, x = r->p + size * (1.0 > q ? 1.0 : q);
                double c = (double)r->capacity;
                r->p = x < c ? x : c;
            }
            r->in_t2[id] = 1;
        } else {
            r->in_t2[id] = 0;
        }
    } else {
        arc_leave(r, id, tokens);
        if (hits > r->seen_hits[id]) r->in_t2[id] = 1; /* reused: the frequency list */
    }
    r->seen_hits[id] = hits;
    if (r->in_t2[id]) {
        heap_set(&r->t2, id, 0, last);
        r->t2_tokens += tokens;
    } else {
        heap_set(&r->t1, id, 0, last);
        r->t1_tokens += tokens;
    }
    long long total = r->t1_tokens + r->t2_tokens;
    if (total > r->capacity) {
        if (r->capacity == 0) r->p = r->fraction * (double)total;
        r->capacity = total;
    }
    return 0;
}

static Heap *arc_side(ARCRank *r) {
    return (r->t1.size && ((double)r->t1_tokens > r->p || !r->t2.size)) ? &r->t1 : &r->t2;
}

static PyObject *arc_add_m(ARCRank *r, PyObject *arg) {
    int32_t id;
    if (rank_id(r->n, arg, &id) < 0 || arc_add(r, id) < 0) return NULL;
    Py_RETURN_NONE;
}

static int arc_discard(ARCRank *r, int32_t id) {
    int err = 0;
    long long created = tget(r->table, T_CREATED, id, &err);
    long long tokens = tget(r->table, T_TOKENS, id, &err);
    if (err) return -1;
    if (r->stamp[id] == created) arc_leave(r, id, tokens);
    return 0;
}

static PyObject *arc_discard_m(ARCRank *r, PyObject *arg) {
    int32_t id;
    if (rank_id(r->n, arg, &id) < 0 || arc_discard(r, id) < 0) return NULL;
    Py_RETURN_NONE;
}

/* Remove and return the next victim, -1 if none, -2 on error. */
static int32_t arc_pop(ARCRank *r) {
    Heap *side = arc_side(r);
    int32_t id = heap_pop(side);
    if (id >= 0) {
        int err = 0;
        long long tokens = tget(r->table, T_TOKENS, id, &err);
        if (err) return -2;
        r->b1 *= 0.999; /* ghosts are bounded: old evictions fade */
        r->b2 *= 0.999;
        if (side == &r->t1) {
            r->t1_tokens -= tokens;
            r->b1 += (double)tokens;
        } else {
            r->t2_tokens -= tokens;
            r->b2 += (double)tokens;
        }
        r->stamp[id] = -1; /* its ghost, tagged with the list it left */
        if (ghosts_leave(&r->ghosts, PyList_GET_ITEM(r->table[T_CONTENT], id), r->in_t2[id]) < 0)
            return -2;
    }
    return id;
}

static PyObject *arc_pop_m(ARCRank *r, PyObject *Py_UNUSED(ignored)) {
    int32_t id = arc_pop(r);
    return id == -2 ? NULL : PyLong_FromLong(id);
}

static PyObject *arc_peek_m(ARCRank *r, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(heap_peek(arc_side(r)));
}

static PyObject *arc_pushpop_m(ARCRank *r, PyObject *arg) {
    int32_t id;
    if (rank_id(r->n, arg, &id) < 0 || arc_add(r, id) < 0) return NULL;
    return arc_pop_m(r, NULL);
}

static PyObject *arc_recency_tokens(ARCRank *r, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(r->t1_tokens);
}

static Py_ssize_t arc_len(ARCRank *r) { return r->t1.size + r->t2.size; }

static int arc_contains(ARCRank *r, PyObject *arg) { return rank_contains_id(&r->t1, &r->t2, arg); }

static int arc_traverse(ARCRank *r, visitproc visit, void *arg) {
    if (table_traverse(r->table, visit, arg)) return -1;
    return ghosts_traverse(&r->ghosts, visit, arg);
}

static int arc_clear(ARCRank *r) {
    table_clear(r->table);
    ghosts_clear(&r->ghosts);
    return 0;
}

static void arc_dealloc(ARCRank *r) {
    PyObject_GC_UnTrack(r);
    table_clear(r->table);
    ghosts_free(&r->ghosts);
    heap_free(&r->t1);
    heap_free(&r->t2);
    PyMem_Free(r->stamp);
    PyMem_Free(r->seen_hits);
    PyMem_Free(r->in_t2);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int arc_init(ARCRank *r, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"hits", "created", "content", "tokens", "last",
                             "initial_recency_fraction", "ghost_entries", NULL};
    PyObject *hits, *created, *content, *tokens, *last;
    double fraction;
    Py_ssize_t ghost_entries;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOdn", kwlist, &hits, &created, &content,
                                     &tokens, &last, &fraction, &ghost_entries))
        return -1;
    if (table_take(r->table, hits, created, content, tokens, last, &r->n) < 0) return -1;
    Py_ssize_t m = r->n ? r->n : 1;
    r->stamp = PyMem_Malloc(m * sizeof(int64_t));
    r->seen_hits = PyMem_Calloc(m, sizeof(int64_t));
    r->in_t2 = PyMem_Calloc(m, 1);
    if (!r->stamp || !r->seen_hits || !r->in_t2) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < r->n; i++) r->stamp[i] = -1;
    r->fraction = fraction;
    if (heap_init(&r->t1, r->n) < 0 || heap_init(&r->t2, r->n) < 0) return -1;
    return ghosts_init(&r->ghosts, ghost_entries);
}

static PyMethodDef arc_methods[] = {
    {"add", (PyCFunction)arc_add_m, METH_O, "The block became a candidate."},
    {"discard", (PyCFunction)arc_discard_m, METH_O, "The block is no longer a candidate."},
    {"pop", (PyCFunction)arc_pop_m, METH_NOARGS, "Remove and return the next victim, -1 if none."},
    {"peek", (PyCFunction)arc_peek_m, METH_NOARGS, "The next victim, -1 if none."},
    {"pushpop", (PyCFunction)arc_pushpop_m, METH_O, "add(block_id) then pop()."},
    {"recency_tokens", (PyCFunction)arc_recency_tokens, METH_NOARGS, "Candidate tokens in T1."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef arc_members[] = {
    {"p", T_DOUBLE, offsetof(ARCRank, p), READONLY, "Target tokens of T1."},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods arc_sequence = {
    .sq_length = (lenfunc)arc_len,
    .sq_contains = (objobjproc)arc_contains,
};

static PyTypeObject ARCRankType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvplug._speedups.ARCRank",
    .tp_basicsize = sizeof(ARCRank),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "arc over block ids (see kvplug.integrations.vllm.ranks.ARCRank).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)arc_init,
    .tp_dealloc = (destructor)arc_dealloc,
    .tp_traverse = (traverseproc)arc_traverse,
    .tp_clear = (inquiry)arc_clear,
    .tp_methods = arc_methods,
    .tp_members = arc_members,
    .tp_as_sequence = &arc_sequence,
};

/* -- vLLM's free-block list: the loops (they call the ranks above directly) -------------- */

/* The object a compiled rank method `fn` is bound to, when `fn` is exactly that method (then
 * the loops call it in C, without boxing), else NULL. `arg` (-1: none) must be one of its ids. */
static void *bound_to(PyObject *fn, PyCFunction meth, long long arg) {
    if (!PyCFunction_Check(fn) || ((PyCFunctionObject *)fn)->m_ml->ml_meth != meth) return NULL;
    void *self = ((PyCFunctionObject *)fn)->m_self;
    if (arg >= 0) { /* the id is in the rank's range, else the call (and its error) goes by name */
        Py_ssize_t rn = Py_IS_TYPE((PyObject *)self, &BlockHeapType) ? ((BlockHeap *)self)->h.n
                        : Py_IS_TYPE((PyObject *)self, &S3FIFORankType) ? ((S3FIFORank *)self)->n
                                                                        : ((ARCRank *)self)->n;
        if (arg >= rn) return NULL;
    }
    return self;
}

/* A rank's pop() (`with_arg` 0) or pushpop(arg) (`with_arg` 1): the victim, -2 on error. */
static long long call_rank(PyObject *fn, long long arg, int with_arg) {
    void *r;
    if (with_arg) {
        if ((r = bound_to(fn, (PyCFunction)bh_pushpop, arg))) return bh_pushpop_id(r, arg);
        if ((r = bound_to(fn, (PyCFunction)s3_pushpop_m, arg)))
            return s3_add(r, arg) < 0 ? -2 : s3_victim(r, 1);
        if ((r = bound_to(fn, (PyCFunction)arc_pushpop_m, arg)))
            return arc_add(r, arg) < 0 ? -2 : arc_pop(r);
    } else {
        if ((r = bound_to(fn, (PyCFunction)bh_pop, -1))) return heap_pop(&((BlockHeap *)r)->h);
        if ((r = bound_to(fn, (PyCFunction)s3_pop_m, -1))) return s3_victim(r, 1);
        if ((r = bound_to(fn, (PyCFunction)arc_pop_m, -1))) return arc_pop(r);
    }
    PyObject *res;
    if (with_arg) {
        PyObject *a = PyLong_FromLongLong(arg);
        if (a == NULL) return -2;
        res = PyObject_CallOneArg(fn, a);
        Py_DECREF(a);
    } else {
        res = PyObject_CallNoArgs(fn);
    }
    if (res == NULL) return -2;
    long long v = PyLong_AsLongLong(res);
    Py_DECREF(res);
    if (v == -1 && PyErr_Occurred()) return -2;
    return v;
}

/* A rank's add(arg) or discard(arg); -1 on error. */
static int call_void(PyObject *fn, long long arg) {
    void *r;
    if ((r = bound_to(fn, (PyCFunction)bh_add, arg))) {
        int64_t major, minor;
        if (bh_keyed(r, arg, &major, &minor) < 0) return -1;
        heap_set(&((BlockHeap *)r)->h, arg, major, minor);
        return 0;
    }
    if ((r = bound_to(fn, (PyCFunction)bh_discard, arg))) {
        heap_remove(&((BlockHeap *)r)->h, arg);
        return 0;
    }
    if ((r = bound_to(fn, (PyCFunction)s3_add_m, arg))) return s3_add(r, arg);
    if ((r = bound_to(fn, (PyCFunction)s3_discard_m, arg))) return s3_discard(r, arg);
    if ((r = bound_to(fn, (PyCFunction)arc_add_m, arg))) return arc_add(r, arg);
    if ((r = bound_to(fn, (PyCFunction)arc_discard_m, arg))) return arc_discard(r, arg);
    PyObject *a = PyLong_FromLongLong(arg);
    if (a == NULL) return -1;
    PyObject *res = PyObject_CallOneArg(fn, a);
    Py_DECREF(a);
    if (res == NULL) return -1;
    Py_DECREF(res);
    return 0;
}

static PyObject *free_list_append(PyObject *Py_UNUSED(self), PyObject *const *args,
                                  Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "free_list_append takes 7 arguments");
        return NULL;
    }
    PyObject *blocks = args[0], *tail = args[1], *tracked = args[2], *last = args[3];
    PyObject *num_children = args[4], *add = args[6];
    long long clock = PyLong_AsLongLong(args[5]);
    if (clock == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n;
    PyObject *lists[2] = {last, num_children};
    if (check_lists(tracked, &n, lists, 2) < 0) return NULL;
    if (!PyList_Check(blocks)) {
        PyErr_SetString(PyExc_TypeError, "free_list_append: blocks must be a list");
        return NULL;
    }
    char *track = PyByteArray_AS_STRING(tracked);
    bind_block_type(tail);
    PyObject *last_block = bget(tail, B_PREV);
    if (last_block == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *block = Py_NewRef(PyList_GET_ITEM(blocks, i));
        if (bset(block, B_PREV, last_block) < 0 ||
            bset(last_block, B_NEXT, block) < 0) {
            Py_DECREF(block);
            goto fail;
        }
        Py_SETREF(last_block, block);
        int none = attr_is_none(block, B_HASH);
        if (none < 0) goto fail;
        if (none) continue; /* unhashed: reused in vLLM's order */
        Py_ssize_t id = block_id_of(block, n);
        if (id < 0) goto fail;
        track[id] = 1;
        if (set_item_long(last, id, clock + 1 + i) < 0) goto fail;
        long long children;
        if (item_long(num_children, id, &children) < 0) goto fail;
        if (!children && call_void(add, id) < 0) goto fail;
    }
    if (bset(last_block, B_NEXT, tail) < 0 ||
        bset(tail, B_PREV, last_block) < 0)
        goto fail;
    Py_DECREF(last_block);
    Py_RETURN_NONE;
fail:
    Py_DECREF(last_block);
    return NULL;
}

/* Unlink block from the list: its neighbours point at each other, its links become None. */
static int unlink_block(PyObject *block, int *linked) {
    PyObject *before = bget(block, B_PREV);
    if (before == NULL) return -1;
    PyObject *after = bget(block, B_NEXT);
    if (after == NULL) {
        Py_DECREF(before);
        return -1;
    }
    int rc = 0;
    *linked = before != Py_None && after != Py_None;
    if (*linked) {
        rc = (bset(before, B_NEXT, after) < 0 ||
              bset(after, B_PREV, before) < 0 ||
              bset(block, B_PREV, Py_None) < 0 ||
              bset(block, B_NEXT, Py_None) < 0)
                 ? -1
                 : 0;
    }
    Py_DECREF(before);
    Py_DECREF(after);
    return rc;
}

static PyObject *free_list_popleft(PyObject *Py_UNUSED(self), PyObject *const *args,
                                   Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "free_list_popleft takes 12 arguments");
        return NULL;
    }
    PyObject *head = args[0], *tracked = args[2], *blocks = args[3], *parent_of = args[4];
    PyObject *parent_gen = args[5], *gen = args[6], *num_children = args[7], *content = args[8];
    PyObject *pop = args[9], *pushpop = args[10], *add = args[11];
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n;
    PyObject *lists[6] = {blocks, parent_of, parent_gen, gen, num_children, content};
    if (check_lists(tracked, &n, lists, 6) < 0) return NULL;
    char *track = PyByteArray_AS_STRING(tracked);
    bind_block_type(head);
    PyObject *taken = PyList_New(0);
    if (taken == NULL) return NULL;
    long long carry = -1;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *victim = bget(head, B_NEXT);
        if (victim == NULL) goto fail;
        Py_ssize_t id = block_id_of(victim, n);
        if (id < 0) {
            Py_DECREF(victim);
            goto fail;
        }
        if (track[id]) {
            long long chosen;
            if (carry >= 0) {
                chosen = call_rank(pushpop, carry, 1);
                carry = -1;
            } else {
                chosen = call_rank(pop, 0, 0);
            }
            if (chosen == -2 || (chosen >= n)) {
                if (chosen >= n) PyErr_SetString(PyExc_IndexError, "free list: bad victim id");
                Py_DECREF(victim);
                goto fail;
            }
            if (chosen >= 0) {
                id = (Py_ssize_t)chosen;
                Py_SETREF(victim, Py_NewRef(PyList_GET_ITEM(blocks, id)));
            }
            track[id] = 0;
        }
        int linked;
        if (unlink_block(victim, &linked) < 0 || PyList_Append(taken, victim) < 0) {
            Py_DECREF(victim);
            goto fail;
        }
        Py_DECREF(victim);
        if (!linked) {
            PyErr_SetString(PyExc_RuntimeError, "free list: a block to take is not linked");
            goto fail;
        }
        if (PyList_GET_ITEM(content, id) != Py_None) { /* its hashes go next */
            PyObject *old = PyList_GET_ITEM(content, id);
            PyList_SET_ITEM(content, id, Py_NewRef(Py_None));
            Py_DECREF(old);
            long long children, g, parent, pg, pgen;
            if (item_long(num_children, id, &children) < 0) goto fail;
            if (children) { /* links of its children name an older generation */
                if (set_item_long(num_children, id, 0) < 0) goto fail;
                if (item_long(gen, id, &g) < 0 || set_item_long(gen, id, g + 1) < 0) goto fail;
            }
            if (item_long(parent_of, id, &parent) < 0) goto fail;
            if (parent >= 0) {
                if (parent >= n) {
                    PyErr_SetString(PyExc_IndexError, "free list: bad parent id");
                    goto fail;
                }
                if (item_long(parent_gen, id, &pg) < 0 || item_long(gen, parent, &pgen) < 0)
                    goto fail;
                if (pg == pgen) {
                    long long left;
                    if (item_long(num_children, parent, &left) < 0) goto fail;
                    left -= 1;
                    if (set_item_long(num_children, parent, left) < 0) goto fail;
                    if (!left && track[parent]) {
                        if (carry >= 0 && call_void(add, carry) < 0) goto fail;
                        carry = parent;
                    }
                }
            }
        }
    }
    if (carry >= 0 && call_void(add, carry) < 0) goto fail;
    return taken;
fail:
    Py_DECREF(taken);
    return NULL;
}

static PyObject *free_list_touch(PyObject *Py_UNUSED(self), PyObject *const *args,
                                 Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "free_list_touch takes 5 arguments");
        return NULL;
    }
    PyObject *tracked = args[1], *num_children = args[2], *hits = args[3], *discard = args[4];
    Py_ssize_t n;
    PyObject *lists[2] = {num_children, hits};
    if (check_lists(tracked, &n, lists, 2) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "free_list_touch: blocks must be a sequence");
    if (seq == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(seq)) bind_block_type(PySequence_Fast_GET_ITEM(seq, 0));
    char *track = PyByteArray_AS_STRING(tracked);
    Py_ssize_t unlinked = 0, bad = -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *block = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *v = bget(block, B_NULL);
        if (v == NULL) goto fail;
        int is_null = PyObject_IsTrue(v);
        Py_DECREF(v);
        if (is_null < 0) goto fail;
        if (is_null) continue;
        Py_ssize_t id = block_id_of(block, n);
        if (id < 0) goto fail;
        v = bget(block, B_REF);
        if (v == NULL) goto fail;
        long long ref = PyLong_AsLongLong(v);
        Py_DECREF(v);
        if (ref == -1 && PyErr_Occurred()) goto fail;
        if (ref == 0) { /* in the free list: take it out */
            int linked;
            if (unlink_block(block, &linked) < 0) goto fail;
            if (!linked) {
                bad = i;
                break;
            }
            unlinked++;
            if (track[id]) {
                track[id] = 0;
                long long children;
                if (item_long(num_children, id, &children) < 0) goto fail;
                if (!children && call_void(discard, id) < 0) goto fail;
            }
        }
        v = PyLong_FromLongLong(ref + 1);
        if (v == NULL) goto fail;
        int rc = bset(block, B_REF, v);
        Py_DECREF(v);
        if (rc < 0) goto fail;
        int none = attr_is_none(block, B_HASH);
        if (none < 0) goto fail;
        if (!none) {
            long long h;
            if (item_long(hits, id, &h) < 0 || set_item_long(hits, id, h + 1) < 0) goto fail;
        }
    }
    Py_DECREF(seq);
    return Py_BuildValue("nn", unlinked, bad);
fail:
    Py_DECREF(seq);
    return NULL;
}

/* -- module ----------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"bind_node_type", bind_node_type, METH_O, "Record the __slots__ offsets of a node class."},
    {"walk", walk, METH_VARARGS, "Descend a radix tree along a key (see kvplug.speedups.walk)."},
    {"stamp_hits", stamp_hits, METH_VARARGS, "Time and one hit for path[:count]."},
    {"lock_path", lock_path, METH_VARARGS, "Lock or unlock the path from a node to the root."},
    {"check_slots", check_slots, METH_VARARGS, "Range, duplicate and owner-state scan of slots."},
    {"release_slots", release_slots, METH_VARARGS, "A checked free into a free-id stack."},
    {"distinct_units", distinct_units, METH_VARARGS, "The distinct units (slot // div) of slots."},
    {"expand_units", expand_units, METH_VARARGS, "The slots of pages, in order."},
    {"check_token_ids", check_token_ids, METH_VARARGS, "Every token id an int that fits in int64."},
    {"common_prefix", common_prefix, METH_VARARGS, "The common prefix length of two int64 arrays."},
    {"sha256_chain", sha256_chain, METH_VARARGS, "Chained SHA-256 page digests of a buffer."},
    {"common_items", common_items, METH_VARARGS, "The common leading items of two tuple ranges."},
    {"pack_int64", pack_int64, METH_VARARGS, "ids[start:stop] as int64 bytes, array('q')'s."},
    {"free_list_append", (PyCFunction)(void (*)(void))free_list_append, METH_FASTCALL,
     "Append blocks to a policy free list (see kvplug.speedups)."},
    {"free_list_popleft", (PyCFunction)(void (*)(void))free_list_popleft, METH_FASTCALL,
     "Take blocks from a policy free list (see kvplug.speedups)."},
    {"free_list_touch", (PyCFunction)(void (*)(void))free_list_touch, METH_FASTCALL,
     "vLLM's touch over a policy free list (see kvplug.speedups)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvplug._speedups",
                                    "Compiled kernels of kvplug.speedups.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__speedups(void) {
    if (intern_names() < 0 || PyType_Ready(&BlockHeapType) < 0 ||
        PyType_Ready(&S3FIFORankType) < 0 || PyType_Ready(&ARCRankType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "BlockHeap", (PyObject *)&BlockHeapType) < 0 ||
        PyModule_AddObjectRef(m, "S3FIFORank", (PyObject *)&S3FIFORankType) < 0 ||
        PyModule_AddObjectRef(m, "ARCRank", (PyObject *)&ARCRankType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
