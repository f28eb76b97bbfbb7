#!/usr/bin/env bash
# Installs the Debian packages whose daemons the tests start themselves:
#   etcd-server (tests start single members and 3-member clusters on loopback ports)
#   munge, slurmctld, slurmd, slurm-client, libslurm-dev, gcc (tests start a one-host Slurm cluster)
# Usage: scripts/services.sh install
set -euo pipefail
pkgs=(etcd-server)
[ -d packages/scheduler-slurm ] && pkgs+=(munge slurmctld slurmd slurm-client libslurm-dev gcc libc6-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "services: apt-get install ${missing[*]}" >&2
  [ -f /tmp/.rota-apt-updated ] || { apt-get update -q >/dev/null && touch /tmp/.rota-apt-updated; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  # Debian starts etcd as a system service on install; the tests run their own members.
  systemctl disable --now etcd >/dev/null 2>&1 || pkill -x etcd >/dev/null 2>&1 || true
fi
