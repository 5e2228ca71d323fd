#!/usr/bin/env bash
# run-in-guest.sh — run a host-built program inside a throwaway QEMU guest that boots Debian
# bookworm's own kernel with a Soft-RoCE device (rdma_rxe) called rxe0 up, print the program's
# output and exit with its exit status.
#
# Everything comes from Debian's package archive (apt-get download + dpkg-deb -x, nothing is
# installed system-wide): linux-image-amd64's kernel, qemu-system-x86 (unpacked into the cache
# unless qemu-system-x86_64 is already on PATH), busybox-static, libc6, libibverbs1,
# ibverbs-providers (librxe), iproute2 (`rdma`), ibverbs-utils, perftest, rdmacm-utils.
#
# Usage:
#   run-in-guest.sh [options] [--] BINARY [ARGS...]   run BINARY (a host path) in the guest
#   run-in-guest.sh --selftest                         ibv_devinfo + ib_write_bw + rping in the guest
#   run-in-guest.sh --sh 'SHELL CMDS'                  run a busybox-sh command line in the guest
#   run-in-guest.sh --prepare                          only download and build (warm the cache)
# Options are environment variables:
#   RXE_CACHE     cache dir (default /var/cache/kvfs-softroce): .debs, unpacked kernel/qemu, initramfs
#   RXE_ACCEL     tcg (default) | kvm   (kvm: see NOTES.md, it does not work on PVM hosts)
#   RXE_NETDEV    lo (default) | eth0 (qemu user net, restrict=on: nothing leaves the VM)
#                 | any other name: a dummy netdev with 192.0.2.1/24 (TEST-NET-1) inside the guest
#   RXE_SHARE     host dir shared into the guest at the same absolute path (default: BINARY's dir)
#   RXE_SHARE_RW  1 = share it read-write (default read-only)
#   RXE_MEM (2G)  RXE_SMP (2)  RXE_TIMEOUT (seconds for the whole VM run, default 900)
#   RXE_EXTRA_PKGS  more Debian packages to unpack into the guest (e.g. "libssl3 zlib1g")
#   RXE_EXTRA_MODULES  more kernel modules to insmod in the guest, in this order, after the
#                 Soft-RoCE ones (their .modinfo dependencies are added first), e.g. "nvme-tcp"
#   RXE_PASSENV   env var names forwarded into the guest
#                 (default: RUST_BACKTRACE RUST_LOG RUST_TEST_THREADS RUST_MIN_STACK)
#   RXE_VERBOSE   1 = also print the guest's boot/kernel console to stderr
#   RXE_APPEND    more words for the guest kernel's command line (e.g. "hardened_usercopy=off")
#   RXE_REFRESH   1 = ask apt again which kernel/qemu packages are current (else cached)
# Exit status: the program's; 124 if the VM timed out; 125 if the guest never reported a status.
#
# Provenance: copied from shared/softroce/run-in-guest.sh (see shared/softroce/NOTES.md for
# how it was built and measured) so that a clean clone can run scripts/test-rdma. Keep the two in
# step: fixes go to both. This copy differs from the original in this paragraph and in what
# scripts/test-nvmeof needed: RXE_EXTRA_MODULES, RXE_APPEND, and a cache that keeps one kernel dir, one
# package dir and one initramfs per set of extras (so test-rdma and test-nvmeof sharing a cache
# do not rebuild or download again each time the other ran, nor delete an initramfs a guest
# about to boot still needs).
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
CACHE=${RXE_CACHE:-/var/cache/kvfs-softroce}
ACCEL=${RXE_ACCEL:-tcg}
NETDEV=${RXE_NETDEV:-lo}
MEM=${RXE_MEM:-2G}
SMP=${RXE_SMP:-2}
TIMEOUT=${RXE_TIMEOUT:-900}
PASSENV=${RXE_PASSENV:-RUST_BACKTRACE RUST_LOG RUST_TEST_THREADS RUST_MIN_STACK}
VERBOSE=${RXE_VERBOSE:-0}

GUEST_PKGS="busybox-static libc6 libgcc-s1 libibverbs1 ibverbs-providers libnl-3-200
  libnl-route-3-200 ibverbs-utils perftest libibumad3 libpci3 libudev1 zlib1g librdmacm1
  rdmacm-utils iproute2 libmnl0 libbsd0 libmd0 libelf1 libbpf1 libcap2 libselinux1 libpcre2-8-0
  ${RXE_EXTRA_PKGS:-}"
# Kernel modules wanted in the guest; their dependencies are added from .modinfo.
GUEST_MODULES="crc32_generic crc32-pclmul rdma_rxe ib_uverbs rdma_ucm virtio_pci 9pnet_virtio 9p
  dummy virtio_net ${RXE_EXTRA_MODULES:-}"
# Extras get their own kernel and package dirs in the cache (suffix: a hash of the extras).
extras_suffix() { [[ -z $(echo $1) ]] || echo "-$(echo $1 | sha256sum | cut -c1-12)"; }
KSUFFIX=$(extras_suffix "${RXE_EXTRA_MODULES:-}")
PSUFFIX=$(extras_suffix "${RXE_EXTRA_PKGS:-}")

log() { printf '[rxe] %s\n' "$*" >&2; }
die() { printf '[rxe] error: %s\n' "$*" >&2; exit 2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1fs", b-a}'; }

MODE=run SHCMD=""
case "${1:-}" in
  --selftest) MODE=selftest; shift ;;
  --sh) MODE=sh; SHCMD=${2:?--sh needs a command}; shift 2 ;;
  --prepare) MODE=prepare; shift ;;
  --) shift ;;
  -h|--help|"") sed -n '2,/^set -euo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
if [[ $MODE == run ]]; then
  [[ ${1:-} == -- ]] && shift
  BIN=$(readlink -f "${1:?missing BINARY}"); shift
  [[ -f $BIN && -x $BIN ]] || die "$BIN is not an executable file"
fi
for t in apt-get apt-cache dpkg-deb readelf gzip sha256sum timeout flock; do
  command -v "$t" >/dev/null || die "needs $t on the host"
done

mkdir -p "$CACHE/debs"
APT_OPTS=(-o APT::Sandbox::User=root -q)
APT_UPDATED=0
apt_update_once() { if [[ $APT_UPDATED == 0 ]]; then log "apt-get update"; apt-get "${APT_OPTS[@]}" update >/dev/null; APT_UPDATED=1; fi; }

# fetch DIR PKG...: download the candidate .deb of each PKG into DIR unless the set is already there.
fetch() {
  local dir=$1; shift
  local want; want=$(printf '%s\n' "$@" | sort -u)
  mkdir -p "$dir"
  if [[ -f $dir/.pkgs && $(cat "$dir/.pkgs") == "$want" ]]; then return; fi
  log "downloading $(echo "$want" | wc -l) packages into $dir"
  rm -f "$dir"/*.deb
  ( cd "$dir" && apt-get "${APT_OPTS[@]}" download $want >/dev/null 2>"$dir/.err" ) || {
    apt_update_once
    ( cd "$dir" && apt-get "${APT_OPTS[@]}" download $want >/dev/null 2>"$dir/.err" ) || { cat "$dir/.err" >&2; die "apt-get download failed"; }
  }
  echo "$want" > "$dir/.pkgs"
}

# unpack DEBDIR DEST: dpkg-deb -x every .deb of DEBDIR into DEST (once per package set).
unpack() {
  local src=$1 dst=$2
  if [[ -f $dst/.pkgs && $(cat "$dst/.pkgs") == "$(cat "$src/.pkgs")" ]]; then return; fi
  rm -rf "$dst"; mkdir -p "$dst"
  for d in "$src"/*.deb; do dpkg-deb -x "$d" "$dst"; done
  cp "$src/.pkgs" "$dst/.pkgs"
}

module_order() { # MODDIR: prints the .ko paths (relative to MODDIR) for GUEST_MODULES, deps first
  local MODDIR=$1
  declare -A KO=() BUILTIN=() SEEN=()
  local f n
  while IFS= read -r f; do n=${f##*/}; n=${n%.ko}; KO[${n//-/_}]=$f; done < <(cd "$MODDIR" && find kernel -name '*.ko')
  while IFS= read -r f; do n=${f##*/}; n=${n%.ko}; BUILTIN[${n//-/_}]=1; done < "$MODDIR/modules.builtin"
  visit() {
    local m=${1//-/_} d
    [[ -n ${SEEN[$m]:-} || -n ${BUILTIN[$m]:-} ]] && return 0
    [[ -n ${KO[$m]:-} ]] || die "kernel module $m not in $KPKG"
    SEEN[$m]=1
    for d in $(readelf -p .modinfo "$MODDIR/${KO[$m]}" | sed -n 's/.*depends=//p' | tr ',' ' '); do visit "$d"; done
    echo "${KO[$m]}"
  }
  for n in $GUEST_MODULES; do visit "$n"; done
}

T0=$(now)
exec 9> "$CACHE/.lock"; flock 9   # one preparation at a time per cache
# ---- 1. kernel -------------------------------------------------------------------------------
# Which packages to fetch is resolved once and kept in the cache; RXE_REFRESH=1 resolves again.
KPKG=""
[[ ${RXE_REFRESH:-0} == 1 || ! -s $CACHE/debs/kernel.name ]] || KPKG=$(cat "$CACHE/debs/kernel.name")
if [[ -z $KPKG ]]; then
  KPKG=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}' || true)
  if [[ -z $KPKG ]]; then
    apt_update_once
    KPKG=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  fi
  [[ -n $KPKG ]] || die "cannot resolve linux-image-amd64"
  echo "$KPKG" > "$CACHE/debs/kernel.name"
fi
fetch "$CACHE/debs/kernel" "$KPKG"
KVER=${KPKG#linux-image-}
KDIR="$CACHE/kernel$KSUFFIX"
KSTAMP="$KPKG $(echo $GUEST_MODULES)"
if [[ ! -f $KDIR/.stamp || $(cat "$KDIR/.stamp") != "$KSTAMP" ]]; then
  # Unpack the package, keep only the kernel image and the modules the guest loads (the whole
  # tree is ~360 MB, what is kept ~80 MB).
  ts=$(now)
  rm -rf "$KDIR" "$CACHE/kernel.full"; mkdir -p "$CACHE/kernel.full" "$KDIR/boot"
  dpkg-deb -x "$CACHE"/debs/kernel/*.deb "$CACHE/kernel.full"
  FULL_MODDIR="$CACHE/kernel.full/lib/modules/$KVER"
  [[ -f $CACHE/kernel.full/boot/vmlinuz-$KVER && -d $FULL_MODDIR ]] || die "kernel package $KPKG has no vmlinuz/modules"
  cp "$CACHE/kernel.full/boot/vmlinuz-$KVER" "$CACHE/kernel.full/boot/config-$KVER" "$KDIR/boot/"
  module_order "$FULL_MODDIR" > "$KDIR/modules.list"
  while IFS= read -r k; do mkdir -p "$KDIR/modules/${k%/*}"; cp "$FULL_MODDIR/$k" "$KDIR/modules/$k"; done < "$KDIR/modules.list"
  cp "$FULL_MODDIR"/modules.builtin* "$FULL_MODDIR/modules.order" "$KDIR/modules/"
  rm -rf "$CACHE/kernel.full"
  # Boot the uncompressed ELF vmlinux through PVH when possible: under TCG, the bzImage's own
  # XZ decompression costs ~8 s of every boot. The bzImage stays the fallback.
  off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$KDIR/boot/vmlinuz-$KVER" 2>/dev/null | head -1 | cut -d: -f1 || true)
  if [[ -n $off ]] && command -v xz >/dev/null; then
    tail -c +$((off + 1)) "$KDIR/boot/vmlinuz-$KVER" | xz -dc --single-stream > "$KDIR/vmlinux.tmp" 2>/dev/null || true
  fi
  # XEN_ELFNOTE_PHYS32_ENTRY (0x12) marks a PVH entry point.
  if [[ -s $KDIR/vmlinux.tmp ]] && readelf -n "$KDIR/vmlinux.tmp" 2>/dev/null | grep -q 'note type: (0x00000012)'; then
    mv "$KDIR/vmlinux.tmp" "$KDIR/vmlinux"
  else
    rm -f "$KDIR/vmlinux.tmp"; log "no PVH vmlinux could be extracted; booting the bzImage (slower)"
  fi
  echo "$KSTAMP" > "$KDIR/.stamp"
  log "kernel $KVER unpacked in $(since "$ts")"
fi
KERNEL="$KDIR/vmlinux"
[[ -s $KERNEL ]] || KERNEL="$KDIR/boot/vmlinuz-$KVER"

# ---- 2. qemu -------------------------------------------------------------------------------
QEMU_ENV=() QEMU_L=()
if command -v qemu-system-x86_64 >/dev/null; then
  QEMU=$(command -v qemu-system-x86_64)
else
  # The packages apt would install for qemu-system-x86 on this host, unpacked into the cache
  # instead (installing it would also remove a backported qemu-utils here).
  QPKGS=""
  [[ ${RXE_REFRESH:-0} == 1 || ! -s $CACHE/debs/qemu.names ]] || QPKGS=$(cat "$CACHE/debs/qemu.names")
  if [[ -z $QPKGS ]]; then
    QPKGS=$(apt-get "${APT_OPTS[@]}" install -s --no-install-recommends qemu-system-x86 2>/dev/null | awk '/^Inst /{print $2}' || true)
    if [[ -z $QPKGS ]]; then
      apt_update_once
      QPKGS=$(apt-get "${APT_OPTS[@]}" install -s --no-install-recommends qemu-system-x86 | awk '/^Inst /{print $2}')
    fi
    [[ -n $QPKGS ]] || die "cannot resolve qemu-system-x86's packages"
    echo "$QPKGS" > "$CACHE/debs/qemu.names"
  fi
  fetch "$CACHE/debs/qemu" $QPKGS
  unpack "$CACHE/debs/qemu" "$CACHE/qemu"
  QEMU="$CACHE/qemu/usr/bin/qemu-system-x86_64"
  QEMU_ENV=(env "LD_LIBRARY_PATH=$CACHE/qemu/usr/lib/x86_64-linux-gnu:$CACHE/qemu/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
  QEMU_L=(-L "$CACHE/qemu/usr/share/qemu" -L "$CACHE/qemu/usr/share/seabios")
fi

# ---- 3. guest userspace + initramfs ----------------------------------------------------------
# shellcheck disable=SC2086
fetch "$CACHE/debs/guest$PSUFFIX" $GUEST_PKGS
STAGE="$CACHE/stage$PSUFFIX"
unpack "$CACHE/debs/guest$PSUFFIX" "$STAGE"
KEY=$( { sha256sum "$SELF"; cat "$STAGE/.pkgs" "$KDIR/.stamp"; } | sha256sum | cut -c1-16)
INITRD="$CACHE/initrd-$KEY.gz"
ROOT="$CACHE/initrd-root"

write_init() {
cat > "$ROOT/init" <<'INIT'
#!/bin/sh
# PID 1 of the Soft-RoCE test guest (written by run-in-guest.sh).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TMPDIR=/tmp USER=root
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm /run/rxe; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
KV=$(uname -r)
t() { echo "@@T $1 $(cut -d' ' -f1 /proc/uptime)"; }
t init
while read -r k; do insmod "/lib/modules/$KV/$k" 2>/dev/null || echo "rxe-guest: insmod $k failed"; done < /etc/rxe-modules
t modules
ip link set lo up
ulimit -l unlimited 2>/dev/null
hostname rxe-guest
finish() { echo "@@RXE-RC=$1"; sync; poweroff -f; sleep 5; echo o > /proc/sysrq-trigger; }
NETDEV=${rxe_netdev:-lo}
case "$NETDEV" in
  lo) ;;
  eth0) ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 ;;
  *) ip link show "$NETDEV" >/dev/null 2>&1 || ip link add "$NETDEV" type dummy  # dummy.ko makes dummy0 itself
     ip link set "$NETDEV" up && ip addr add 192.0.2.1/24 dev "$NETDEV" ;;
esac
if ! rdma link add rxe0 type rxe netdev "$NETDEV"; then
  echo "rxe-guest: rdma link add rxe0 on $NETDEV failed"; dmesg | tail -20; finish 126
fi
t rxe0
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 rxerun /run/rxe || { echo "rxe-guest: 9p mount failed"; finish 126; }
. /run/rxe/env.sh
if [ -n "$RXE_SHARE" ]; then
  mkdir -p "$RXE_SHARE"
  mount -t 9p -o "trans=virtio,version=9p2000.L,msize=262144$RXE_SHARE_OPT" rxeshare "$RXE_SHARE" || { echo "rxe-guest: share mount failed"; finish 126; }
fi
cd "$RXE_CWD" 2>/dev/null || cd "${RXE_SHARE:-/}"
t mounted
nk=$(dmesg -r | wc -l)
echo "@@RXE-BEGIN"
sh /run/rxe/cmd.sh < /dev/null
rc=$?
echo "@@RXE-END"
t done
# On failure, show the kernel's warnings and errors logged while the program ran.
if [ "$rc" != 0 ]; then dmesg -r | tail -n +$((nk + 1)) | grep -E '^<[0-4]>' | grep -v 'speed is unknown' | tail -40 | sed 's/^/guest-kernel: /'; fi
cd /; umount "$RXE_SHARE" 2>/dev/null; umount /run/rxe 2>/dev/null
finish "$rc"
INIT
chmod 755 "$ROOT/init"
}

if [[ ! -f $INITRD ]]; then
  ts=$(now)
  # Initramfs images of other package/module sets stay (another run may be about to boot one)
  # unless unused for a week.
  rm -rf "$ROOT"; mkdir -p "$ROOT"
  find "$CACHE" -maxdepth 1 -name 'initrd-*.gz' -mtime +7 -delete
  cp -a "$STAGE/." "$ROOT/"
  # Prune what the guest never uses (the initramfs is unpacked at every boot, slowly under TCG).
  ( cd "$ROOT" && rm -rf .pkgs usr/share usr/lib/x86_64-linux-gnu/gconv usr/lib/x86_64-linux-gnu/tc \
      sbin/{tc,devlink,bridge,dcb,tipc,vdpa,rtacct,rtmon} bin/ss usr/bin/{lnstat,nstat,routel,ctstat,rtstat} \
      usr/lib/x86_64-linux-gnu/lib{mlx4,mana}.so* )
  for d in "$ROOT"/etc/libibverbs.d/*.driver; do  # keep only the software providers (rxe, siw)
    n=${d##*/}; n=${n%.driver}
    case $n in rxe|siw) ;; *) rm -f "$d" "$ROOT"/usr/lib/x86_64-linux-gnu/libibverbs/lib"$n"-rdmav*.so ;; esac
  done
  mkdir -p "$ROOT/lib/modules/$KVER"
  cp -a "$KDIR/modules/." "$ROOT/lib/modules/$KVER/"
  cp "$KDIR/modules.list" "$ROOT/etc/rxe-modules"
  for a in $("$ROOT/bin/busybox" --list); do
    [[ -e $ROOT/bin/$a || -e $ROOT/sbin/$a || -e $ROOT/usr/bin/$a || -e $ROOT/usr/sbin/$a ]] || ln -s busybox "$ROOT/bin/$a"
  done
  mkdir -p "$ROOT"/{proc,sys,dev,tmp,run,mnt,root}
  printf '/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n' > "$ROOT/etc/ld.so.conf"
  if command -v ldconfig >/dev/null; then ldconfig -r "$ROOT"; fi
  write_init
  ( cd "$ROOT" && find . | "$ROOT/bin/busybox" cpio -o -H newc 2>/dev/null | gzip -1 ) > "$INITRD.tmp"
  mv "$INITRD.tmp" "$INITRD"
  rm -rf "$ROOT"
  log "built $INITRD ($(du -h "$INITRD" | cut -f1)) in $(since "$ts")"
fi
touch "$INITRD"  # in use: the pruning above keeps it
log "prepared in $(since "$T0") (kernel $KVER, $( "${QEMU_ENV[@]}" "$QEMU" --version | head -1))"
[[ $MODE == prepare ]] && exit 0
flock -u 9

# ---- 4. the run ------------------------------------------------------------------------------
# needed_missing FILE: sonames FILE needs (transitively) that the guest root does not have.
needed_missing() {
  local root="$STAGE" todo=("$1") seen=" " f so d found
  while ((${#todo[@]})); do
    f=${todo[-1]}; unset 'todo[-1]'
    for so in $(readelf -d "$f" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
      [[ $seen == *" $so "* ]] && continue; seen+="$so "; found=""
      for d in lib/x86_64-linux-gnu usr/lib/x86_64-linux-gnu lib64; do
        if [[ -e $root/$d/$so ]]; then found=$root/$d/$so; todo+=("$found"); break; fi
      done
      [[ -n $found ]] || echo "$so"
    done
  done
}

RUN=$(mktemp -d "$CACHE/run.XXXXXX")
KEEP_RUN=1
trap '[[ $KEEP_RUN == 1 ]] && log "kept $RUN (console.log, qemu.err)" || rm -rf "$RUN"' EXIT
q() { printf "'%s'" "${1//\'/\'\\\'\'}"; }  # quote for the guest's busybox sh
SHARE=""
if [[ $MODE != run && -n ${RXE_SHARE:-} ]]; then
  SHARE=$(readlink -f "$RXE_SHARE"); [[ $SHARE != / ]] || die "refusing to share / into the guest"
fi
case $MODE in
  run)
    SHARE=$(readlink -f "${RXE_SHARE:-${BIN%/*}}")
    [[ $SHARE != / ]] || die "refusing to share / into the guest"
    [[ $BIN == "$SHARE"/* ]] || die "BINARY $BIN is not under RXE_SHARE $SHARE"
    miss=$(needed_missing "$BIN" | tr '\n' ' ')
    [[ -z $miss ]] || log "warning: guest lacks libraries $miss(add their packages to RXE_EXTRA_PKGS)"
    { printf 'exec %s' "$(q "$BIN")"; for a in "$@"; do printf ' %s' "$(q "$a")"; done; echo; } > "$RUN/cmd.sh" ;;
  sh) printf '%s\n' "$SHCMD" > "$RUN/cmd.sh" ;;
  selftest) cat > "$RUN/cmd.sh" <<'SELFTEST'
set -e
rdma link show
ibv_devices
ibv_devinfo -d rxe0
G=$(for f in /sys/class/infiniband/rxe0/ports/1/gids/*; do case $(cat $f 2>/dev/null) in 0000:0000:0000:0000:0000:ffff:*) echo ${f##*/}; break;; esac; done)
[ -n "$G" ] || { echo "selftest: rxe0 has no IPv4 GID"; exit 1; }
A=$(ip -4 -o addr show dev $(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/$G) | awk '{print $4}' | cut -d/ -f1 | head -1)
echo "== ib_write_bw on rxe0, gid index $G, address $A"
ib_write_bw -d rxe0 -x $G -F -n 2000 > /tmp/srv.log 2>&1 &
sleep 1
ib_write_bw -d rxe0 -x $G -F -n 2000 --report_gbits $A
wait
if [ "$RXE_NETDEV" = lo ]; then
  echo "== rping skipped: rdma_cm cannot resolve a route over rxe on lo (ENODEV); use RXE_NETDEV=dummy0"
else
  echo "== rping (rdma_cm) over $A"
  rping -s -a $A -C 3 > /tmp/rping-srv.log 2>&1 &
  sleep 1
  rping -c -a $A -C 3 -v
  wait
fi
echo "selftest OK"
SELFTEST
  ;;
esac
{
  echo "RXE_SHARE=$(q "$SHARE")"
  [[ ${RXE_SHARE_RW:-0} == 1 ]] && echo "RXE_SHARE_OPT=''" || echo "RXE_SHARE_OPT=',ro'"
  echo "RXE_CWD=$(q "$PWD")"
  echo "export RXE_DEVICE=rxe0 RXE_NETDEV=$(q "$NETDEV")"
  for v in $PASSENV; do if [[ -n ${!v+x} ]]; then echo "export $v=$(q "${!v}")"; fi; done
} > "$RUN/env.sh"

QARGS=(-m "$MEM" -smp "$SMP" -nodefaults -no-reboot -display none -monitor none -serial stdio
  -kernel "$KERNEL" -initrd "$INITRD"
  -append "console=ttyS0 quiet loglevel=1 panic=-1 rxe_netdev=$NETDEV${RXE_APPEND:+ $RXE_APPEND}"
  -fsdev "local,id=rxerun,path=$RUN,security_model=none"
  -device virtio-9p-pci,fsdev=rxerun,mount_tag=rxerun)
if [[ -n $SHARE ]]; then
  ro=",readonly=on"; [[ ${RXE_SHARE_RW:-0} == 1 ]] && ro=""
  QARGS+=(-fsdev "local,id=rxeshare,path=$SHARE,security_model=none$ro" -device virtio-9p-pci,fsdev=rxeshare,mount_tag=rxeshare)
fi
# eth0: qemu user-mode networking with restrict=on (no route out of the VM, no forwarding).
[[ $NETDEV == eth0 ]] && QARGS+=(-nic user,model=virtio-net-pci,restrict=on)
[[ ${RXE_APPEND:-} != *[\'\"]* ]] || die "RXE_APPEND must not contain quotes (the kernel does not honour them)"
case $ACCEL in
  tcg) QARGS+=(-accel tcg,thread=multi -cpu max) ;;
  kvm) QARGS+=(-enable-kvm -cpu host,-arch-capabilities) ;;
  *) die "RXE_ACCEL must be tcg or kvm" ;;
esac

log "booting guest ($ACCEL, $SMP vCPU, $MEM, rxe0 on $NETDEV)"
tb=$(now)
set +e
# The serial console carries the program's output between @@RXE-BEGIN and @@RXE-END (streamed
# to stdout), then @@RXE-RC=<status>; everything else goes to console.log (and to stderr if
# RXE_VERBOSE=1).
"${QEMU_ENV[@]}" timeout "$TIMEOUT" "$QEMU" "${QEMU_L[@]}" "${QARGS[@]}" < /dev/null 2> "$RUN/qemu.err" \
  | awk -v verbose="$VERBOSE" -v logf="$RUN/console.log" '
      { sub(/\r$/, ""); print > logf; fflush(logf) }
      /^@@RXE-BEGIN$/ { on = 1; next }
      on && /@@RXE-END$/ { sub(/@@RXE-END$/, ""); if (length($0)) print; fflush(); on = 0; next }
      on { print; fflush(); next }
      /^@@RXE-RC=/ { next }
      { if (verbose == 1 || $0 ~ /^(rxe-guest|guest-kernel):/) { print > "/dev/stderr"; fflush("/dev/stderr") } }'
qrc=${PIPESTATUS[0]}
set -e
rc=$(sed -n 's/^@@RXE-RC=\([0-9]*\).*/\1/p' "$RUN/console.log" | tail -1)
log "guest run took $(since "$tb") (total $(since "$T0")), program exit status ${rc:-none}"
if [[ -z $rc ]]; then
  cat "$RUN/qemu.err" >&2
  if [[ $qrc == 124 ]]; then log "VM timed out after ${TIMEOUT}s; console tail:"; tail -20 "$RUN/console.log" >&2; exit 124; fi
  log "guest never reported a status (qemu exit $qrc); console tail:"; tail -30 "$RUN/console.log" >&2; exit 125
fi
[[ $rc == 0 ]] && KEEP_RUN=0
exit "$rc"
