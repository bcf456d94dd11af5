"""How fast two Python interpreters run pure-Python work of the kind the suite and the orchestrator do (dicts, JSON,
a regex, small objects and method calls): `python bench/bench_interpreter.py PYTHON_A PYTHON_B [--rounds N]`.

Why: `make setup` makes the venv from /usr/bin/python3 when it qualifies (the Makefile says why): a distribution's
CPython is usually built with profile-guided and link-time optimization, a default pyenv build is not. Each round
runs the same workload once in a fresh process of each interpreter, alternating which goes first; prints each one's
median process CPU seconds and B / A per round (median and spread). Nothing is timed in tests.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

WORKLOAD = r"""
import json, re, time
start = time.process_time()
for _ in range(3):
    table = {str(i): [i, i * 2, {"a": i}] for i in range(200_000)}
    text = json.dumps(table)
    json.loads(text)
    re.findall(r"\d+", text[:500_000])

    class Step:
        def __init__(self, x):
            self.x = x

        def next(self):
            return self.x + 1

    total = 0
    for i in range(1_000_000):
        total += Step(i).next()
print(time.process_time() - start)
"""


def cpu_seconds(python: str) -> float:
    done = subprocess.run([python, "-c", WORKLOAD], capture_output=True, text=True, check=True)
    return float(done.stdout.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="an interpreter (the baseline)")
    parser.add_argument("b", help="another interpreter")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict = {args.a: [], args.b: []}
    ratios = []
    for r in range(args.rounds):
        order = (args.a, args.b) if r % 2 == 0 else (args.b, args.a)
        for python in order:
            times[python].append(cpu_seconds(python))
        ratios.append(times[args.b][-1] / times[args.a][-1])
    for python, values in times.items():
        print(f"{python}: {statistics.median(values):.2f} CPU s (median of {len(values)})")
    print(f"B / A: {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
