#!/usr/bin/env bash
# Installs Slurm and munge from the system's packages for the `slurm` test (tests/e2e/test_slurm.py), only on a
# CI machine (CI=true) running as root with apt-get, and only when a program the test needs is missing.
# Never fails its caller: when it cannot install, it says so in one line and the test skips with its reason.
# Usage: scripts/slurm/ensure_slurm.sh    (scripts/run_tests.sh calls it)
needed=(munged mungekey slurmctld slurmd sbatch scontrol sinfo scancel)  # tests/slurm_cluster.py PROGRAMS
missing=()
for prog in "${needed[@]}"; do
    command -v "$prog" >/dev/null 2>&1 || [ -x "/usr/sbin/$prog" ] || missing+=("$prog")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "${CI:-}" != "true" ] || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    exit 0  # not a CI machine we may change: the slurm test skips and names what is missing
fi
echo "[setup] installing slurm-wlm and munge for the slurm test (missing: ${missing[*]})" >&2
install() {
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends slurm-wlm munge \
        >/tmp/ensure_slurm.log 2>&1
}
# The package lists of a fresh image may be empty or stale: refresh them once when the first try fails.
if ! install && ! { timeout 300 apt-get update -q >>/tmp/ensure_slurm.log 2>&1 && install; }; then
    echo "[setup] could not install slurm-wlm/munge (see /tmp/ensure_slurm.log); the slurm test will skip" >&2
fi
exit 0
