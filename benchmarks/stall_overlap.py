"""What a decode-only turn costs the streams beside it, read from ``bench_multiturn.py``'s logs.

    python benchmarks/stall_overlap.py /tmp/bench-multiturn-*      # the directories it printed ("logs in ...")

For every run of a ``pdclient serve`` arm: each request's times from the tool's own
per-request output (``stats.json``: start, time to first token, latency, tokens), its route
from the proxy's log (``outcome=decode_only`` or ``disaggregated``; matched to the request
by its time to first token and total time, within 60 ms). A decode-only turn holds the decode
server from its start to its first token. For every request: how long its stream (first
token to last) overlapped other requests' decode-only turns there, and how much longer
its stream took than its tokens at the run's median time per token of the streams no such
turn overlapped. A least-squares line of the one against the other, over every run given:
its slope is the milliseconds a stream loses per millisecond of decode-only turn beside
it. 1.0 means a stream waits for the turn's whole time to first token; the turn's
per-token part alone would be ~0.2 on the CPU pair. Per arm, over its runs: how much
decode-only turn the streams beside one overlapped, and lost (p50, p90, most), which the
stall budget bounds per answer.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from pdclient.cli.bench import quantile

MATCH_MS = 60.0
FIELD = re.compile(r"(\w+)=(\S+)")


def proxy_calls(log: Path) -> list[dict[str, str]]:
    calls = []
    for line in log.read_text(errors="replace").splitlines():
        if " call " in line:
            fields = dict(FIELD.findall(line))
            if "ttft_ms" in fields and "total_ms" in fields:
                calls.append(fields)
    return calls


def matched(stats: list[dict[str, Any]], calls: list[dict[str, str]]) -> list[tuple[dict[str, Any], str]]:
    """Each request with its route, if a call in the proxy's log has its times."""
    times = [(float(call["ttft_ms"]), float(call["total_ms"])) for call in calls]
    free = list(range(len(calls)))
    out = []
    for request in stats:
        distances = {i: abs(times[i][0] - request["ttft_ms"]) + abs(times[i][1] - request["latency_ms"]) for i in free}
        best = min(distances, key=distances.__getitem__, default=None)
        if best is not None and distances[best] < MATCH_MS:
            free.remove(best)
            out.append((request, calls[best].get("outcome", "")))
    return out


def run_points(requests: list[tuple[dict[str, Any], str]]) -> list[tuple[float, float]]:
    """(ms of decode-only turns its stream overlapped, ms its stream took beyond its tokens)."""
    turns = [
        (r["start_time_ms"], r["start_time_ms"] + r["ttft_ms"], id(r)) for r, kind in requests if kind == "decode_only"
    ]
    streams = []
    for request, _ in requests:
        first, last = request["start_time_ms"] + request["ttft_ms"], request["start_time_ms"] + request["latency_ms"]
        overlap = sum(max(0.0, min(last, end) - max(first, start)) for start, end, who in turns if who != id(request))
        streams.append((overlap, last - first, max(1, request["output_num_tokens"] - 1)))
    clean = [took / gaps for overlap, took, gaps in streams if overlap == 0]
    if not clean:
        return []
    per_token = statistics.median(clean)
    return [(overlap, took - per_token * gaps) for overlap, took, gaps in streams]


def arm_line(arm: str, points: list[tuple[float, float]]) -> str:
    """One arm's streams beside decode-only turns: what they overlapped and lost."""
    beside = [(overlap, lost) for overlap, lost in points if overlap > 0]
    if not beside:
        return f"{arm}: {len(points)} requests, none beside a decode-only turn"

    def spread(values: list[float]) -> str:
        return f"{quantile(values, 0.5):.0f} / {quantile(values, 0.9):.0f} / {max(values):.0f}"

    return (
        f"{arm}: {len(points)} requests, {len(beside)} beside decode-only turns; ms overlapped p50 / p90 / most "
        f"{spread([p[0] for p in beside])}, lost {spread([p[1] for p in beside])}"
    )


def main(directories: list[str]) -> int:
    points: list[tuple[float, float]] = []
    by_arm: dict[str, list[tuple[float, float]]] = {}
    for directory in map(Path, directories):
        for run in sorted(directory.glob("run-*-pdclient-*")):
            arm = run.name.split("-", 2)[2]
            log, stats = directory / f"{arm}.log", run / "stats.json"
            if not (log.exists() and stats.exists()):
                continue
            requests = matched(json.loads(stats.read_text()), proxy_calls(log))
            mine = run_points(requests)
            beside = sum(1 for overlap, _ in mine if overlap > 0)
            print(f"{directory.name}/{run.name}: {len(requests)} requests matched, {beside} beside a decode-only turn")
            points += mine
            by_arm.setdefault(arm, []).extend(mine)
    for arm, mine in by_arm.items():
        print(arm_line(arm, mine))
    beside = [(overlap, lost) for overlap, lost in points if overlap > 0]
    if len(beside) < 2:
        print("too few streams beside a decode-only turn to fit")
        return 1
    slope, intercept = statistics.linear_regression([p[0] for p in points], [p[1] for p in points])
    print(
        f"{len(points)} requests, {len(beside)} beside decode-only turns: a stream lost {slope:.2f} ms per ms "
        f"of decode-only turn it overlapped (intercept {intercept:.0f} ms); medians: overlapped "
        f"{statistics.median(p[0] for p in beside):.0f} ms, lost {statistics.median(p[1] for p in beside):.0f} ms"
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
