"""Reading a starting vLLM server's log for the lines that say it will never work.

A vLLM server can break without exiting: when the NIXL handshake listener thread cannot
bind its side-channel port, the thread dies (``Exception in thread
nixl_handshake_listener`` ... ``zmq.error.ZMQError: Address already in use``), the engine
waits forever for it, and the API server process stays up. Waiting for ``/health`` then
takes the whole startup timeout. So LocalPD reads each server's log while it starts and
warms up, and stops at the first fatal line.

What is fatal (after removing vLLM's ``(EngineCore pid=N)`` process prefix and its
``ERROR 12-01 02:11:15 [core.py:1000]`` record prefix, which it repeats on every line of
a multi-line message):

- the exception line that ends a Python traceback, whatever process or thread printed
  it (API server, engine core, worker, NIXL threads), but not one that follows
  ``Exception ignored in`` (an error in a finaliser, which Python reports and survives);
- vLLM's own verdicts: ``EngineCore failed to start``, ``Engine core initialization
  failed``, ``EngineDeadError``, ``Worker proc ... died unexpectedly``; and ``Fatal
  Python error``;
- an ERROR or CRITICAL record (vLLM's or uvicorn's) that says ``address already in use``.

Not fatal: the same words in a warning or info line (vLLM's own port search logs
``Address already in use. Retrying with a new port.`` and recovers), and the warnings
a healthy start prints (``Exception: could not create a primitive descriptor`` inside a
oneDNN fallback warning, the ulimit warning that quotes ``OSError: [Errno 24]``).

A fatal line that says ``address already in use`` (or errno 98) is a port collision:
the one failure a start with other ports can cure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# vLLM prefixes what its child processes print: "(EngineCore pid=6853) ", "(VllmWorker-0 pid=7807) ".
_PROCESS = re.compile(r"^\((?P<proc>[\w.:-]+) pid=\d+\) ")
# vLLM's log record prefix, repeated on each line of a multi-line message.
_RECORD = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ?")
# uvicorn's default format: "ERROR:    [Errno 98] error while attempting to bind on address ...".
_UVICORN = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+")
_VERDICTS = (
    "EngineCore failed to start",
    "Engine core initialization failed",
    "EngineDeadError",
    "Fatal Python error",
    "died unexpectedly",  # "Worker proc VllmWorker-0 died unexpectedly (exit code: ...), shutting down executor."
)
_COLLISION = re.compile(r"address already in use|errno 98\b|EADDRINUSE", re.IGNORECASE)
_ZMQ_PORT = re.compile(r"addr='[^']*:(\d+)'")
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")


@dataclass(frozen=True)
class FatalLine:
    """The first line of a server log that says the server will not work."""

    line: str
    """The offending log line as written (process prefix included)."""
    context: str = ""
    """Where it came from when the log said so, e.g. ``exception in thread nixl_handshake_listener``."""

    @property
    def port_collision(self) -> bool:
        return bool(_COLLISION.search(self.line))

    @property
    def ports(self) -> frozenset[int]:
        """The ports the line names: a ZMQ address's (``addr='tcp://localhost:24897'``)."""
        return frozenset(int(port) for port in _ZMQ_PORT.findall(self.line))

    def __str__(self) -> str:
        return f"{self.line} ({self.context})" if self.context else self.line


@dataclass
class _Traceback:
    context: str
    ignored: bool
    started: bool = False


class LogScanner:
    """Incremental reader of one log file; ``scan()`` returns the first fatal line seen so far."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        self._offset = offset
        self._pending = ""
        # Per process prefix: the traceback being printed, or the context of one about to be.
        self._open: dict[str, _Traceback] = {}
        self.fatal: FatalLine | None = None

    def scan(self) -> FatalLine | None:
        """Reads what was appended since the last call."""
        if self.fatal is not None:
            return self.fatal
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return None
        self._offset += len(data)
        return self.feed(data.decode("utf-8", errors="replace"))

    def feed(self, text: str) -> FatalLine | None:
        """Takes more log text (lines may be split across calls)."""
        if self.fatal is not None:
            return self.fatal
        *lines, self._pending = re.split(r"\r\n|\r|\n", self._pending + text)
        for line in lines:
            self.fatal = self._line(line)
            if self.fatal is not None:
                break
        return self.fatal

    def _line(self, raw: str) -> FatalLine | None:
        line = _ANSI.sub("", raw)
        process = _PROCESS.match(line)
        key = process["proc"] if process else ""
        content = line[process.end() :] if process else line
        level = ""
        record = _RECORD.match(content) or _UVICORN.match(content)
        if record:
            level, content = record["level"], content[record.end() :]
        if not content.strip():
            return None
        offending = FatalLine(raw.strip())

        if level in ("ERROR", "CRITICAL") and offending.port_collision:
            return offending
        if any(verdict in content for verdict in _VERDICTS):
            return offending

        if content.startswith("Exception in thread "):
            name = content.removeprefix("Exception in thread ").split()[0].rstrip(":")
            self._open[key] = _Traceback(f"exception in thread {name}", ignored=False)
            return None
        if content.startswith("Exception ignored"):
            self._open[key] = _Traceback("", ignored=True)
            return None
        if content.startswith("Traceback (most recent call last)"):
            opening = self._open.get(key) or _Traceback("traceback", ignored=False)
            opening.started = True
            self._open[key] = opening
            return None
        tb = self._open.get(key)
        if tb is None or not tb.started or content[0].isspace() or content.startswith(_CHAIN):
            return None
        # The traceback's exception line: the first unindented line after its frames.
        del self._open[key]
        if tb.ignored:
            return None
        return FatalLine(raw.strip(), f"{tb.context}, {process['proc']} process" if process else tb.context)
