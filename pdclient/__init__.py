"""pdclient: drop-in openai clients for prefill/decode disaggregated vLLM serving.

A chat or completions call runs a prefill call on a prefill server and a (streamed)
decode call on a decode server, and forwards the prefill's prompt token ids so the
decode server does not render and tokenize the prompt a second time. The map of the
code: docs/ARCHITECTURE.md.
"""

from ._client import AsyncPDChatClient, PDChatClient
from ._endpoints import BreakerSettings
from ._errors import PDConfigError, PDError, PDSetupError
from ._observe import CallView, LegView, PDObserver
from ._options import PDOptions
from ._retry import RetrySettings
from ._routing import RouteRequest, RoutingPolicy
from ._trace import Outcome, PDTrace
from ._transport import AsyncPDTransport, PDTransport

__version__ = "0.2.0"

__all__ = [
    "AsyncPDChatClient",
    "AsyncPDTransport",
    "BreakerSettings",
    "CallView",
    "LegView",
    "Outcome",
    "PDChatClient",
    "PDConfigError",
    "PDError",
    "PDObserver",
    "PDOptions",
    "PDSetupError",
    "PDTrace",
    "PDTransport",
    "RetrySettings",
    "RouteRequest",
    "RoutingPolicy",
    "__version__",
]
