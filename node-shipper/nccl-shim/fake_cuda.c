// SPDX-License-Identifier: Apache-2.0
/*
 * A stand-in for the CUDA driver's event API, for the workload on machines without GPUs:
 * built as libcuda.so.1 (that soname, so the shim's dlopen("libcuda.so.1", RTLD_NOLOAD)
 * finds it once the workload loaded it). Only what the shim calls for copy-engine
 * collectives: cuEventCreate/Record/Query/Destroy_v2 and cuCtxGetCurrent/SetCurrent.
 * Streams are struct rw_fake_stream (fake_cuda.h); CUDA's codes: 0 success, 1 invalid
 * value, 2 out of memory, 600 not ready.
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "fake_cuda.h"

#define EXPORT __attribute__((visibility("default")))

struct fake_event {
	struct rw_fake_stream *stream;
	uint64_t ticket;
};

EXPORT int cuEventCreate(void **event, unsigned flags)
{
	(void)flags;
	if (!event)
		return 1;
	*event = calloc(1, sizeof(struct fake_event));
	return *event ? 0 : 2;
}

EXPORT int cuEventRecord(void *event, void *stream)
{
	struct fake_event *e = event;
	struct rw_fake_stream *s = stream;
	if (!e || !s)
		return 1;
	e->stream = s;
	e->ticket = atomic_fetch_add(&s->recorded, 1) + 1;
	return 0;
}

EXPORT int cuEventQuery(void *event)
{
	struct fake_event *e = event;
	if (!e)
		return 1;
	return e->stream && atomic_load(&e->stream->done) >= e->ticket ? 0 : 600;
}

EXPORT int cuEventDestroy_v2(void *event)
{
	free(event);
	return 0;
}

EXPORT int cuCtxGetCurrent(void **ctx)
{
	if (!ctx)
		return 1;
	*ctx = NULL;
	return 0;
}

EXPORT int cuCtxSetCurrent(void *ctx)
{
	(void)ctx;
	return 0;
}
