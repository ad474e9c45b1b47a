/* What copy.c registers of plan.c: the copy plan of a batch of stored blocks (the connector's gather/scatter). */
#ifndef KVSTORE_PLAN_H
#define KVSTORE_PLAN_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

PyObject *kvc_plan_pieces(PyObject *self, PyObject *args);

#endif
