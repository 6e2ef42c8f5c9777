"""Closed-loop load: N clients, each sending its next request when the previous one finished;
a sweep over client counts, with how busy the machine's other processes were meanwhile."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

if __name__ == "__main__":  # a library, not a script: say what it holds
    raise SystemExit(print(__doc__))

from perf.served.drivers import Driver
from perf.served.fastgen_metrics import RequestRecord, summarize
from perf.common.workload import RequestSpec

def run_point(
    driver: Driver,
    specs: Sequence[RequestSpec],
    clients: int,
    num_requests: int,
    time_limit_s: float = 600.0,
    request_timeout_s: float = 300.0,
    start_offset: int = 0,
) -> list[RequestRecord]:
    """`clients` closed-loop clients share the next `num_requests` requests of `specs`.

    Requests are taken in order from `specs` (cycling, starting at `start_offset`), so every
    system sees the same sequence. No new request starts after `time_limit_s`; those already
    in flight finish (bounded by `request_timeout_s`).
    """
    order = [specs[(start_offset + i) % len(specs)] for i in range(num_requests)]
    next_i = [0]
    lock = threading.Lock()
    records: list[RequestRecord] = []
    t_stop = time.perf_counter() + time_limit_s

    def take() -> RequestSpec | None:
        with lock:
            if next_i[0] >= len(order) or time.perf_counter() > t_stop:
                return None
            s = order[next_i[0]]
            next_i[0] += 1
            return s

    def worker(cid: int) -> None:
        while True:
            s = take()
            if s is None:
                return
            try:
                rec = driver.run_one(s, cid, request_timeout_s)
            except Exception as exc:  # noqa: BLE001
                now = time.perf_counter()
                rec = RequestRecord(s.idx, cid, s.prompt_tokens, s.gen_tokens, start=now, end=now,
                                    error=f"{type(exc).__name__}: {exc}")
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(time_limit_s + request_timeout_s + 60)
    return sorted(records, key=lambda r: r.start)


def proc_tree(roots: Iterable[int]) -> set[int]:
    """`roots` and all their descendants (from /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parent[int(d.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree = set(r for r in roots if r in parent)
    changed = True
    while changed:
        changed = False
        for pid, ppid in parent.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                changed = True
    return tree


def cpu_seconds(stat_file: str) -> float | None:
    """utime + stime, in seconds, from a /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat file;
    None when it is gone or unreadable."""
    try:
        stat = Path(stat_file).read_text()
        f = stat[stat.rindex(")") + 2:].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_snapshot(roots: Iterable[int]) -> tuple[float, float, float] | None:
    """(wall time, CPU seconds used by the whole machine, CPU seconds of the `roots` trees).

    Two snapshots give how many cores other processes (not the benchmark client, not the server
    under test) kept busy in between: the benchmark's noise on a shared machine.
    """
    try:
        hz = os.sysconf("SC_CLK_TCK")
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        vals = [int(x) for x in fields]
        busy = (sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)) / hz  # minus idle, iowait
        ours = sum(cpu_seconds(f"/proc/{pid}/stat") or 0.0 for pid in proc_tree(roots))
        return time.monotonic(), busy, ours
    except (OSError, ValueError):
        return None


def cpu_usage(before, after) -> dict | None:
    if not before or not after or after[0] - before[0] < 1.0:
        return None
    wall = after[0] - before[0]
    total = (after[1] - before[1]) / wall
    ours = (after[2] - before[2]) / wall
    return {"machine_cores_busy": total, "ours_cores_busy": ours, "foreign_cores_busy": max(0.0, total - ours)}


def parse_ints(s: str) -> list[int]:
    """'1,2, 4' -> [1, 2, 4] (client counts on command lines)."""
    return [int(x) for x in s.replace(" ", "").split(",") if x]


def requests_for(clients: int, per_client: int, minimum: int, maximum: int) -> int:
    return max(minimum, min(maximum, per_client * clients))


def sweep(
    driver: Driver,
    specs: Sequence[RequestSpec],
    client_counts: Sequence[int],
    per_client: int = 3,
    min_requests: int = 12,
    max_requests: int = 512,
    time_limit_s: float = 600.0,
    request_timeout_s: float = 300.0,
    warmup: int = 2,
    log: Callable[[str], None] = print,
    server_pids: Callable[[], Iterable[int]] | None = None,
    start_offset: int = 0,
) -> dict:
    """Runs each client count in turn; returns {"points": [{clients, records, metrics, cpu}]}.

    `server_pids` (the server's root process ids) lets each point record how busy the machine's
    other processes were meanwhile (`cpu.foreign_cores_busy`).
    """
    if warmup:
        for s in specs[:warmup]:
            w = driver.run_one(RequestSpec(s.idx, s.prompt, s.prompt_tokens, min(s.gen_tokens, 8)), 0,
                               request_timeout_s)
            if w.error:
                raise RuntimeError(f"warm-up request failed: {w.error}")
    points = []
    offset = start_offset
    for c in client_counts:
        n = requests_for(c, per_client, min_requests, max_requests)
        t = time.perf_counter()
        roots = [os.getpid(), *(server_pids() if server_pids else [])]
        before = cpu_snapshot(roots)
        recs = run_point(driver, specs, c, n, time_limit_s, request_timeout_s, start_offset=offset)
        cpu = cpu_usage(before, cpu_snapshot(roots))
        offset += n
        m = summarize(recs)
        log(f"  clients={c:3d} requests={m['completed']}/{n} errors={m['errors']} "
            f"thr={m.get('throughput_rps', float('nan')):.3f} rps "
            f"lat={m.get('mean_latency_s', float('nan')):.2f}s "
            f"ttft_p50={m.get('p50_ttft_s', float('nan')):.2f}s "
            f"tok_p95={m.get('token_latency_p95_s', float('nan')) * 1000:.0f}ms "
            f"eff@4={m.get('effective_rps@4', float('nan')):.3f} ({time.perf_counter() - t:.0f}s"
            + (f", other processes {cpu['foreign_cores_busy']:.2f} cores)" if cpu else ")"))
        if m["errors"]:
            first = next(r.error for r in recs if r.error)
            log(f"    first error: {first}")
        points.append({"clients": c, "requests": n, "records": [r.to_json() for r in recs], "metrics": m,
                       "cpu": cpu})
    return {"points": points}
