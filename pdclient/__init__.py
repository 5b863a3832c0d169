"""pdclient: drop-in openai clients for prefill/decode disaggregated vLLM serving.

A chat or completions call runs a prefill call on a prefill server and a (streamed)
decode call on a decode server, and forwards the prefill's prompt token ids so the
decode server does not render and tokenize the prompt a second time.
"""

from ._client import AsyncPDChatClient, PDChatClient
from ._errors import PDConfigError, PDError, PDHandoffError, PDSetupError
from ._trace import PDTrace
from ._transport import AsyncPDTransport, PDTransport

__version__ = "0.1.0"

__all__ = [
    "AsyncPDChatClient",
    "AsyncPDTransport",
    "PDChatClient",
    "PDConfigError",
    "PDError",
    "PDHandoffError",
    "PDSetupError",
    "PDTrace",
    "PDTransport",
    "__version__",
]
