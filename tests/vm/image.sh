#!/bin/bash
# The VM tier's image: a stock Debian 12 (bookworm) with Debian's own kernel, systemd as init,
# and everything `make install` and the stories need already in it, so that the guest needs
# no network.  Built once under $GURTD_VM_CACHE, keyed by a hash of what goes into it; prints
# the image's folder.  Called by `make test-vm` with APT_PACKAGES, DROID_VERSION and PYTEST.
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=${GURTD_VM_CACHE:-/var/cache/gurtd-vm}
: "${APT_PACKAGES:?} ${DROID_VERSION:?} ${PYTEST:?}"
PYTHON=${PYTHON:-/usr/bin/python3}

# Apt's own reading of its configuration (sources.list and sources.list.d/*.sources): the
# archive that serves a suite.  The project names no mirror; the machine's apt does.
site_of() {
  apt-get indextargets --format '$(SITE) $(RELEASE)' | awk -v s="$1" '$2 == s {print $1; exit}'
}
MIRROR=$(site_of bookworm)
SECURITY=$(site_of bookworm-security)
[ -n "$MIRROR" ] || { echo "test-vm: apt has no source for bookworm" >&2; exit 1; }

# What the guest gets from Debian besides $APT_PACKAGES: a kernel and systemd as init, dbus
# (a stock install has it), make (for `make install`), Node.js and npm (the Droid CLI).
GUEST_PACKAGES="linux-image-amd64 systemd-sysv udev kmod dbus procps make python3 nodejs npm"
KEY=$( { cat "$0" requirements.txt; echo "$APT_PACKAGES $DROID_VERSION $PYTEST $MIRROR";
         echo "$SECURITY"; } | sha256sum | cut -c1-16)
IMAGE=$CACHE/bookworm-$KEY
if [ -e "$IMAGE/ready" ]; then echo "$IMAGE"; exit 0; fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if [ -e "$IMAGE/ready" ]; then echo "$IMAGE"; exit 0; fi
started=$(date +%s)
WORK=$IMAGE.tmp
ROOT=$WORK/root
undo_mounts() {
  for m in dev/pts dev proc sys; do umount -l "$ROOT/$m" 2>/dev/null || true; done
}
trap undo_mounts EXIT
undo_mounts
# Never remove a folder that still has the host's /dev or /proc mounted in it.
if findmnt -rno TARGET | grep -q "^$WORK/"; then
  echo "test-vm: $WORK still has mounts" >&2; exit 1; fi
rm -rf "$WORK"
mkdir -p "$WORK"

echo "test-vm: building the image (debootstrap bookworm)" >&2
debootstrap --variant=minbase bookworm "$ROOT" "$MIRROR" >&2
{ echo "deb $MIRROR bookworm main"; echo "deb $MIRROR bookworm-updates main"
  [ -z "$SECURITY" ] || echo "deb $SECURITY bookworm-security main"; } \
  > "$ROOT/etc/apt/sources.list"
# A newer Debian kernel where the archive has one: bookworm-backports, a second boot.
if curl -fsI "$MIRROR/dists/bookworm-backports/InRelease" >/dev/null; then
  echo "deb $MIRROR bookworm-backports main" >> "$ROOT/etc/apt/sources.list"
  BACKPORTS=yes
else
  BACKPORTS=no
fi
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# No service starts inside the chroot.
printf '#!/bin/sh\nexit 101\n' > "$ROOT/usr/sbin/policy-rc.d"
chmod 0755 "$ROOT/usr/sbin/policy-rc.d"
mount -t proc proc "$ROOT/proc"
mount -t sysfs sys "$ROOT/sys"
mount --bind /dev "$ROOT/dev"
mount --bind /dev/pts "$ROOT/dev/pts"
in_root() { chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 "$@"; }
in_root apt-get update -qq >&2
# shellcheck disable=SC2086
in_root apt-get install -y -qq --no-install-recommends $GUEST_PACKAGES $APT_PACKAGES >&2
if [ "$BACKPORTS" = yes ]; then
  in_root apt-get install -y -qq --no-install-recommends -t bookworm-backports \
    linux-image-amd64 >&2
fi

# Python packages: wheels built here with the machine's own pip configuration (the guest's
# python is this machine's: both Debian 12), installed in the guest with no index.
guest_py=$(in_root python3 -c 'import sys; print(sys.version_info[:2])')
host_py=$($PYTHON -c 'import sys; print(sys.version_info[:2])')
[ "$guest_py" = "$host_py" ] || {
  echo "test-vm: the host's python $host_py is not bookworm's $guest_py" >&2; exit 1; }
$PYTHON -m venv "$WORK/pip"
mkdir -p "$ROOT/opt/gurtd-vm/wheels"
# (--use-pep517: bookworm's pip has no `wheel` package to build an sdist the old way)
"$WORK/pip/bin/pip" wheel -q --disable-pip-version-check --use-pep517 \
  -w "$ROOT/opt/gurtd-vm/wheels" \
  -r requirements.txt "$PYTEST" >&2
printf '[global]\nno-index = true\nfind-links = /opt/gurtd-vm/wheels\n' > "$ROOT/etc/pip.conf"
# The stories' own pytest, beside what `make install` will make.
in_root python3 -m venv /opt/gurtd-vm/venv
in_root /opt/gurtd-vm/venv/bin/pip install -q --disable-pip-version-check "$PYTEST" >&2

# The Droid CLI: installed once by the guest's own npm (its cache format is the one that
# will read it offline), with this machine's npm registry and certificate file.
registry=$(npm config get registry 2>/dev/null || true)
cafile=$(npm config get cafile 2>/dev/null || true)
npm_env=(${registry:+npm_config_registry=$registry})
if [ -f "$cafile" ]; then
  cp "$cafile" "$ROOT/tmp/npm-ca.crt"
  npm_env+=(npm_config_cafile=/tmp/npm-ca.crt)
fi
in_root env "${npm_env[@]}" npm install --prefix /tmp/droid --no-audit --no-fund \
  --loglevel=error "droid@$DROID_VERSION" >&2
rm -rf "$ROOT/tmp/droid" "$ROOT/tmp/npm-ca.crt"
printf 'offline=true\n' > "$ROOT/root/.npmrc"

# The guest: its root disk, a serial console, a root without password (to look around), and
# the stories' unit, which the run asks for on the kernel command line (systemd.wants=).
echo "/dev/vda / ext4 rw,errors=remount-ro 0 1" > "$ROOT/etc/fstab"
echo gurtd-vm > "$ROOT/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 gurtd-vm\n' > "$ROOT/etc/hosts"
printf '9p\n9pnet_virtio\n' > "$ROOT/etc/modules-load.d/9p.conf"
in_root passwd -d root >/dev/null
in_root systemd-machine-id-setup >/dev/null
cat > "$ROOT/etc/systemd/system/gurtd-vm-stories.service" <<'UNIT'
[Unit]
Description=gurtd VM tier: the systemd stories of the shared checkout
After=multi-user.target
SuccessAction=poweroff
FailureAction=poweroff

[Service]
Type=oneshot
Environment=HOME=/root
ExecStart=/bin/sh -ec 'mkdir -p /mnt/src /mnt/out; \
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,ro src /mnt/src; \
  mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out /mnt/out; \
  exec /mnt/src/tests/vm/inside'
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity
UNIT
rm -f "$ROOT/usr/sbin/policy-rc.d"
in_root apt-get clean
undo_mounts
if findmnt -rno TARGET | grep -q "^$WORK/"; then
  echo "test-vm: $WORK still has mounts" >&2; exit 1; fi

# The disk, made from the folder (no loop device), and the kernels beside it for qemu.
for k in "$ROOT"/boot/vmlinuz-*; do
  v=${k#*/vmlinuz-}
  cp "$k" "$WORK/vmlinuz-$v"
  cp "$ROOT/boot/initrd.img-$v" "$WORK/initrd.img-$v"
done
truncate -s 8G "$WORK/disk.raw"
mkfs.ext4 -q -F -L gurtd-vm -d "$ROOT" "$WORK/disk.raw"
rm -rf "$ROOT" "$WORK/pip"
echo "$(( $(date +%s) - started ))" > "$WORK/build-seconds"
touch "$WORK/ready"
# One image is kept: an older one (another key) is only disk space.
# (A build killed in the middle may have left /dev or /proc mounted in its folder: not that.)
for old in "$CACHE"/bookworm-*; do
  [ "$old" = "$WORK" ] || findmnt -rno TARGET | grep -q "^$old/" || rm -rf "$old"
done
mv "$WORK" "$IMAGE"
echo "test-vm: image built in $(cat "$IMAGE/build-seconds") s: $IMAGE" >&2
echo "$IMAGE"
