"""What each route costs a call, learnt from live traffic: pure (no I/O, no clock of its own).

``CostModel`` learns per endpoint from each finished call's ``CallCost`` (a decode
server's prefill rate, the handover a P/D call pays, each dispatch mode's time to first
token per prefill endpoint) and predicts each
route's time to first token and the stall a decode-only turn puts on the decode's other
streams (``RouteCosts``); ``DispatchChooser`` picks sequential or concurrent. The decisions
that read them are ``conversations.decide_remote_prefill`` and ``handoff._dispatch``.
"""

from ._call_cost import CallCost
from ._dispatch_choice import (
    CONCURRENT,
    PROBE_EVERY,
    SEQUENTIAL,
    SEQUENTIAL_FOR_S,
    UNSTABLE_WINDOW_S,
    DispatchChoice,
    DispatchChooser,
    DispatchReason,
)
from ._line import CostLine, Line
from ._model import CostModel, RouteCosts
from ._priors import CostPriors

__all__ = [
    "CONCURRENT",
    "PROBE_EVERY",
    "SEQUENTIAL",
    "SEQUENTIAL_FOR_S",
    "UNSTABLE_WINDOW_S",
    "CallCost",
    "CostLine",
    "CostModel",
    "CostPriors",
    "DispatchChoice",
    "DispatchChooser",
    "DispatchReason",
    "Line",
    "RouteCosts",
]
