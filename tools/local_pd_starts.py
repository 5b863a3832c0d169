"""Start and stop LocalPD N times in a row; print each start's outcome and timings, then a summary.

    python tools/local_pd_starts.py [-n 10] [--decode-servers 1] [--prefill-servers 1]

Not part of ``make test``: it takes N times a pair's start (~1-2 min each here). Run it
alone on the machine, with nothing else on its cores, when the figures matter.
Per start: ok / FAILED, attempts (2 = retried after a port collision), seconds until all
servers answered, warm-up seconds, the whole start() and stop(); a failure prints the
first line of its error. Exit status 1 if any start failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

from pdclient import PDSetupError
from pdclient.local import LocalPD, _prepare


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=10, help="starts (default 10)")
    parser.add_argument("--prefill-servers", type=int, default=1)
    parser.add_argument("--decode-servers", type=int, default=1)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("-v", "--verbose", action="store_true", help="LocalPD's progress log on stderr")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    _prepare.server_python()  # one-time setup outside the timings
    _prepare.model_dir()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    print(f"load before: {_load()}  cache: {_prepare.cache_dir()}", flush=True)
    print(f"{'#':>3} {'result':<7} {'tries':>5} {'ready s':>8} {'warm-up s':>9} {'start s':>8} {'stop s':>7}")
    rows: list[tuple[bool, int, float | None, float | None, float]] = []
    for i in range(1, args.n + 1):
        pd = LocalPD(
            prefill_servers=args.prefill_servers,
            decode_servers=args.decode_servers,
            startup_timeout=args.startup_timeout,
        )
        t0 = time.monotonic()
        error: PDSetupError | None = None
        try:
            pd.start()
        except PDSetupError as exc:
            error = exc
        started = time.monotonic() - t0
        t1 = time.monotonic()
        pd.stop()
        stopped = time.monotonic() - t1
        stats = pd.start_stats
        ok = error is None and stats is not None
        ready = stats.ready_seconds if stats else None
        warm = stats.warmup_seconds if stats else None
        attempts = stats.attempts if stats else 0
        rows.append((ok, attempts, ready, warm, started))
        print(
            f"{i:>3} {'ok' if ok else 'FAILED':<7} {attempts or '-':>5} {_f(ready):>8} {_f(warm):>9} "
            f"{started:>8.1f} {stopped:>7.1f}",
            flush=True,
        )
        if error is not None:
            print(f"    {str(error).splitlines()[0]}", flush=True)
    good = [r for r in rows if r[0]]
    print(f"\n{len(good)}/{len(rows)} starts ok; {sum(1 for r in good if r[1] > 1)} needed a retry")
    for label, values in (
        ("ready s", [r[2] for r in good if r[2] is not None]),
        ("warm-up s", [r[3] for r in good if r[3] is not None]),
        ("start() s", [r[4] for r in good]),
    ):
        if values:
            print(
                f"{label:<10} median {statistics.median(values):6.1f}  min {min(values):6.1f}  max {max(values):6.1f}"
            )
    print(f"load after: {_load()}")
    return 0 if len(good) == len(rows) else 1


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


if __name__ == "__main__":
    sys.exit(main())
