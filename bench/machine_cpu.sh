#!/usr/bin/env bash
# The whole machine's CPU seconds while a command runs (user + nice + system + irq + softirq + steal from /proc/stat,
# before and after), beside its wall time: `bash bench/machine_cpu.sh pytest -q -n 0 tests/kernel/test_distributed.py`.
# Counts every process, also those that leave the command's tree (kernels in sessions of their own, orphans), so an
# A/B on a quiet machine compares everything a change costs. Linux only.
set -u
busy() { read -r _ u n s _ _ q sq st _ < /proc/stat; echo $((u + n + s + q + sq + st)); }
b0=$(busy); t0=$(date +%s.%N)
"$@"; rc=$?
b1=$(busy); t1=$(date +%s.%N)
awk -v b="$((b1 - b0))" -v hz="$(getconf CLK_TCK)" -v w="$(echo "$t1 - $t0" | bc)" -v rc="$rc" \
    'BEGIN { printf "machine CPU %.1f s in %.1f s wall (exit %d)\n", b / hz, w, rc }'
exit "$rc"
