"""N toy relays in ONE `relays` flow run on one worker (this process), on the emulator and a SQLite or PostgreSQL Prefect server.

Each relay is a copy of examples/byo-plain with `sessions` short step-bounded sessions (session.max_steps), one
account whose limit is `slots` sessions (the spec's kaggle.account_sessions and the emulator's cap). The flow runs
here, as a worker's flow-run process would run it, against `prefect server start` on SQLite (what `relay run`
and a newcomer's server use; the default) or, with `--db postgres`, on a fresh local PostgreSQL
(deploy/local_postgres.py: the team's server, docs/prefect.md). Figures (issue 60's), labelled with the database:
    peak RSS of this process (the flow run) and of the server;
    round time, median / max (flows.relay_rounds.run_round, timed);
    free slots waiting for a ready relay: the fraction of the time (from the first push to the last session's end)
        with fewer than `slots` sessions pushed-and-not-ended while a relay with work left had none (the hand-over
        and the round's latency between one session and the next: the emulator's push and end times); also per
        slot: free slot-seconds that had a ready relay to take them, of all slot-seconds;
    503 answers to the flow's lock and slot writes (tasks/prefect_writes.REFUSED: counted, not only retried), and
        the writes of the kinds SQLite can refuse (a variable's PATCH and DELETE, increment-with-lease: they read
        before they write) the flow sent, per relay-session;
    Prefect database rows per relay-session (every table of the server's database, at the end).
The kernels run on the same machine (on Kaggle they would not): on a small machine they compete with the flow.

    python bench/bench_relays.py --relays 20 [--relays 200] [--sessions 2] [--slots 4] [--db postgres]
    python bench/run.py --only relays                      (20 and 50; --quick: 10)
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from prefect_database import LocalPostgres, postgres_rows, sqlite_rows  # noqa: E402 - bench/, beside this file
PREFECT = str(Path(sys.executable).parent / "prefect")
USER, KEY = "bench", "bench-key-0123456789abcdef"
STEPS_PER_SESSION = 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec(name: str, sessions: int, slots: int) -> dict:
    spec = yaml.safe_load((REPO / "examples" / "byo-plain" / "spec.yaml").read_text())
    spec.update(name=name)
    spec["code"]["folder"] = str(REPO / "examples" / "byo-plain")
    spec["code"]["entry"] = f"train.py --lr 0.003 --steps {sessions * STEPS_PER_SESSION}"
    spec["optim"].update(max_steps=sessions * STEPS_PER_SESSION)
    spec["session"].update(max_steps=STEPS_PER_SESSION, save_every="5s", safety_margin="0.5s")
    spec["kaggle"] = {"session_timeout": "15m", "startup_overhead": "1s", "account_sessions": slots}
    return spec


def _sessions_on_kaggle(kernels: dict) -> list:
    """[(pushed, ended)] of every session, the emulator's clock (Kaggle's view: a slot is taken from push to end)."""
    return [(v["pushed"], v.get("ended") or v["pushed"]) for k in kernels.values() for v in k["versions"]
            if v.get("pushed")]


def _ready_spans(changes: list) -> list:
    """[(from, to)] in which a relay was ready to push (its hand-over done, or nothing to hand over) and not yet
    pushed: from the flow's own state changes [(time, relay, state)] (AccountSessions.stepped), READY until the
    next state that is neither READY nor WAITING (waiting for a slot)."""
    spans, since = [], {}
    for t, relay, state in sorted(changes, key=lambda c: c[0]):
        if state == "ready":
            since.setdefault(relay, t)
        elif state != "waiting" and relay in since:
            spans.append((since.pop(relay), t))
    return spans


def _free_while_ready(kernels: dict, changes: list, slots: int) -> tuple:
    """The scheduler's figure (issue 60: "free slots waiting for a ready relay"): the fraction of the time (first
    push to last session's end) in which fewer than `slots` sessions ran on Kaggle while some relay was ready to
    push. A relay's own hand-over is not in it: it is not ready then. Also each such stretch's length (a slot
    free, a relay ready, until a push filled it): the scheduler's latency, whatever the sessions' length; and the
    same per slot: the free slot-seconds that had a ready relay to take them (min(free slots, ready relays) at
    each moment) of all `slots` x the span's slot-seconds, what "a free session slot waits" is for each slot."""
    sessions = _sessions_on_kaggle(kernels)
    if not sessions:
        return 0.0, [], 0.0
    start, end = min(p for p, _ in sessions), max(e for _, e in sessions)
    edges = sorted({start, end, *[t for s in sessions for t in s], *[t for s in _ready_spans(changes) for t in s]})
    ready = _ready_spans(changes)
    free, gaps, open_at, slot_s = 0.0, [], None, 0.0
    for a, b in zip(edges, edges[1:]):
        if a < start or b > end:
            continue
        mid = (a + b) / 2
        running = sum(1 for p, e in sessions if p <= mid < e)
        waiting = sum(1 for f, t in ready if f <= mid < t)
        slot_s += min(max(0, slots - running), waiting) * (b - a)
        if running < slots and waiting:
            free += b - a
            open_at = a if open_at is None else open_at
        elif open_at is not None:
            gaps.append(a - open_at)
            open_at = None
    return free / max(1e-9, end - start), gaps, slot_s / max(1e-9, slots * (end - start))


def _idle_fraction(kernels: dict, slots: int) -> float:
    """The hand-over gap: the fraction of time with a free slot while a relay had work left and no session in
    flight (its own hand-over, download and publish, counts as waiting here: not the scheduler's figure)."""
    events, last_end = [], {}
    for ref, kernel in kernels.items():
        versions = [v for v in kernel["versions"] if v.get("pushed")]
        for v in versions:
            events += [(v["pushed"], 1, ref), (v.get("ended") or v["pushed"], -1, ref)]
        if versions:
            last_end[ref] = max(v.get("ended") or v["pushed"] for v in versions)
    if not events:
        return 0.0
    events.sort(key=lambda e: (e[0], e[1]))
    start, end = events[0][0], max(last_end.values())
    running: dict = {}
    idle, t_prev = 0.0, start
    for t, delta, ref in events:
        flying = sum(running.values())
        waiting = sum(1 for r, done in last_end.items() if t_prev < done and not running.get(r))
        if flying < slots and waiting:
            idle += t - t_prev
        running[ref] = running.get(ref, 0) + delta
        t_prev = t
    return idle / max(1e-9, end - start)


def _server_503s(log: Path) -> dict:
    """Every 503 the server answered, to anyone (the flow's logs, artifacts and task runs too, which Prefect's
    client retries unseen), by the server's route function: its log with PREFECT_SERVER_LOG_RETRYABLE_ERRORS."""
    import re
    from collections import Counter

    found: Counter = Counter()
    marker = "Encountered retryable exception in request"
    for block in log.read_text(errors="replace").split(marker)[1:]:
        m = re.search(r'prefect/server/api/(?!server\.py)(\w+)\.py", line \d+, in (\w+)', block)
        found[f"{m.group(1)}.{m.group(2)}" if m else "?"] += 1  # the route refused, past the middleware
    return dict(found)


def _rss(proc) -> int:
    try:
        return proc.memory_info().rss
    except psutil.Error:  # ended meanwhile (a PostgreSQL backend)
        return 0


def _spread(values: list) -> list:
    """[count, median, max] of `values` (seconds)."""
    return [len(values), round(statistics.median(values), 2), round(max(values), 2)] if values else [0, 0, 0]


REFUSABLE = ("PATCH /variables/name/*", "DELETE /variables/name/*", "POST /v2/concurrency_limits/increment-with-lease")


def _count_writes() -> Counter:
    """Every request this process's sync Prefect clients send (the slot, queue and lock writes among them), by
    kind (tasks/prefect_writes.kind), retries included: what the 503s are out of."""
    import httpx

    from tasks.prefect_writes import kind

    sent: Counter = Counter()
    send = httpx.Client.send

    def counted(self, request, *args, **kwargs):
        sent[kind(request)] += 1
        return send(self, request, *args, **kwargs)

    httpx.Client.send = counted
    return sent


def one_size(n: int, sessions: int, slots: int, root: Path, db: str = "sqlite") -> dict:
    from relay.emulator import Emulator, EmulatorConfig

    port = _port()
    api = f"http://127.0.0.1:{port}/api"
    prefect_home = root / "prefect"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "KAGGLE_", "RELAY_"))}
    env.update(PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               PREFECT_SERVER_LOG_RETRYABLE_ERRORS="true")  # every 503 the server answers, in its log
    postgres = LocalPostgres() if db == "postgres" else None
    if postgres is not None:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = postgres.url
    emulator = Emulator(root / "emulator", EmulatorConfig(users={USER: KEY}, max_gpu_sessions=slots,
                                                          kernel_env={"OMP_NUM_THREADS": "1"}))
    emulator.start()
    logs = open(root / "server.log", "w")
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              cwd=REPO, stdout=logs, stderr=subprocess.STDOUT, start_new_session=True)
    peak = {"flow": 0.0, "server": 0.0}
    stop = threading.Event()

    def sample() -> None:
        me = psutil.Process()
        while not stop.wait(1.0):
            try:
                peak["flow"] = max(peak["flow"], me.memory_info().rss / 2 ** 20)
                tree = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
                if postgres is not None:  # its PostgreSQL is not its child; summed RSS counts shared buffers in each
                    tree += postgres.processes()
                peak["server"] = max(peak["server"], sum(_rss(p) for p in tree) / 2 ** 20)
            except psutil.Error:
                continue

    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"{api}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the Prefect server did not start in 300 s"
                time.sleep(0.5)
        os.environ.update(PREFECT_API_URL=api, PREFECT_HOME=str(prefect_home), RELAY_KAGGLE_ENDPOINT=emulator.url,
                          KAGGLE_USERNAME=USER, KAGGLE_KEY=KEY, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        specs = []
        for i in range(n):
            path = root / "specs" / f"toy-{i}.yaml"
            path.parent.mkdir(exist_ok=True)
            path.write_text(yaml.safe_dump(_spec(f"toy-{i}", sessions, slots)))
            specs.append(str(path))
        import flows.relays_sharing_quota as relays_flow
        from tasks.account_slots import AccountSessions
        from tasks import prefect_writes

        rounds, timed = [], relays_flow.run_round

        def run_round(*args, **kwargs):
            t = time.monotonic()
            try:
                return timed(*args, **kwargs)
            finally:
                rounds.append(time.monotonic() - t)

        relays_flow.run_round = run_round
        refused_before, refused_by = prefect_writes.REFUSED[0], dict(prefect_writes.REFUSED_BY)
        changes, stepped = [], AccountSessions.stepped

        def record(self, relay, state):  # the flow's own state changes: when each relay became ready, was pushed
            changes.append((time.time(), relay, state.value))
            return stepped(self, relay, state)

        AccountSessions.stepped = record
        seen_ended, session_ended = [], AccountSessions.session_ended

        def record_end(self, relay):  # when the flow saw a session end and gave its slot back
            seen_ended.append(time.time())
            return session_ended(self, relay)

        AccountSessions.session_ended = record_end
        sent = _count_writes()
        threading.Thread(target=sample, daemon=True).start()
        t0 = time.monotonic()
        try:
            summary = relays_flow.relays(specs=specs, state_dir=str(root / "orchestrator"), poll_seconds=2.0,
                                         live_seconds=30.0, step_lock_wait_s=5)
        finally:
            relays_flow.run_round, AccountSessions.stepped = timed, stepped
            AccountSessions.session_ended = session_ended
        wall = time.monotonic() - t0
        stop.set()
        states = {r["state"] for r in summary["relays"].values()}
        assert states == {"done"}, summary
        with emulator.store.lock:
            kernels = {ref: {"versions": [dict(v) for v in k["versions"]]} for ref, k in emulator.store.kernels.items()}
        rows = postgres_rows(postgres.url) if postgres is not None else sqlite_rows(prefect_home / "prefect.db")
        free_while_ready, gaps, free_slot_s = _free_while_ready(kernels, changes, slots)
        ends = sorted(e for _, e in _sessions_on_kaggle(kernels))
        seen_after = [min(t for t in seen_ended if t >= e) - e for e in ends if any(t >= e for t in seen_ended)]
        pushes = sorted(p for p, _ in _sessions_on_kaggle(kernels))
        pushed_after = [min(p for p in pushes if p >= t) - t for t in seen_ended if any(p >= t for p in pushes)]
        return {f"relays_{n}_wall_s": round(wall, 1), f"relays_{n}_rounds": len(rounds),
                f"relays_{n}_round_s_median": round(statistics.median(rounds), 2),
                f"relays_{n}_round_s_max": round(max(rounds), 2),
                f"relays_{n}_flow_rss_mb_peak": round(peak["flow"]), f"relays_{n}_server_rss_mb_peak": round(peak["server"]),
                f"relays_{n}_free_while_ready": round(free_while_ready, 3),
                f"relays_{n}_free_slot_s_while_ready": round(free_slot_s, 3),
                f"relays_{n}_free_gap_s": [len(gaps), round(statistics.median(gaps), 2) if gaps else 0,
                                           round(max(gaps), 2) if gaps else 0],
                f"relays_{n}_end_seen_s": _spread(seen_after), f"relays_{n}_seen_push_s": _spread(pushed_after),
                f"relays_{n}_session_s_median": round(statistics.median(e - p for p, e in _sessions_on_kaggle(kernels)), 2),
                f"relays_{n}_handover_gap": round(_idle_fraction(kernels, slots), 3),
                f"relays_{n}_lock_503": prefect_writes.REFUSED[0] - refused_before,
                f"relays_{n}_lock_503_by": {k: v - refused_by.get(k, 0) for k, v in prefect_writes.REFUSED_BY.items()
                                            if v > refused_by.get(k, 0)},
                f"relays_{n}_server_503": _server_503s(root / "server.log"),
                f"relays_{n}_refusable_writes_by": {k: sent[k] for k in REFUSABLE if sent[k]},
                f"relays_{n}_refusable_writes_per_relay_session": round(sum(sent[k] for k in REFUSABLE) / (n * sessions), 2),
                f"relays_{n}_db_rows_per_relay_session": round(sum(rows.values()) / (n * sessions), 1),
                f"relays_{n}_db_rows_by_table": dict(list(rows.items())[:8])}
    finally:
        stop.set()
        for p in [*psutil.Process(server.pid).children(recursive=True), psutil.Process(server.pid)]:
            try:
                p.kill()
            except psutil.Error:
                pass
        server.wait()
        emulator.stop()
        if postgres is not None:
            postgres.stop()


def run(counts: tuple = (20, 50), sessions: int = 2, slots: int = 4, db: str = "sqlite") -> dict:
    """Each size in a process of its own (Prefect reads its settings, PREFECT_API_URL among them, once)."""
    import json

    figures: dict = {"relays_counts": list(counts), "relays_sessions": sessions, "relays_slots": slots, "relays_db": db}
    for n in counts:
        out = subprocess.run([sys.executable, __file__, "--one", str(n), "--sessions", str(sessions), "--slots",
                              str(slots), "--db", db], cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        figures.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return figures


def format_lines(f: dict) -> list:
    db = {"sqlite": "SQLite", "postgres": "PostgreSQL"}[f.get("relays_db", "sqlite")]
    lines = [f"relays (N toy relays of {f['relays_sessions']} sessions in ONE `relays` run on one worker, {db}"
             f" Prefect server, {f['relays_slots']} session slots; kernels on the same machine):"]
    for n in f["relays_counts"]:
        lines.append(f"  N={n}: done in {f[f'relays_{n}_wall_s']} s, {f[f'relays_{n}_rounds']} rounds of median"
                     f" {f[f'relays_{n}_round_s_median']} s / max {f[f'relays_{n}_round_s_max']} s; peak RSS flow"
                     f" {f[f'relays_{n}_flow_rss_mb_peak']} MB, server {f[f'relays_{n}_server_rss_mb_peak']} MB;"
                     f" free slots waiting for a ready relay {100 * f[f'relays_{n}_free_while_ready']:.1f} % of"
                     f" the time, per slot {100 * f[f'relays_{n}_free_slot_s_while_ready']:.1f} % of its"
                     f" slot-seconds (hand-over gap: a slot free while a relay had no session in flight,"
                     f" {100 * f[f'relays_{n}_handover_gap']:.0f} %; {f[f'relays_{n}_free_gap_s'][0]} stretches of a"
                     f" free slot and a ready relay, median {f[f'relays_{n}_free_gap_s'][1]} s / max"
                     f" {f[f'relays_{n}_free_gap_s'][2]} s; sessions of median {f[f'relays_{n}_session_s_median']} s;"
                     f" a session's end seen (its slot given back) after [n, median, max]"
                     f" {f[f'relays_{n}_end_seen_s']} s, the next push after that {f[f'relays_{n}_seen_push_s']} s);"
                     f" lock/slot writes answered 503 ({db}):"
                     f" {f[f'relays_{n}_lock_503']} {f[f'relays_{n}_lock_503_by']}, out of"
                     f" {f[f'relays_{n}_refusable_writes_per_relay_session']} writes of the kinds SQLite refuses per"
                     f" relay-session ({f[f'relays_{n}_refusable_writes_by']}); all 503s the server answered:"
                     f" {f[f'relays_{n}_server_503']}; Prefect DB ({db}) rows per"
                     f" relay-session {f[f'relays_{n}_db_rows_per_relay_session']}"
                     f" ({f[f'relays_{n}_db_rows_by_table']})")
    first, last = f["relays_counts"][0], f["relays_counts"][-1]
    if first != last:
        lines.append(f"  {last} vs {first} relays: round median x"
                     f"{f[f'relays_{last}_round_s_median'] / max(1e-9, f[f'relays_{first}_round_s_median']):.2f},"
                     f" DB rows per relay-session x"
                     f"{f[f'relays_{last}_db_rows_per_relay_session'] / max(1e-9, f[f'relays_{first}_db_rows_per_relay_session']):.2f}")
    return lines


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--relays", type=int, action="append", help="relays in the run (repeat for several sizes)")
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite",
                    help="the Prefect server's database: SQLite (default) or a fresh local PostgreSQL")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one size, its figures as JSON (run())
    a = ap.parse_args()
    if a.one:
        import json

        tmp = Path(tempfile.mkdtemp(prefix="bench-relays-"))
        try:
            print(json.dumps(one_size(a.one, a.sessions, a.slots, tmp, a.db)))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        print("\n".join(format_lines(run(tuple(a.relays or (20,)), a.sessions, a.slots, a.db))))
