"""Decode migration without I/O: whether a call may move, the SSE tracker, the continuation's
bodies and route."""

from ._call import MigratingCall
from ._core import Assembler, CallMigration, CannotAssemble, CannotMove, Continuation, Route, Tracker, arm

__all__ = [
    "Assembler",
    "CallMigration",
    "CannotAssemble",
    "CannotMove",
    "Continuation",
    "Route",
    "MigratingCall",
    "Tracker",
    "arm",
]
