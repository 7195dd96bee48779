#!/usr/bin/env bash
# A static fio (Debian's source, io_uring built in) into .wheels/bin/, for a GPU machine with none:
# gpu_session.sh puts .wheels/bin on the PATH. Needs deb-src in apt's sources and a C compiler.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="$PWD/.wheels/bin"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get source -qq --download-only fio 2>/dev/null) || {
    echo "static_fio: apt-get source fio failed: add deb-src to apt's sources, then apt-get update" >&2
    exit 1
}
tar -xzf "$work"/fio_*.orig.tar.gz -C "$work"
src=$(ls -d "$work"/fio-*/)
(cd "$src" && ./configure --build-static --disable-native >/dev/null && make -j"$(nproc)" -s >/dev/null 2>&1)
mkdir -p "$dest"
strip -o "$dest/fio" "$src/fio"
"$dest/fio" --version
