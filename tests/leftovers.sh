#!/usr/bin/env bash
# After the whole suite: nothing the tests started may be left on the host. Counts what
# is (processes of VMs, NATs, sandbox inits, daemons and SSH test hosts; tether mounts,
# network namespaces, loop devices; cgroups under tether's parents), prints the counts, and
# fails when any is not zero after a short grace for processes still exiting.
set -uo pipefail

procs() {
  ps -eo pid=,args= | grep -E 'qemu-system|(^|/| )passt( |$)|(^|/| )pasta( |$)|tether-confine|tetherd|sshd: tsh|tether-ssh-host-' \
    | grep -v -E 'grep|leftovers\.sh' || true
}
mounts() { findmnt -rn -o TARGET 2>/dev/null | grep -E 'tether' || true; }
netns() { ip netns list 2>/dev/null | grep -E '^(tsh|tether-)' || true; }
loops() { losetup -a 2>/dev/null | grep -E 'tether|store\.img' || true; }
# A sandbox's or a VM's cgroup under a tether parent, left behind (empty or not).
cgroups() {
  for d in /sys/fs/cgroup/*/tether* /sys/fs/cgroup/tether* /sys/fs/cgroup/unified/tether*; do
    [ -d "$d" ] || continue
    find "$d" -mindepth 1 -type d 2>/dev/null
  done
}

for _ in $(seq 1 20); do
  [ -z "$(procs)" ] && break
  sleep 0.5
done
fail=0
for what in procs mounts netns loops cgroups; do
  left="$($what)"
  n=0
  [ -n "$left" ] && n=$(printf '%s\n' "$left" | wc -l)
  echo "leftovers: $what $n"
  if [ "$n" -gt 0 ]; then
    printf '%s\n' "$left" | head -20 | sed 's/^/  /'
    fail=1
  fi
done
exit "$fail"
