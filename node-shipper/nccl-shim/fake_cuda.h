/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The stand-in GPU stream the workload hands the shim as a copy-engine collective's
 * cudaStream_t: CUDA events recorded on it take tickets in order; the workload, playing
 * the GPU, marks tickets done in order (an event is complete once its ticket is done).
 */
#ifndef RW_FAKE_CUDA_H
#define RW_FAKE_CUDA_H
#include <stdint.h>

struct rw_fake_stream {
	_Atomic uint64_t recorded; /* tickets handed out by cuEventRecord */
	_Atomic uint64_t done;     /* tickets the "GPU" finished */
};

#endif
