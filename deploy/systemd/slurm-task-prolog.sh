#!/bin/sh
# Slurm TaskProlog for bare-metal training jobs on nodes running node-shipper.service:
#   TaskProlog=/etc/slurm/ringwatch-task-prolog.sh   (slurm.conf)
# Slurm reads this script's stdout: `export NAME=value` sets the task's environment,
# `print TEXT` writes to the task's stdout. Every task then loads the node-wide NCCL
# profiler shim the shipper probes (node-shipper.toml: nccl_profiler_shim).
SHIM=${RINGWATCH_NCCL_SHIM:-/opt/ringwatch/lib/libnccl-profiler-ringwatch.so}
if [ ! -r "$SHIM" ]; then
    echo "print ringwatch: $SHIM is missing on $(hostname): this task's collectives are not observed"
    exit 0
fi
# A job that already names a profiler plugin keeps it (one plugin loads per process).
if [ -z "${NCCL_PROFILER_PLUGIN:-}" ]; then
    echo "export NCCL_PROFILER_PLUGIN=$SHIM"
fi
if ! systemctl is-active --quiet node-shipper.service 2>/dev/null; then
    echo "print ringwatch: node-shipper.service is not running on $(hostname): its pinned probes keep recording into the kernel rings (drops counted once they fill) until it starts"
fi
