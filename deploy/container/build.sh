#!/usr/bin/env bash
# Builds the two images with no base image to pull: a Debian root filesystem made by
# mmdebstrap from Debian's packages becomes the base (podman import), and each
# Containerfile adds one binary on top.
#
#   deploy/container/build.sh [--profile release] [--tag 0.1.0] [--binaries DIR]
#
# --binaries DIR takes node-shipper and aggregator from DIR instead of building them.
# Images: localhost/ringwatch/node-shipper:TAG (root: it loads BPF; with the NCCL shim
# at /usr/lib/ringwatch/, the eBPF object embedded in the binary) and
# localhost/ringwatch/aggregator:TAG (user 65532). Needs podman, mmdebstrap, a C
# compiler, and Debian's package mirror (the apt sources of this machine).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
profile=release
tag=0.1.0
binaries=""
while (($#)); do
    case "$1" in
        --profile) profile="$2"; shift 2 ;;
        --tag) tag="$2"; shift 2 ;;
        --binaries) binaries="$2"; shift 2 ;;
        *) echo "usage: $0 [--profile PROFILE] [--tag TAG] [--binaries DIR]" >&2; exit 2 ;;
    esac
done
suite=bookworm
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
target_dir="${CARGO_TARGET_DIR:-target}"
out_dir="$target_dir/$([[ $profile == dev ]] && echo debug || echo "$profile")"
ctx="$target_dir/container-context-$tag"
rm -rf "$ctx"
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx"

if [[ -z $binaries ]]; then
    echo "== binaries ($profile)"
    cargo build --locked --profile "$profile" -p node-shipper --bin node-shipper -p aggregator --bin aggregator
    binaries="$out_dir"
fi
cp "$binaries/node-shipper" "$binaries/aggregator" "$ctx/"
# The shim, as node-shipper/nccl-shim/Makefile builds it.
${CC:-cc} -std=gnu11 -O2 -g -Wall -Wextra -Werror -fPIC -shared -fvisibility=hidden \
    -Inode-shipper/nccl-shim -Iproto-flat/include node-shipper/nccl-shim/ringwatch_profiler.c \
    -o "$ctx/libnccl-profiler-ringwatch.so" -lpthread -ldl
cp deploy/container/Containerfile.* "$ctx/"
mkdir -p "$ctx/state"

echo "== base: Debian $suite by mmdebstrap"
# Essential packages only (a shell and coreutils for the shim's init container), plus CA
# certificates; no documentation. Cached by date: one root filesystem a day.
base="localhost/ringwatch/base:$suite-$(date +%Y%m%d)"
if ! podman image exists "$base"; then
    mmdebstrap --variant=essential --include=ca-certificates \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        "$suite" "$ctx/rootfs.tar" "$mirror"
    podman import --change 'CMD ["/bin/sh"]' "$ctx/rootfs.tar" "$base"
    rm -f "$ctx/rootfs.tar"
fi

for b in node-shipper aggregator; do
    echo "== localhost/ringwatch/$b:$tag"
    podman build --pull=never --build-arg "BASE=$base" -f "$ctx/Containerfile.$b" -t "localhost/ringwatch/$b:$tag" "$ctx"
done
podman images --filter reference='localhost/ringwatch/*'
