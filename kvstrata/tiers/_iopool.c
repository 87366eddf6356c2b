/* A small pool of POSIX threads doing positioned reads and writes (preadv/pwritev) for the
 * NVMe tier's slab slots, without the GIL: the event loop submits jobs, the threads run them,
 * and completions are signalled through one eventfd the loop watches (loop.add_reader), many
 * completions per wakeup. Buffers are held (Py_buffer) from submit until their completion is
 * taken by completions(), which runs with the GIL.
 *
 *   pool = Pool(threads)
 *   pool.fileno()                    -> the eventfd (readable while completions are waiting)
 *   pool.submit(tag, write, fd, offset, buffers[, sync]) -> None: all of buffers' bytes
 *                                    moved (a write with sync: then fdatasync(fd))
 *   pool.completions()               -> [(tag, result)]: bytes moved, or -errno
 *   pool.close()                     -> waits for the jobs queued and running, joins threads
 *
 * A short write is retried for the rest; a short read (end of file) ends the job with the
 * bytes read. Errors are -errno (EINTR retried). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

typedef struct job {
    struct job *next;
    Py_ssize_t tag;
    int write;
    int sync;
    int fd;
    off_t offset;
    Py_ssize_t result;
    int nbuf;
    Py_buffer *views;
    struct iovec *iov;
} job_t;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t wake;
    job_t *queue_head, *queue_tail;
    job_t *done_head, *done_tail;
    pthread_t *threads;
    int nthreads;
    int efd;
    int closing;
    int inited; /* lock and condition initialised */
    Py_ssize_t outstanding; /* submitted and not yet taken by completions() */
} Pool;

static Py_ssize_t run_job(job_t *job) {
    struct iovec *iov = job->iov;
    int left = job->nbuf;
    off_t at = job->offset;
    Py_ssize_t total = 0;
    while (left > 0) {
        int n = left < IOV_MAX ? left : IOV_MAX;
        ssize_t got = job->write ? pwritev(job->fd, iov, n, at) : preadv(job->fd, iov, n, at);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (got == 0) {
            if (job->write)
                return -EIO;
            return total; /* end of file */
        }
        total += got;
        at += got;
        size_t rest = (size_t)got;
        while (left > 0 && rest >= iov->iov_len) {
            rest -= iov->iov_len;
            iov++;
            left--;
        }
        if (left > 0 && rest) {
            iov->iov_base = (char *)iov->iov_base + rest;
            iov->iov_len -= rest;
        }
    }
    if (job->write && job->sync) {
        while (fdatasync(job->fd) < 0) {
            if (errno != EINTR)
                return -errno;
        }
    }
    return total;
}

static void *worker(void *arg) {
    Pool *self = (Pool *)arg;
    for (;;) {
        pthread_mutex_lock(&self->lock);
        while (!self->queue_head && !self->closing)
            pthread_cond_wait(&self->wake, &self->lock);
        job_t *job = self->queue_head;
        if (!job) {
            pthread_mutex_unlock(&self->lock);
            return NULL;
        }
        self->queue_head = job->next;
        if (!self->queue_head)
            self->queue_tail = NULL;
        pthread_mutex_unlock(&self->lock);

        job->result = run_job(job);
        job->next = NULL;

        pthread_mutex_lock(&self->lock);
        int signal = self->done_head == NULL;
        if (self->done_tail)
            self->done_tail->next = job;
        else
            self->done_head = job;
        self->done_tail = job;
        pthread_mutex_unlock(&self->lock);
        if (signal) {
            uint64_t one = 1;
            while (write(self->efd, &one, sizeof one) < 0 && errno == EINTR)
                ;
        }
    }
}

static void free_job(job_t *job) {
    for (int i = 0; i < job->nbuf; i++)
        PyBuffer_Release(&job->views[i]);
    PyMem_Free(job->views);
    PyMem_Free(job->iov);
    PyMem_Free(job);
}

static int start_threads(Pool *self, int n) {
    self->threads = PyMem_Calloc((size_t)n, sizeof(pthread_t));
    if (!self->threads) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (pthread_create(&self->threads[i], NULL, worker, self) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_create failed");
            return -1;
        }
        self->nthreads++;
    }
    return 0;
}

static void stop_threads(Pool *self) {
    if (!self->threads)
        return;
    pthread_mutex_lock(&self->lock);
    self->closing = 1;
    pthread_cond_broadcast(&self->wake);
    pthread_mutex_unlock(&self->lock);
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < self->nthreads; i++)
        pthread_join(self->threads[i], NULL);
    Py_END_ALLOW_THREADS
    PyMem_Free(self->threads);
    self->threads = NULL;
    self->nthreads = 0;
}

static int Pool_init(Pool *self, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"threads", NULL};
    int n = 4;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|i", kw, &n))
        return -1;
    if (n < 1 || n > 256) {
        PyErr_SetString(PyExc_ValueError, "threads must be 1..256");
        return -1;
    }
    if (self->inited) {
        PyErr_SetString(PyExc_RuntimeError, "Pool already initialised");
        return -1;
    }
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->wake, NULL);
    self->inited = 1;
    self->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (start_threads(self, n) < 0) {
        stop_threads(self);
        return -1;
    }
    return 0;
}

static PyObject *Pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Pool *self = (Pool *)type->tp_alloc(type, 0);
    if (self)
        self->efd = -1;
    return (PyObject *)self;
}

static void drop_list(job_t *job) {
    while (job) {
        job_t *next = job->next;
        free_job(job);
        job = next;
    }
}

static void Pool_dealloc(Pool *self) {
    stop_threads(self); /* runs what is queued: its buffers stay valid until then */
    drop_list(self->done_head);
    self->done_head = self->done_tail = NULL;
    if (self->efd >= 0)
        close(self->efd);
    if (self->inited) {
        pthread_mutex_destroy(&self->lock);
        pthread_cond_destroy(&self->wake);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Pool_submit(Pool *self, PyObject *args) {
    Py_ssize_t tag;
    int write_, fd;
    long long offset;
    PyObject *bufs;
    int sync = 0;
    if (!PyArg_ParseTuple(args, "npiLO|p", &tag, &write_, &fd, &offset, &bufs, &sync))
        return NULL;
    if (!self->threads || self->closing) {
        PyErr_SetString(PyExc_RuntimeError, "the I/O pool is closed");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(bufs, "buffers must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > INT_MAX / 2) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "between 1 and many buffers");
        return NULL;
    }
    job_t *job = PyMem_Calloc(1, sizeof(job_t));
    if (job) {
        job->views = PyMem_Calloc((size_t)n, sizeof(Py_buffer));
        job->iov = PyMem_Calloc((size_t)n, sizeof(struct iovec));
    }
    if (!job || !job->views || !job->iov) {
        if (job) {
            PyMem_Free(job->views);
            PyMem_Free(job->iov);
            PyMem_Free(job);
        }
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    job->tag = tag;
    job->write = write_;
    job->sync = sync;
    job->fd = fd;
    job->offset = (off_t)offset;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        int flags = write_ ? PyBUF_SIMPLE : PyBUF_WRITABLE;
        if (PyObject_GetBuffer(items[i], &job->views[i], flags | PyBUF_C_CONTIGUOUS) < 0) {
            free_job(job);
            Py_DECREF(seq);
            return NULL;
        }
        job->nbuf++;
        job->iov[i].iov_base = job->views[i].buf;
        job->iov[i].iov_len = (size_t)job->views[i].len;
    }
    Py_DECREF(seq);
    pthread_mutex_lock(&self->lock);
    if (self->queue_tail)
        self->queue_tail->next = job;
    else
        self->queue_head = job;
    self->queue_tail = job;
    self->outstanding++;
    pthread_cond_signal(&self->wake);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyObject *Pool_completions(Pool *self, PyObject *Py_UNUSED(ignored)) {
    uint64_t count;
    if (!self->inited)
        return PyList_New(0);
    if (self->efd >= 0)
        while (read(self->efd, &count, sizeof count) < 0 && errno == EINTR)
            ;
    pthread_mutex_lock(&self->lock);
    job_t *job = self->done_head;
    self->done_head = self->done_tail = NULL;
    pthread_mutex_unlock(&self->lock);
    PyObject *out = PyList_New(0);
    while (job) {
        job_t *next = job->next;
        PyObject *item = out ? Py_BuildValue("(nn)", job->tag, job->result) : NULL;
        if (item) {
            if (PyList_Append(out, item) < 0)
                Py_CLEAR(out);
            Py_DECREF(item);
        } else {
            Py_CLEAR(out);
        }
        free_job(job);
        self->outstanding--;
        job = next;
    }
    return out;
}

static PyObject *Pool_fileno(Pool *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(self->efd);
}

static PyObject *Pool_pending(Pool *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSsize_t(self->outstanding);
}

static PyObject *Pool_close(Pool *self, PyObject *Py_UNUSED(ignored)) {
    stop_threads(self);
    Py_RETURN_NONE;
}

static PyMethodDef Pool_methods[] = {
    {"submit", (PyCFunction)Pool_submit, METH_VARARGS,
     "submit(tag, write, fd, offset, buffers, sync=False): queue one preadv/pwritev of all "
     "the buffers (a write with sync: then fdatasync)"},
    {"completions", (PyCFunction)Pool_completions, METH_NOARGS,
     "[(tag, bytes moved or -errno)] of the jobs finished since the last call"},
    {"fileno", (PyCFunction)Pool_fileno, METH_NOARGS, "the eventfd signalled on completions"},
    {"pending", (PyCFunction)Pool_pending, METH_NOARGS, "jobs submitted and not yet taken"},
    {"close", (PyCFunction)Pool_close, METH_NOARGS,
     "run the jobs queued, then stop the threads (completions() still returns them)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstrata.tiers._iopool.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "POSIX threads doing preadv/pwritev; completions through an eventfd",
    .tp_new = Pool_new,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_iopool", "C I/O pool of the NVMe tier's slab slots", -1, NULL,
};

PyMODINIT_FUNC PyInit__iopool(void) {
    if (PyType_Ready(&PoolType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
