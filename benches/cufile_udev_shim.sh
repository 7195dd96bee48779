#!/usr/bin/env bash
# For a lent GPU VM only. cuFile refuses every file on a disk that udev has no data for (no
# udevd: "udev property not found: ID_FS_USAGE"), compatibility mode too. This writes the udev
# database entry cuFile reads for the disk under DIR, where none exists, so that cuFile can be
# measured there. A machine with udevd has the entry already: this leaves it alone.
#
#   bash benches/cufile_udev_shim.sh DIR      (UDEV_DATA: the database, default /run/udev/data)
set -euo pipefail
dir=${1:?usage: cufile_udev_shim.sh DIR}
data=${UDEV_DATA:-/run/udev/data}
mkdir -p "$dir"
src=$(findmnt -no SOURCE -T "$dir")
fstype=$(findmnt -no FSTYPE -T "$dir")
if [ ! -b "$src" ]; then
    echo "cufile_udev_shim: $dir is on $src ($fstype), not a block device: nothing to do"
    exit 0
fi
majmin=$(lsblk -dno MAJ:MIN "$src" | tr -d ' ')
db="$data/b$majmin"
if [ -e "$db" ]; then
    echo "cufile_udev_shim: $db exists: left as it is"
    exit 0
fi
mkdir -p "$data"
uuid=$(findmnt -no UUID -T "$dir" 2>/dev/null || true)
{
    printf 'I:1\nE:DEVNAME=%s\nE:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$src" "$fstype"
    if [ -n "$uuid" ]; then printf 'E:ID_FS_UUID=%s\nE:ID_FS_UUID_ENC=%s\n' "$uuid" "$uuid"; fi
} >"$db"
echo "cufile_udev_shim: wrote $db for $src ($fstype)"
