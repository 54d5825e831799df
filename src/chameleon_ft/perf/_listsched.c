/* The list scheduler of chameleon_ft.perf.list_scheduler, compiled.
 *
 * run() times every operation of one operation graph exactly as _ListRun.run() does in
 * Python: the same floating-point operations in the same order, the same stack and event
 * orders, the same tie-breaks, so both give bit-identical timelines (the tests compare
 * them on random graphs). Python stays the reference; this file only makes the
 * simulator's most expensive step cheap (a rerouted component of the 16k-GPU job is
 * 70,000 operations).
 *
 * Workers that run one stream are timed eagerly in dependency order (drain); workers that
 * merge several streams (rerouted peers) go through an event queue ordered by
 * (time, sequence number), where a priority rule picks among the stream heads ready now.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double t;
    long long seq;
    int wake; /* 0: op done, 1: wake the worker */
    Py_ssize_t payload;
} Event;

typedef struct {
    Event *items;
    Py_ssize_t size, cap;
} Heap;

typedef struct {
    Py_ssize_t *items;
    Py_ssize_t size, cap;
} Stack;

/* The priority key of one ready op: compared field by field, as Python compares the
 * tuples of list_scheduler.PRIORITIES. */
typedef struct {
    long kw, nr, nb, mb, rank, stage, chunk;
    double ready;
} Key;

enum { RULE_REROUTED_FIRST = 0, RULE_BACKWARD_FIRST = 1, RULE_READY_FIRST = 2 };

typedef struct {
    Py_ssize_t n, nw, num_streams;
    int rule;
    /* the graph, read-only */
    long *op_wi;
    double *op_dur, *op_act;
    Py_ssize_t *succ_ptr, *succ_dst;
    double *succ_delay;
    Py_ssize_t *stream_id, *next_in_stream, *prev_in_stream;
    Py_ssize_t *ws_ptr, *ws_ids; /* each worker's streams */
    Py_ssize_t *stream_last;     /* each stream's last op */
    char *single;
    PyObject *op_kind, *op_pipeline, *op_stage, *op_mb, *op_chunk, *op_foreign, *ranks;
    /* the run */
    long *pending;
    double *ready, *end, *busy_until, *wake_at, *busy_s, *act_now, *act_peak;
    Py_ssize_t *ready_cause, *cause_op, *head, *last_op;
    char *running;
    Py_ssize_t *started; /* merging workers' ops in start order */
    Py_ssize_t num_started;
    long long seq;
    Heap events;
    Stack stack, touched;
} Run;

static int stack_push(Stack *s, Py_ssize_t v) {
    if (s->size == s->cap) {
        Py_ssize_t cap = s->cap ? 2 * s->cap : 64;
        Py_ssize_t *items = realloc(s->items, (size_t)cap * sizeof(Py_ssize_t));
        if (!items) { PyErr_NoMemory(); return -1; }
        s->items = items;
        s->cap = cap;
    }
    s->items[s->size++] = v;
    return 0;
}

static inline int event_less(const Event *a, const Event *b) {
    return a->t < b->t || (a->t == b->t && a->seq < b->seq);
}

static int heap_push(Heap *h, double t, long long seq, int wake, Py_ssize_t payload) {
    if (h->size == h->cap) {
        Py_ssize_t cap = h->cap ? 2 * h->cap : 64;
        Event *items = realloc(h->items, (size_t)cap * sizeof(Event));
        if (!items) { PyErr_NoMemory(); return -1; }
        h->items = items;
        h->cap = cap;
    }
    Event e = {t, seq, wake, payload};
    Py_ssize_t i = h->size++;
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!event_less(&e, &h->items[parent])) break;
        h->items[i] = h->items[parent];
        i = parent;
    }
    h->items[i] = e;
    return 0;
}

static Event heap_pop(Heap *h) {
    Event top = h->items[0];
    Event last = h->items[--h->size];
    Py_ssize_t i = 0, n = h->size;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && event_less(&h->items[c + 1], &h->items[c])) c++;
        if (!event_less(&h->items[c], &last)) break;
        h->items[i] = h->items[c];
        i = c;
    }
    if (n > 0) h->items[i] = last;
    return top;
}

/* ------------------------------------------------------------------ reading the graph */

static int read_long(PyObject *item, long *out) {
    long v = PyLong_AsLong(item);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static PyObject *checked_list(PyObject *obj, Py_ssize_t n, const char *name) {
    if (!PyList_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list", name);
        return NULL;
    }
    if (n >= 0 && PyList_GET_SIZE(obj) != n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd entries, expected %zd", name,
                     PyList_GET_SIZE(obj), n);
        return NULL;
    }
    return obj;
}

static int indices(PyObject *list, Py_ssize_t n, const char *name, Py_ssize_t *out) {
    if (!checked_list(list, n, name)) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(PyList_GET_ITEM(list, i));
        if (v == -1 && PyErr_Occurred()) return -1;
        out[i] = v;
    }
    return 0;
}

static int doubles(PyObject *list, Py_ssize_t n, const char *name, double *out) {
    if (!checked_list(list, n, name)) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        double v = PyFloat_AsDouble(PyList_GET_ITEM(list, i));
        if (v == -1.0 && PyErr_Occurred()) return -1;
        out[i] = v;
    }
    return 0;
}

/* The edges src -> dst (delay), grouped by source in the order given (a stable counting
 * sort: each op releases its successors in the order the edges were added), and each
 * op's number of predecessors. */
static int read_edges(Run *r, PyObject *src, PyObject *dst, PyObject *delay) {
    if (!checked_list(src, -1, "edge_src")) return -1;
    Py_ssize_t total = PyList_GET_SIZE(src);
    if (!checked_list(dst, total, "edge_dst") || !checked_list(delay, total, "edge_delay"))
        return -1;
    Py_ssize_t *from = malloc((size_t)(total ? total : 1) * sizeof(Py_ssize_t));
    r->succ_ptr = calloc((size_t)r->n + 1, sizeof(Py_ssize_t));
    r->succ_dst = malloc((size_t)(total ? total : 1) * sizeof(Py_ssize_t));
    r->succ_delay = malloc((size_t)(total ? total : 1) * sizeof(double));
    if (!from || !r->succ_ptr || !r->succ_dst || !r->succ_delay) {
        free(from);
        PyErr_NoMemory();
        return -1;
    }
    int failed = indices(src, total, "edge_src", from);
    for (Py_ssize_t e = 0; !failed && e < total; e++) {
        if (from[e] < 0 || from[e] >= r->n) {
            PyErr_SetString(PyExc_ValueError, "an edge names an op out of range");
            failed = 1;
        } else {
            r->succ_ptr[from[e] + 1]++;
        }
    }
    for (Py_ssize_t i = 0; !failed && i < r->n; i++) r->succ_ptr[i + 1] += r->succ_ptr[i];
    memset(r->pending, 0, (size_t)r->n * sizeof(long));
    for (Py_ssize_t e = 0; !failed && e < total; e++) {
        Py_ssize_t to = PyLong_AsSsize_t(PyList_GET_ITEM(dst, e));
        double d = PyFloat_AsDouble(PyList_GET_ITEM(delay, e));
        if (PyErr_Occurred()) {
            failed = 1;
        } else if (to < 0 || to >= r->n) {
            PyErr_SetString(PyExc_ValueError, "an edge names an op out of range");
            failed = 1;
        } else {
            Py_ssize_t slot = r->succ_ptr[from[e]]++;  /* the next free slot of its source */
            r->succ_dst[slot] = to;
            r->succ_delay[slot] = d;
            r->pending[to]++;
        }
    }
    free(from);
    if (failed) return -1;
    /* Each source's slot pointer now stands at the next source's start: shift back. */
    for (Py_ssize_t i = r->n; i > 0; i--) r->succ_ptr[i] = r->succ_ptr[i - 1];
    r->succ_ptr[0] = 0;
    return 0;
}

/* Each worker's streams (flattened), each stream's first and last op, and per op its
 * worker, its stream and its neighbours in the stream (graph._Graph.layout): every op
 * is in exactly one stream. */
static int read_streams(Run *r, PyObject *wi_streams, PyObject *streams) {
    if (!checked_list(wi_streams, r->nw, "wi_streams")) return -1;
    if (!checked_list(streams, -1, "streams")) return -1;
    Py_ssize_t num_streams = PyList_GET_SIZE(streams), total = 0;
    r->num_streams = num_streams;
    for (Py_ssize_t w = 0; w < r->nw; w++) {
        PyObject *row = PyList_GET_ITEM(wi_streams, w);
        if (!checked_list(row, -1, "wi_streams[w]")) return -1;
        total += PyList_GET_SIZE(row);
    }
    r->ws_ptr = malloc((size_t)(r->nw + 1) * sizeof(Py_ssize_t));
    r->ws_ids = malloc((size_t)(total ? total : 1) * sizeof(Py_ssize_t));
    r->single = malloc((size_t)(r->nw ? r->nw : 1));
    r->head = malloc((size_t)(num_streams ? num_streams : 1) * sizeof(Py_ssize_t));
    r->stream_last = malloc((size_t)(num_streams ? num_streams : 1) * sizeof(Py_ssize_t));
    if (!r->ws_ptr || !r->ws_ids || !r->single || !r->head || !r->stream_last) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < r->n; i++) r->stream_id[i] = -1;
    for (Py_ssize_t sid = 0; sid < num_streams; sid++) r->head[sid] = -1;
    Py_ssize_t k = 0, placed = 0;
    for (Py_ssize_t w = 0; w < r->nw; w++) {
        PyObject *row = PyList_GET_ITEM(wi_streams, w);
        r->ws_ptr[w] = k;
        r->single[w] = PyList_GET_SIZE(row) == 1;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(row); i++, k++) {
            Py_ssize_t sid = PyLong_AsSsize_t(PyList_GET_ITEM(row, i));
            if (sid == -1 && PyErr_Occurred()) return -1;
            if (sid < 0 || sid >= num_streams || r->head[sid] != -1) {
                PyErr_SetString(PyExc_ValueError,
                                "a worker names a stream out of range or another's");
                return -1;
            }
            r->ws_ids[k] = sid;
            PyObject *ids = PyList_GET_ITEM(streams, sid);
            if (!checked_list(ids, -1, "streams[s]")) return -1;
            Py_ssize_t len = PyList_GET_SIZE(ids), before = r->n;
            if (len == 0) {
                PyErr_SetString(PyExc_ValueError, "a stream has no operation");
                return -1;
            }
            for (Py_ssize_t x = 0; x < len; x++) {
                Py_ssize_t op_id = PyLong_AsSsize_t(PyList_GET_ITEM(ids, x));
                if (op_id == -1 && PyErr_Occurred()) return -1;
                if (op_id < 0 || op_id >= r->n || r->stream_id[op_id] != -1) {
                    PyErr_SetString(PyExc_ValueError,
                                    "a stream names an op out of range or another's");
                    return -1;
                }
                r->op_wi[op_id] = (long)w;
                r->stream_id[op_id] = sid;
                r->prev_in_stream[op_id] = before;
                r->next_in_stream[op_id] = -1;
                if (before < r->n) r->next_in_stream[before] = op_id;
                before = op_id;
            }
            r->head[sid] = PyLong_AsSsize_t(PyList_GET_ITEM(ids, 0));
            r->stream_last[sid] = before;
            placed += len;
        }
    }
    r->ws_ptr[r->nw] = k;
    if (placed != r->n) {
        PyErr_SetString(PyExc_ValueError, "every op must be in exactly one worker's stream");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ the run */

static int release(Run *r, Py_ssize_t op_id, double t1) {
    for (Py_ssize_t e = r->succ_ptr[op_id]; e < r->succ_ptr[op_id + 1]; e++) {
        Py_ssize_t dst = r->succ_dst[e];
        double arrival = t1 + r->succ_delay[e];
        if (arrival >= r->ready[dst]) {
            r->ready[dst] = arrival;
            r->ready_cause[dst] = op_id;
        }
        if (--r->pending[dst] == 0) {
            long u = r->op_wi[dst];
            if (!r->single[u]) {
                if (stack_push(&r->touched, u) < 0) return -1;
            } else if (r->end[r->prev_in_stream[dst]] >= 0.0) {
                if (stack_push(&r->stack, dst) < 0) return -1;
            }
        }
    }
    return 0;
}

/* Time every eager op that can run now, and what it releases. */
static int drain(Run *r) {
    while (r->stack.size) {
        Py_ssize_t op_id = r->stack.items[--r->stack.size];
        Py_ssize_t before = r->prev_in_stream[op_id];
        double free_at = r->end[before];
        double ready = r->ready[op_id], t1;
        if (ready >= free_at) {
            t1 = ready + r->op_dur[op_id];
            Py_ssize_t rc = r->ready_cause[op_id];
            r->cause_op[op_id] = rc >= 0 ? rc : before;
        } else {
            t1 = free_at + r->op_dur[op_id];
            r->cause_op[op_id] = before;
        }
        if (release(r, op_id, t1) < 0) return -1;
        r->end[op_id] = t1;
        Py_ssize_t nxt = r->next_in_stream[op_id];
        if (nxt >= 0 && r->pending[nxt] == 0 && stack_push(&r->stack, nxt) < 0) return -1;
    }
    return 0;
}

static int op_key(Run *r, Py_ssize_t op_id, double ready, Key *key) {
    long kind, p;
    if (read_long(PyList_GET_ITEM(r->op_kind, op_id), &kind) < 0 ||
        read_long(PyList_GET_ITEM(r->op_pipeline, op_id), &p) < 0 ||
        read_long(PyList_GET_ITEM(r->op_stage, op_id), &key->stage) < 0 ||
        read_long(PyList_GET_ITEM(r->op_mb, op_id), &key->mb) < 0 ||
        read_long(PyList_GET_ITEM(r->op_chunk, op_id), &key->chunk) < 0)
        return -1;
    if (p < 0 || p >= PyList_GET_SIZE(r->ranks)) {
        PyErr_SetString(PyExc_ValueError, "an op names a pipeline without a rank");
        return -1;
    }
    if (read_long(PyList_GET_ITEM(r->ranks, p), &key->rank) < 0) return -1;
    int foreign = PyObject_IsTrue(PyList_GET_ITEM(r->op_foreign, op_id));
    if (foreign < 0) return -1;
    key->kw = kind == 2;
    key->nb = kind != 1;
    key->nr = !foreign;
    key->ready = ready;
    return 0;
}

#define CMP(a, b) if ((a) != (b)) return (a) < (b)

/* a < b under the rule (list_scheduler._rerouted_first, _backward_first, _ready_first). */
static int key_less(int rule, const Key *a, const Key *b) {
    CMP(a->kw, b->kw);
    if (rule == RULE_REROUTED_FIRST) {
        CMP(a->nr, b->nr);
        CMP(a->nb, b->nb);
        CMP(a->mb, b->mb);
        CMP(a->ready, b->ready);
    } else if (rule == RULE_BACKWARD_FIRST) {
        CMP(a->nb, b->nb);
        CMP(a->mb, b->mb);
        CMP(a->ready, b->ready);
    } else {
        CMP(a->ready, b->ready);
        CMP(a->nb, b->nb);
        CMP(a->mb, b->mb);
    }
    CMP(a->rank, b->rank);
    CMP(a->stage, b->stage);
    CMP(a->chunk, b->chunk);
    return 0;
}

/* The ready stream head of merging worker w the rule picks at `now` (-1: none), and when
 * the next one becomes ready (infinity: none known). */
static int choose(Run *r, long w, double now, Py_ssize_t *best, double *wait) {
    Key best_key, key;
    *best = -1;
    *wait = INFINITY;
    for (Py_ssize_t k = r->ws_ptr[w]; k < r->ws_ptr[w + 1]; k++) {
        Py_ssize_t op_id = r->head[r->ws_ids[k]];
        if (op_id < 0 || r->pending[op_id]) continue;
        double ready = r->ready[op_id];
        if (ready > now + 1e-12) {
            if (ready < *wait) *wait = ready;
            continue;
        }
        if (op_key(r, op_id, ready, &key) < 0) return -1;
        if (*best < 0 || key_less(r->rule, &key, &best_key)) {
            *best = op_id;
            best_key = key;
        }
    }
    return 0;
}

/* Start merging worker w's next op at `now` if it is idle and one is ready; else wake it
 * when the next one is. */
static int try_start(Run *r, long w, double now) {
    if (r->running[w]) return 0;
    Py_ssize_t best;
    double wait;
    if (choose(r, w, now, &best, &wait) < 0) return -1;
    if (best < 0) {
        if (wait < r->wake_at[w]) {
            r->wake_at[w] = wait;
            if (heap_push(&r->events, wait, r->seq++, 1, w) < 0) return -1;
        }
        return 0;
    }
    double free_at = r->busy_until[w];
    double t0 = now > free_at ? now : free_at;
    Py_ssize_t cause = r->ready_cause[best];
    r->cause_op[best] = (cause >= 0 && r->ready[best] >= free_at) ? cause : r->last_op[w];
    double t1 = t0 + r->op_dur[best];
    r->end[best] = t1;
    r->running[w] = 1;
    r->head[r->stream_id[best]] = r->next_in_stream[best];
    r->started[r->num_started++] = best;
    r->busy_s[w] += r->op_dur[best];
    double act = r->act_now[w] + r->op_act[best];
    r->act_now[w] = act;
    if (act > r->act_peak[w]) r->act_peak[w] = act;
    return heap_push(&r->events, t1, r->seq++, 0, best);
}

static int run_events(Run *r) {
    for (long w = 0; w < r->nw; w++) {
        if (!r->single[w]) continue;
        Py_ssize_t first = r->head[r->ws_ids[r->ws_ptr[w]]];
        if (first >= 0 && r->pending[first] == 0 && stack_push(&r->stack, first) < 0)
            return -1;
    }
    if (drain(r) < 0) return -1;
    for (long w = 0; w < r->nw; w++)
        if (!r->single[w] && try_start(r, w, 0.0) < 0) return -1;
    r->touched.size = 0;
    while (r->events.size) {
        Event ev = heap_pop(&r->events);
        if (ev.wake) {
            if (r->wake_at[ev.payload] == ev.t) r->wake_at[ev.payload] = INFINITY;
            if (try_start(r, (long)ev.payload, ev.t) < 0) return -1;
            continue;
        }
        Py_ssize_t op_id = ev.payload;
        long w = r->op_wi[op_id];
        r->running[w] = 0;
        r->busy_until[w] = ev.t;
        r->last_op[w] = op_id;
        if (release(r, op_id, ev.t) < 0) return -1;
        if (r->stack.size && drain(r) < 0) return -1;
        if (try_start(r, w, ev.t) < 0) return -1;
        while (r->touched.size)
            if (try_start(r, (long)r->touched.items[--r->touched.size], ev.t) < 0) return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ set-up and results */

static void run_free(Run *r) {
    void *blocks[] = {r->op_wi, r->op_dur, r->op_act, r->succ_ptr, r->succ_dst,
                      r->succ_delay, r->stream_id, r->next_in_stream, r->prev_in_stream,
                      r->ws_ptr, r->ws_ids, r->stream_last, r->single, r->pending, r->ready, r->end,
                      r->busy_until, r->wake_at, r->busy_s, r->act_now, r->act_peak,
                      r->ready_cause, r->cause_op, r->head, r->last_op, r->running,
                      r->started, r->events.items, r->stack.items, r->touched.items};
    for (size_t i = 0; i < sizeof(blocks) / sizeof(blocks[0]); i++) free(blocks[i]);
}

static int run_alloc(Run *r) {
    size_t n = (size_t)r->n, nw = (size_t)(r->nw ? r->nw : 1);
    r->op_wi = malloc((n ? n : 1) * sizeof(long));
    r->pending = malloc((n ? n : 1) * sizeof(long));
    r->op_dur = malloc((n ? n : 1) * sizeof(double));
    r->op_act = malloc((n ? n : 1) * sizeof(double));
    r->ready = calloc(n ? n : 1, sizeof(double));
    r->end = malloc((n + 1) * sizeof(double));
    r->stream_id = malloc((n ? n : 1) * sizeof(Py_ssize_t));
    r->next_in_stream = malloc((n ? n : 1) * sizeof(Py_ssize_t));
    r->prev_in_stream = malloc((n ? n : 1) * sizeof(Py_ssize_t));
    r->ready_cause = malloc((n ? n : 1) * sizeof(Py_ssize_t));
    r->cause_op = malloc((n ? n : 1) * sizeof(Py_ssize_t));
    r->started = malloc((n ? n : 1) * sizeof(Py_ssize_t));
    r->busy_until = calloc(nw, sizeof(double));
    r->wake_at = malloc(nw * sizeof(double));
    r->busy_s = calloc(nw, sizeof(double));
    r->act_now = calloc(nw, sizeof(double));
    r->act_peak = calloc(nw, sizeof(double));
    r->last_op = malloc(nw * sizeof(Py_ssize_t));
    r->running = calloc(nw, 1);
    if (!r->op_wi || !r->pending || !r->op_dur || !r->op_act || !r->ready || !r->end ||
        !r->stream_id || !r->next_in_stream || !r->prev_in_stream || !r->ready_cause ||
        !r->cause_op || !r->started || !r->busy_until || !r->wake_at || !r->busy_s ||
        !r->act_now || !r->act_peak || !r->last_op || !r->running) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        r->end[i] = -1.0;
        r->ready_cause[i] = -1;
        r->cause_op[i] = -1;
    }
    r->end[n] = 0.0; /* where every stream's first op finds its worker free */
    for (size_t w = 0; w < nw; w++) {
        r->wake_at[w] = INFINITY;
        r->last_op[w] = -1;
    }
    return 0;
}

static PyObject *double_list(const double *values, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyFloat_FromDouble(values[i]);
        if (!v) { Py_DECREF(list); return NULL; }
        PyList_SET_ITEM(list, i, v);
    }
    return list;
}

/* Per worker, the ops it started in order (merging workers; empty for the others). */
static PyObject *orders(Run *r) {
    PyObject *result = PyList_New(r->nw);
    if (!result) return NULL;
    for (Py_ssize_t w = 0; w < r->nw; w++) {
        PyObject *row = PyList_New(0);
        if (!row) { Py_DECREF(result); return NULL; }
        PyList_SET_ITEM(result, w, row);
    }
    for (Py_ssize_t i = 0; i < r->num_started; i++) {
        Py_ssize_t op_id = r->started[i];
        PyObject *v = PyLong_FromSsize_t(op_id);
        if (!v || PyList_Append(PyList_GET_ITEM(result, r->op_wi[op_id]), v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(v);
    }
    return result;
}

/* What a timeline needs: each stream's end, the merging workers' figures, the makespan
 * (the first op ending last) and the computation on the critical path that ends there. */
static PyObject *results(Run *r, int with_order) {
    for (Py_ssize_t i = 0; i < r->n; i++) {
        if (r->end[i] < 0.0) {
            /* A fixed per-stage order that waits on an op queued behind it on another
             * worker; the orders of stage_order never do. */
            PyErr_SetString(PyExc_RuntimeError, "schedule deadlocked");
            return NULL;
        }
    }
    double makespan = 0.0, compute = 0.0;
    if (r->n) {
        Py_ssize_t node = 0;
        for (Py_ssize_t i = 1; i < r->n; i++)
            if (r->end[i] > r->end[node]) node = i;
        makespan = r->end[node];
        /* a stream's first op may name the slot past the end; causes end earlier */
        for (Py_ssize_t steps = 0; node >= 0 && node < r->n && steps <= r->n; steps++) {
            compute += r->op_dur[node];
            node = r->cause_op[node];
        }
    }
    double *stream_end = malloc((size_t)(r->num_streams ? r->num_streams : 1) * sizeof(double));
    if (!stream_end) return PyErr_NoMemory();
    for (Py_ssize_t sid = 0; sid < r->num_streams; sid++)
        stream_end[sid] = r->end[r->stream_last[sid]];
    PyObject *ends = double_list(stream_end, r->num_streams);
    free(stream_end);
    PyObject *busy_until = double_list(r->busy_until, r->nw);
    PyObject *busy_s = double_list(r->busy_s, r->nw);
    PyObject *peak = double_list(r->act_peak, r->nw);
    PyObject *order = with_order ? orders(r) : Py_NewRef(Py_None);
    PyObject *out = NULL;
    if (ends && busy_until && busy_s && peak && order)
        out = Py_BuildValue("(OOOOOdd)", ends, busy_until, busy_s, peak, order, makespan,
                            compute);
    Py_XDECREF(ends);
    Py_XDECREF(busy_until);
    Py_XDECREF(busy_s);
    Py_XDECREF(peak);
    Py_XDECREF(order);
    return out;
}

PyDoc_STRVAR(run_doc,
"run(op_dur, op_act, edge_src, edge_dst, edge_delay, wi_streams, streams, op_kind,\n"
"    op_pipeline, op_stage, op_mb, op_chunk, op_foreign, ranks, rule, with_order)\n"
"--\n\n"
"List-schedule one operation graph (list_scheduler._ListRun, compiled). ``rule``: 0\n"
"rerouted-first, 1 backward-first, 2 ready-first; ``ranks``: each pipeline's rank,\n"
"indexed by pipeline. Returns (stream_end, busy_until, busy_s, act_peak, order,\n"
"makespan, critical_compute): when each stream's last op ends; per dense worker when it\n"
"is free, its busy seconds, its activation peak and the ops it started (merging workers;\n"
"None without ``with_order``); the last end and the computation on the path to it.\n"
"Raises RuntimeError when the orders deadlock.");

static PyObject *py_run(PyObject *self, PyObject *args) {
    PyObject *op_dur, *op_act, *edge_src, *edge_dst, *edge_delay, *wi_streams, *streams,
        *op_kind, *op_pipeline, *op_stage, *op_mb, *op_chunk, *op_foreign, *ranks;
    int rule, with_order;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!O!O!O!O!O!O!ip", &PyList_Type, &op_dur,
                          &PyList_Type, &op_act, &PyList_Type, &edge_src, &PyList_Type,
                          &edge_dst, &PyList_Type, &edge_delay, &PyList_Type, &wi_streams,
                          &PyList_Type, &streams, &PyList_Type, &op_kind,
                          &PyList_Type, &op_pipeline, &PyList_Type, &op_stage, &PyList_Type,
                          &op_mb, &PyList_Type, &op_chunk, &PyList_Type, &op_foreign,
                          &PyList_Type, &ranks, &rule, &with_order))
        return NULL;
    if (rule < RULE_REROUTED_FIRST || rule > RULE_READY_FIRST) {
        PyErr_SetString(PyExc_ValueError, "rule must be 0, 1 or 2");
        return NULL;
    }
    Run r;
    memset(&r, 0, sizeof r);
    r.n = PyList_GET_SIZE(op_dur);
    r.nw = PyList_GET_SIZE(wi_streams);
    r.rule = rule;
    r.op_kind = op_kind;
    r.op_pipeline = op_pipeline;
    r.op_stage = op_stage;
    r.op_mb = op_mb;
    r.op_chunk = op_chunk;
    r.op_foreign = op_foreign;
    r.ranks = ranks;
    PyObject *out = NULL;
    if (run_alloc(&r) < 0 || doubles(op_dur, r.n, "op_dur", r.op_dur) < 0 ||
        doubles(op_act, r.n, "op_act", r.op_act) < 0 ||
        !checked_list(op_kind, r.n, "op_kind") || !checked_list(op_pipeline, r.n, "op_pipeline") ||
        !checked_list(op_stage, r.n, "op_stage") || !checked_list(op_mb, r.n, "op_mb") ||
        !checked_list(op_chunk, r.n, "op_chunk") || !checked_list(op_foreign, r.n, "op_foreign") ||
        read_streams(&r, wi_streams, streams) < 0 ||
        read_edges(&r, edge_src, edge_dst, edge_delay) < 0 || run_events(&r) < 0)
        goto done;
    out = results(&r, with_order);
done:
    run_free(&r);
    return out;
}

PyDoc_STRVAR(stream_totals_doc,
"stream_totals(op_dur, op_act, streams)\n"
"--\n\n"
"Per stream, run alone in its order: the seconds of its ops (summed from 0.0 in order)\n"
"and the most activation bytes held at once (0.0 at least); graph._Graph.stream_totals.");

static PyObject *py_stream_totals(PyObject *self, PyObject *args) {
    PyObject *op_dur, *op_act, *streams;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &op_dur, &PyList_Type, &op_act,
                          &PyList_Type, &streams))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(op_dur), num_streams = PyList_GET_SIZE(streams);
    if (!checked_list(op_act, n, "op_act")) return NULL;
    double *dur = malloc((size_t)(n ? n : 1) * sizeof(double));
    double *act = malloc((size_t)(n ? n : 1) * sizeof(double));
    double *busy = malloc((size_t)(num_streams ? num_streams : 1) * sizeof(double));
    double *peak = malloc((size_t)(num_streams ? num_streams : 1) * sizeof(double));
    PyObject *out = NULL;
    if (!dur || !act || !busy || !peak) {
        PyErr_NoMemory();
        goto done;
    }
    if (doubles(op_dur, n, "op_dur", dur) < 0 || doubles(op_act, n, "op_act", act) < 0)
        goto done;
    for (Py_ssize_t sid = 0; sid < num_streams; sid++) {
        PyObject *ids = PyList_GET_ITEM(streams, sid);
        if (!checked_list(ids, -1, "streams[s]")) goto done;
        double total = 0.0, held = 0.0, most = 0.0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
            Py_ssize_t op_id = PyLong_AsSsize_t(PyList_GET_ITEM(ids, i));
            if (op_id == -1 && PyErr_Occurred()) goto done;
            if (op_id < 0 || op_id >= n) {
                PyErr_SetString(PyExc_ValueError, "a stream names an op out of range");
                goto done;
            }
            total += dur[op_id];
            held += act[op_id];
            if (held > most) most = held;
        }
        busy[sid] = total;
        peak[sid] = most;
    }
    PyObject *busy_list = double_list(busy, num_streams);
    PyObject *peak_list = double_list(peak, num_streams);
    if (busy_list && peak_list) out = PyTuple_Pack(2, busy_list, peak_list);
    Py_XDECREF(busy_list);
    Py_XDECREF(peak_list);
done:
    free(dur);
    free(act);
    free(busy);
    free(peak);
    return out;
}

PyDoc_STRVAR(shifted_doc,
"shifted(ids, lo, hi, delta)\n"
"--\n\n"
"[i + delta for i in ids[lo:hi]]: the op ids of a copied pipeline\n"
"(graph._GraphBuilder.add_like); ids must be ints.");

static PyObject *py_shifted(PyObject *self, PyObject *args) {
    PyObject *ids;
    Py_ssize_t lo, hi, delta;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!nnn", &PyList_Type, &ids, &lo, &hi, &delta))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    if (lo < 0 || hi > n || lo > hi) {
        PyErr_SetString(PyExc_ValueError, "shifted: lo..hi is not a range of the list");
        return NULL;
    }
    PyObject *out = PyList_New(hi - lo);
    if (!out) return NULL;
    for (Py_ssize_t i = lo; i < hi; i++) {
        Py_ssize_t id = PyLong_AsSsize_t(PyList_GET_ITEM(ids, i));
        if (id == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        PyObject *value = PyLong_FromSsize_t(id + delta);
        if (!value) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i - lo, value);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"run", py_run, METH_VARARGS, run_doc},
    {"stream_totals", py_stream_totals, METH_VARARGS, stream_totals_doc},
    {"shifted", py_shifted, METH_VARARGS, shifted_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_listsched",
    "The list scheduler of chameleon_ft.perf.schedule, compiled (bit-identical results).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__listsched(void) { return PyModule_Create(&module); }
