#!/bin/bash
# make test-vm: boots the cached Debian 12 image (tests/vm/image.sh) once per Debian kernel in
# it (bookworm's 6.1, then the backports one where the archive had it) and runs the systemd
# stories inside (tests/vm/inside).  The guest has no network device; the checkout is shared
# read-only by virtio-9p, and a second 9p share, tests/output/vm/<kernel>/, brings back the
# stories' log, the journal and the figures; the serial console is saved there too.
set -euo pipefail
cd "$(dirname "$0")/../.."
SRC=$PWD
# A whole guest: its boot (about a minute under TCG), make install (6-7 min), the stories.
VM_TIMEOUT=${VM_TIMEOUT:-1800}

if [ "$(id -u)" != 0 ]; then
  echo "test-vm: debootstrap, the guest's disk and qemu need root" >&2; exit 1; fi
# The build's thousands of debootstrap and apt lines go to a file, shown only if it fails.
mkdir -p tests/output/vm
build_log=$SRC/tests/output/vm/image-build.log
if ! IMAGE=$(tests/vm/image.sh 2>"$build_log"); then
  tail -60 "$build_log" >&2
  echo "test-vm: the image could not be built (the whole log: $build_log)" >&2
  exit 1
fi
grep '^test-vm:' "$build_log" || true
# `run.sh image` (make vm-image): only the image, built or found in the cache.
if [ "${1:-}" = image ]; then exit 0; fi
# KVM only where /dev/kvm runs a stock kernel (kvm_intel or kvm_amd); a PVM /dev/kvm
# (kvm_pvm) cannot, so TCG there.
if { [ -d /sys/module/kvm_intel ] || [ -d /sys/module/kvm_amd ]; } && [ -w /dev/kvm ]; then
  ACCEL=(-accel kvm -cpu host)
else
  ACCEL=(-accel tcg,thread=multi -cpu max)
fi

guest() {  # guest KERNEL_VERSION OUT CONSOLE: boot the guest's disk once, until it powers off
  local v=$1 out=$2
  qemu-system-x86_64 "${ACCEL[@]}" -smp 2 -m 4096 -no-reboot -nodefaults -vga none \
    -nic none -display none -monitor none -serial "file:$out/$3" \
    -kernel "$IMAGE/vmlinuz-$v" -initrd "$IMAGE/initrd.img-$v" \
    -append "root=/dev/vda rw console=ttyS0 systemd.wants=gurtd-vm-stories.service" \
    -drive "file=$out/disk.qcow2,if=virtio,format=qcow2" \
    -virtfs "local,path=$SRC,mount_tag=src,security_model=none,readonly=on" \
    -virtfs "local,path=$out,mount_tag=out,security_model=none" &
  local qemu=$!
  # The guest powers itself off after the stories; a guest past the timeout, or still up a
  # minute after its results came back, is ended.
  local deadline=$(( SECONDS + VM_TIMEOUT )) finished=""
  while kill -0 "$qemu" 2>/dev/null; do
    if [ -z "$finished" ] && { [ -s "$out/rc" ] || [ -e "$out/reboot" ]; }; then
      finished=$SECONDS; fi
    if (( SECONDS > deadline )) || { [ -n "$finished" ] && (( SECONDS > finished + 90 )); }; then
      echo "test-vm: ending the guest (no power-off)" >&2
      kill "$qemu"
    fi
    sleep 2
  done
  wait "$qemu" || true
}

boot() {  # boot KERNEL_VERSION: one guest, its results in tests/output/vm/KERNEL_VERSION
  local v=$1 out=$SRC/tests/output/vm/$1
  rm -rf "$out"
  mkdir -p "$out"
  # The cached image stays as built: the guest writes into a throwaway overlay.
  qemu-img create -q -f qcow2 -F raw -b "$IMAGE/disk.raw" "$out/disk.qcow2"
  # VM_STORIES=EXPR runs only the first boot's stories pytest -k picks (no reboot, no suite):
  # for working on one story; a whole make test-vm runs them all.
  if [ -n "${VM_STORIES:-}" ]; then printf '%s\n' "$VM_STORIES" > "$out/select"; fi
  echo "test-vm: booting Debian 12 with kernel $v (${ACCEL[*]})"
  local started=$SECONDS
  guest "$v" "$out" console.log
  # The reboot story: the guest asked for it (its first boot's stories passed); the same
  # disk boots again, and tests/vm/inside goes on with the stories after it.
  if [ -e "$out/reboot" ]; then
    rm "$out/reboot"
    echo "test-vm: kernel $v: first boot done in $(( SECONDS - started )) s, booting again"
    guest "$v" "$out" console-after-reboot.log
  fi
  rm -f "$out/disk.qcow2"
  echo "guest run: $(( SECONDS - started )) s" >> "$out/figures.txt"
  if [ ! -s "$out/rc" ]; then
    echo "test-vm: kernel $v: the stories did not finish; the console's end:" >&2
    tail -40 "$out"/console*.log >&2
    cat "$out/stories.log" >&2 2>/dev/null || true
    return 1
  fi
  cat "$out/stories.log"
  if [ -e "$out/suite.log" ]; then
    grep -E ' (FAILED|ERROR)' "$out/suite.log" || true
    echo "the suite's part: $(tail -1 "$out/suite.log")"
  fi
  echo "test-vm: kernel $v, booted in $(cat "$out/booted-seconds") s; results in $out"
  cat "$out/figures.txt"
  return "$(cat "$out/rc")"
}

echo "test-vm: image $IMAGE (built in $(cat "$IMAGE/build-seconds") s)"
rc=0
# VM_KERNEL=6.1 boots only the kernel 6.1.* (or 6.1-*).
for k in $(cd "$IMAGE" && ls vmlinuz-* | sed 's/^vmlinuz-//' | sort -V); do
  if [ -z "${VM_KERNEL:-}" ] || [[ $k == "$VM_KERNEL"[.-]* ]]; then boot "$k" || rc=1; fi
done
exit $rc
