// SPDX-License-Identifier: Apache-2.0
/*
 * A second profiler plugin for the shim's chaining checks (tests only): exports
 * ncclProfiler_v5 and ncclProfiler_v4 (no v6, so a shim loaded as v6 chains to v5),
 * asks for collectives, kernel channels and proxy ops (the shim itself asks for no proxy
 * ops), and counts what reaches it: inits, finalizes, starts per event-type bit, stops,
 * state records, children whose parent is not one of its own collective handles, and
 * copy-engine events (which a v5 plugin must never get).
 */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

EXPORT _Atomic unsigned long chain_inits, chain_finalizes, chain_stops, chain_records, chain_bad_parents,
	chain_ce_seen;
EXPORT _Atomic unsigned long chain_starts[16];

#define MAGIC 0x434841494eull
struct ev {
	uint64_t magic;
	uint64_t type;
};
static struct ev g_events[4096];
static _Atomic unsigned g_next;
static int g_context;

static int init_v5(void **ctx, uint64_t id, int *mask, const char *name, int nn, int nr, int r, void *log)
{
	(void)id, (void)name, (void)nn, (void)nr, (void)r, (void)log;
	*ctx = &g_context;
	*mask = (1 << 1) | (1 << 6) | (1 << 3); /* Coll, KernelCh, ProxyOp */
	atomic_fetch_add(&chain_inits, 1);
	return 0;
}

static int init_v4(void **ctx, int *mask, const char *name, uint64_t id, int nn, int nr, int r, void *log)
{
	return init_v5(ctx, id, mask, name, nn, nr, r, log);
}

static int start(uint64_t type, void *parent, void **handle)
{
	for (int b = 0; b < 16; b++)
		if (type == (1ull << b))
			atomic_fetch_add(&chain_starts[b], 1);
	if (type & (7ull << 12))
		atomic_fetch_add(&chain_ce_seen, 1);
	if (type == (1 << 6)) {
		const struct ev *p = parent;
		int ours = p >= g_events && p < g_events + 4096;
		if (!ours || p->magic != MAGIC || p->type != (1 << 1))
			atomic_fetch_add(&chain_bad_parents, 1);
	}
	struct ev *e = &g_events[atomic_fetch_add(&g_next, 1) % 4096];
	e->magic = MAGIC;
	e->type = type;
	*handle = e;
	return 0;
}

/* Descriptor: type (uint64_t in v5, uint8_t in v4) at 0, parentObj at 8. */
static int start_v5(void *ctx, void **handle, void *d)
{
	(void)ctx;
	uint64_t type;
	void *parent;
	memcpy(&type, d, 8);
	memcpy(&parent, (char *)d + 8, sizeof(parent));
	return start(type, parent, handle);
}

static int start_v4(void *ctx, void **handle, void *d)
{
	(void)ctx;
	void *parent;
	memcpy(&parent, (char *)d + 8, sizeof(parent));
	return start(*(uint8_t *)d, parent, handle);
}

static int stop(void *h)
{
	const struct ev *e = h;
	if (e && e->magic == MAGIC)
		atomic_fetch_add(&chain_stops, 1);
	return 0;
}

static int record(void *h, int state, void *args)
{
	(void)state, (void)args;
	const struct ev *e = h;
	if (e && e->magic == MAGIC)
		atomic_fetch_add(&chain_records, 1);
	return 0;
}

static int finalize(void *ctx)
{
	if (ctx == &g_context)
		atomic_fetch_add(&chain_finalizes, 1);
	return 0;
}

struct table {
	const char *name;
	void *init, *start, *stop, *record, *finalize;
};
EXPORT const struct table ncclProfiler_v5 = { "chain-test", (void *)init_v5, (void *)start_v5, (void *)stop,
					      (void *)record, (void *)finalize };
EXPORT const struct table ncclProfiler_v4 = { "chain-test", (void *)init_v4, (void *)start_v4, (void *)stop,
					      (void *)record, (void *)finalize };
