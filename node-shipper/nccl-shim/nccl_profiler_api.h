/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The NCCL profiler plugin interface, versions 4, 5 and 6, written from NCCL's documented
 * interface (ext-profiler/README.md and the plugin headers of NCCL 2.26-2.30) for
 * x86-64 / aarch64 Linux (LP64). Only what the shim needs; every layout NCCL relies on is
 * pinned by the _Static_asserts at the end (offsets and sizes as NCCL's own headers give
 * them on LP64), and tests/check_layout.c checks the exported symbols against the same
 * numbers from outside.
 */
#ifndef RW_NCCL_PROFILER_API_H
#define RW_NCCL_PROFILER_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef int ncclResult_t; /* ncclSuccess = 0 */
#define RW_NCCL_SUCCESS 0
typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char *file, int line, const char *fmt, ...);
typedef pid_t ncclPid_t;

/* Event types (bit values of the activation mask). */
enum {
	ncclProfileGroup = (1 << 0),
	ncclProfileColl = (1 << 1),
	ncclProfileP2p = (1 << 2),
	ncclProfileProxyOp = (1 << 3),
	ncclProfileProxyStep = (1 << 4),
	ncclProfileProxyCtrl = (1 << 5),
	ncclProfileKernelCh = (1 << 6),
	ncclProfileNetPlugin = (1 << 7),
	ncclProfileGroupApi = (1 << 8),
	ncclProfileCollApi = (1 << 9),
	ncclProfileP2pApi = (1 << 10),
	ncclProfileKernelLaunch = (1 << 11),
	/* v6 (NCCL 2.29.2 and later): copy-engine collectives and their children. */
	ncclProfileCeColl = (1 << 12),
	ncclProfileCeSync = (1 << 13),
	ncclProfileCeBatch = (1 << 14),
};

/* The one event state the shim acts on. */
typedef int ncclProfilerEventState_t;
#define RW_NCCL_KERNEL_CH_STOP 22 /* ncclProfilerKernelChStop */

typedef struct {
	uint8_t type;
	void *parentObj;
	int rank;
	union {
		struct {
			uint64_t seqNumber;
			const char *func;
			void const *sendBuff;
			void *recvBuff;
			size_t count;
			int root;
			const char *datatype;
			uint8_t nChannels;
			uint8_t nWarps;
			const char *algo;
			const char *proto;
		} coll;
		struct {
			const char *func;
			void *buff;
			const char *datatype;
			size_t count;
			int peer;
			uint8_t nChannels;
		} p2p;
		struct {
			ncclPid_t pid;
			uint8_t channelId;
			int peer;
			int nSteps;
			int chunkSize;
			int isSend;
		} proxyOp;
		struct {
			int step;
		} proxyStep;
		struct {
			uint8_t channelId;
			uint64_t pTimer;
		} kernelCh;
		struct {
			int64_t id;
			void *data;
		} netPlugin;
	};
} ncclProfilerEventDescr_v4_t;

typedef union {
	struct {
		size_t transSize;
	} proxyStep;
	struct {
		int appendedProxyOps;
	} proxyCtrl;
	struct {
		void *data;
	} netPlugin;
	struct {
		uint64_t pTimer;
	} kernelCh;
} ncclProfilerEventStateArgs_v4_t;

typedef struct {
	const char *name;
	ncclResult_t (*init)(void **context, int *eActivationMask, const char *commName, uint64_t commHash, int nNodes,
			     int nranks, int rank, ncclDebugLogger_t logfn);
	ncclResult_t (*startEvent)(void *context, void **eHandle, ncclProfilerEventDescr_v4_t *eDescr);
	ncclResult_t (*stopEvent)(void *eHandle);
	ncclResult_t (*recordEventState)(void *eHandle, ncclProfilerEventState_t eState,
					 ncclProfilerEventStateArgs_v4_t *eStateArgs);
	ncclResult_t (*finalize)(void *context);
} ncclProfiler_v4_t;

/* The union arms v5 and v6 share (v6 adds the copy-engine arms after them). */
#define RW_DESCR_V5_ARMS \
		struct { \
			bool graphCaptured; \
			int groupDepth; \
		} groupApi; \
		struct { \
			const char *func; \
			size_t count; \
			const char *datatype; \
			int root; \
			void *stream; \
			bool graphCaptured; \
		} collApi; \
		struct { \
			const char *func; \
			size_t count; \
			const char *datatype; \
			void *stream; \
			bool graphCaptured; \
		} p2pApi; \
		struct { \
			void *stream; \
		} kernelLaunch; \
		struct { \
			uint64_t seqNumber; \
			const char *func; \
			void const *sendBuff; \
			void *recvBuff; \
			size_t count; \
			int root; \
			const char *datatype; \
			uint8_t nChannels; \
			uint8_t nWarps; \
			const char *algo; \
			const char *proto; \
			void *parentGroup; \
		} coll; \
		struct { \
			const char *func; \
			void *buff; \
			const char *datatype; \
			size_t count; \
			int peer; \
			uint8_t nChannels; \
			void *parentGroup; \
		} p2p; \
		struct { \
			ncclPid_t pid; \
			uint8_t channelId; \
			int peer; \
			int nSteps; \
			int chunkSize; \
			int isSend; \
		} proxyOp; \
		struct { \
			int step; \
		} proxyStep; \
		struct { \
			uint8_t channelId; \
			uint64_t pTimer; \
		} kernelCh; \
		struct { \
			int64_t id; \
			void *data; \
		} netPlugin;

typedef struct {
	uint64_t type;
	void *parentObj;
	int rank;
	union {
		RW_DESCR_V5_ARMS
	};
} ncclProfilerEventDescr_v5_t;

typedef union {
	struct {
		size_t transSize;
	} proxyStep;
	struct {
		int appendedProxyOps;
	} proxyCtrl;
	struct {
		void *data;
	} netPlugin;
	struct {
		uint64_t pTimer;
	} kernelCh;
} ncclProfilerEventStateArgs_v5_t;

/* The plugin table of v5 and v6 (the same entry points; their own descriptor types). */
#define RW_PROFILER_V56(descr_t, args_t)                                                                        \
	struct {                                                                                                \
		const char *name;                                                                               \
		ncclResult_t (*init)(void **context, uint64_t commId, int *eActivationMask, const char *commName, \
				     int nNodes, int nranks, int rank, ncclDebugLogger_t logfn);               \
		ncclResult_t (*startEvent)(void *context, void **eHandle, descr_t *eDescr);                    \
		ncclResult_t (*stopEvent)(void *eHandle);                                                       \
		ncclResult_t (*recordEventState)(void *eHandle, ncclProfilerEventState_t eState, args_t *eStateArgs); \
		ncclResult_t (*finalize)(void *context);                                                        \
	}

typedef RW_PROFILER_V56(ncclProfilerEventDescr_v5_t, ncclProfilerEventStateArgs_v5_t) ncclProfiler_v5_t;

/* v6 = v5 + the copy-engine arms (descriptor size unchanged, v5 offsets unchanged). */
typedef struct {
	uint64_t type;
	void *parentObj;
	int rank;
	union {
		RW_DESCR_V5_ARMS
		struct {
			uint64_t seqNumber; /* the CE barrier counter, not a per-function count */
			const char *func;
			void const *sendBuff;
			void *recvBuff;
			size_t count;
			int root;
			const char *datatype;
			const char *syncStrategy;
			bool intraBatchSync;
			uint32_t batchSize;
			uint32_t numBatches;
			uint32_t ceSeqNum;
			void *stream; /* the cudaStream_t the copies are enqueued on */
		} ceColl;
		struct {
			bool isComplete;
			int nRanks;
		} ceCollSync;
		struct {
			int numOps;
			size_t totalBytes;
			bool useIntraSync;
		} ceCollBatch;
	};
} ncclProfilerEventDescr_v6_t;

typedef ncclProfilerEventStateArgs_v5_t ncclProfilerEventStateArgs_v6_t;

typedef RW_PROFILER_V56(ncclProfilerEventDescr_v6_t, ncclProfilerEventStateArgs_v6_t) ncclProfiler_v6_t;

/* LP64 layouts of NCCL's headers: what NCCL writes and reads. */
#define RW_ASSERT_AT(t, f, off) _Static_assert(offsetof(t, f) == (off), #t "." #f " offset")
#define RW_ASSERT_SIZE(t, sz) _Static_assert(sizeof(t) == (sz), #t " size")
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, type, 0);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, parentObj, 8);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, rank, 16);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, coll.seqNumber, 24);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, coll.func, 32);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, coll.count, 56);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, coll.root, 64);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, coll.datatype, 72);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, coll.nChannels, 80);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, coll.proto, 96);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, p2p.count, 48);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, p2p.peer, 56);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, p2p.nChannels, 60);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, kernelCh.channelId, 24);
RW_ASSERT_AT(ncclProfilerEventDescr_v4_t, kernelCh.pTimer, 32);
RW_ASSERT_SIZE(ncclProfilerEventDescr_v4_t, 104);
RW_ASSERT_SIZE(ncclProfilerEventStateArgs_v4_t, 8);
RW_ASSERT_AT(ncclProfiler_v4_t, init, 8);
RW_ASSERT_AT(ncclProfiler_v4_t, finalize, 40);
RW_ASSERT_SIZE(ncclProfiler_v4_t, 48);
RW_ASSERT_AT(ncclProfilerEventDescr_v5_t, type, 0);
RW_ASSERT_AT(ncclProfilerEventDescr_v5_t, parentObj, 8);
RW_ASSERT_AT(ncclProfilerEventDescr_v5_t, rank, 16);
RW_ASSERT_AT(ncclProfilerEventDescr_v5_t, coll.seqNumber, 24);
RW_ASSERT_AT(ncclProfilerEventDescr_v5_t, coll.count, 56);
RW_ASSERT_AT(ncclProfilerEventDescr_v5_t, coll.nChannels, 80);
RW_ASSERT_AT(ncclProfilerEventDescr_v5_t, coll.parentGroup, 104);
RW_ASSERT_AT(ncclProfilerEventDescr_v5_t, p2p.peer, 56);
RW_ASSERT_AT(ncclProfilerEventDescr_v5_t, p2p.parentGroup, 64);
RW_ASSERT_AT(ncclProfilerEventDescr_v5_t, kernelCh.pTimer, 32);
RW_ASSERT_SIZE(ncclProfilerEventDescr_v5_t, 112);
RW_ASSERT_SIZE(ncclProfilerEventStateArgs_v5_t, 8);
RW_ASSERT_AT(ncclProfiler_v5_t, init, 8);
RW_ASSERT_AT(ncclProfiler_v5_t, finalize, 40);
RW_ASSERT_SIZE(ncclProfiler_v5_t, 48);
/* v6: the numbers NVIDIA's profiler_v6.h gives (gdb ptype /o, LP64). */
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, type, 0);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, parentObj, 8);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, rank, 16);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, coll.seqNumber, 24);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, coll.nChannels, 80);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, coll.parentGroup, 104);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, p2p.nChannels, 60);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, p2p.parentGroup, 64);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, kernelCh.pTimer, 32);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.seqNumber, 24);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.func, 32);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.sendBuff, 40);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.recvBuff, 48);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.count, 56);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.root, 64);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.datatype, 72);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.syncStrategy, 80);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.intraBatchSync, 88);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.batchSize, 92);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.numBatches, 96);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.ceSeqNum, 100);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceColl.stream, 104);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceCollSync.isComplete, 24);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceCollSync.nRanks, 28);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceCollBatch.numOps, 24);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceCollBatch.totalBytes, 32);
RW_ASSERT_AT(ncclProfilerEventDescr_v6_t, ceCollBatch.useIntraSync, 40);
RW_ASSERT_SIZE(ncclProfilerEventDescr_v6_t, 112);
RW_ASSERT_SIZE(ncclProfilerEventStateArgs_v6_t, 8);
RW_ASSERT_AT(ncclProfiler_v6_t, init, 8);
RW_ASSERT_AT(ncclProfiler_v6_t, startEvent, 16);
RW_ASSERT_AT(ncclProfiler_v6_t, recordEventState, 32);
RW_ASSERT_AT(ncclProfiler_v6_t, finalize, 40);
RW_ASSERT_SIZE(ncclProfiler_v6_t, 48);
#undef RW_ASSERT_AT
#undef RW_ASSERT_SIZE

#endif
