"""The P/D servers named in the environment, else a LocalPD started for the occasion.

Examples, the CLI and the test session all want "the user's servers if they said which,
otherwise real local ones": this is that choice, written once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from .._errors import PDConfigError
from ..pools import DECODE_ENV, PREFILL_ENV, resolve_urls
from ._clients import PairAccess

if TYPE_CHECKING:
    from ._pair import LocalPD

MODEL_ENV = "PDCLIENT_MODEL"


@dataclass(frozen=True)
class PDServers(PairAccess):
    """Where a P/D deployment answers, and what it serves."""

    prefill_urls: tuple[str, ...]
    """Every prefill server's OpenAI base URL (ending in /v1 for a LocalPD)."""
    decode_urls: tuple[str, ...]
    """Every decode server's OpenAI base URL."""
    model: str
    """The served model name to pass as ``model=``."""
    local: LocalPD | None = None
    """The LocalPD running these servers, or None when they came from the environment."""

    def env(self) -> dict[str, str]:
        """The environment that names these servers (for a subprocess), model included."""
        return {
            PREFILL_ENV: ",".join(self.prefill_urls),
            DECODE_ENV: ",".join(self.decode_urls),
            MODEL_ENV: self.model,
        }


@contextlib.contextmanager
def pair_from_env_or_local(
    *,
    environ: Mapping[str, str] | None = None,
    model: str | None = None,
    api_key: str | None = None,
    **local_pd_kwargs: Any,
) -> Iterator[PDServers]:
    """The servers in ``$PDCLIENT_PREFILL_BASE_URL`` / ``$PDCLIENT_DECODE_BASE_URL``, else a LocalPD.

    ::

        with pair_from_env_or_local() as pd:
            with pd.client() as client:
                client.chat.completions.create(model=pd.model, messages=[...])

    With both variables set (comma-separated lists allowed), yields those servers and
    starts nothing; the model is ``model``, else ``$PDCLIENT_MODEL``, else the first model
    the first decode server lists (asked with ``api_key``, default ``$OPENAI_API_KEY``).
    With neither, starts ``LocalPD(**local_pd_kwargs)``, yields its servers (``local`` is
    the LocalPD) and stops it on exit. One without the other is a PDConfigError.

    Args:
        environ: where to read the variables; default ``os.environ``.
        model, api_key: for servers from the environment only.
        local_pd_kwargs: LocalPD's arguments, used only when no servers are named.
    """
    env = os.environ if environ is None else environ
    prefill = _split(env.get(PREFILL_ENV, ""))
    decode = _split(env.get(DECODE_ENV, ""))
    if bool(prefill) != bool(decode):
        have, missing = (PREFILL_ENV, DECODE_ENV) if prefill else (DECODE_ENV, PREFILL_ENV)
        raise PDConfigError(
            f"${have} is set but ${missing} is not: set both ${PREFILL_ENV} and ${DECODE_ENV} "
            "(comma-separated URLs) to use your servers, or neither to start a local pair"
        )
    if prefill:
        prefill_urls = resolve_urls(prefill, argument=f"${PREFILL_ENV}", env=PREFILL_ENV)
        decode_urls = resolve_urls(decode, argument=f"${DECODE_ENV}", env=DECODE_ENV)
        served = model or env.get(MODEL_ENV) or _first_model(decode_urls[0], api_key or env.get("OPENAI_API_KEY"))
        yield PDServers(prefill_urls, decode_urls, served)
        return
    from ._pair import LocalPD

    with LocalPD(**local_pd_kwargs) as pd:
        yield PDServers(tuple(pd.prefill_urls), tuple(pd.decode_urls), pd.model, pd)


def _split(raw: str) -> list[str]:
    return [part for part in (p.strip() for p in raw.split(",")) if part]


def _first_model(decode_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{decode_url}/models", headers=headers, timeout=30)
        response.raise_for_status()
        models = response.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise PDConfigError(
            f"could not list the models of the decode server {decode_url} (from ${DECODE_ENV}): {exc!r}; "
            f"set ${MODEL_ENV} to skip asking"
        ) from exc
    if not models:
        raise PDConfigError(f"the decode server {decode_url} (from ${DECODE_ENV}) serves no model; set ${MODEL_ENV}")
    return str(models[0]["id"])
