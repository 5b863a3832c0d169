"""The I/O: ``PDTransport`` / ``AsyncPDTransport``, the leg clients, and the decode streams
(plain and migrating), the sync and async twins."""

from ._leg_client import IDLE_CONNECTION_SECONDS, LEG_LIMITS
from ._leg_client import _with_url_auth as with_url_auth
from ._relay import Pushing
from ._streams import AsyncDecodeStream
from ._transport import AsyncPDTransport, PDTransport

__all__ = [
    "AsyncDecodeStream",
    "AsyncPDTransport",
    "IDLE_CONNECTION_SECONDS",
    "LEG_LIMITS",
    "PDTransport",
    "Pushing",
    "with_url_auth",
]
