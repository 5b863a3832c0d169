"""``pdclient serve``: an OpenAI-compatible P/D proxy (the ``pdclient[serve]`` extra).

    from pdclient.serve import ServeConfig, create_app
    app = create_app(ServeConfig(prefill=("http://p:8100/v1",), decode=("http://d:8200/v1",)))
    # any ASGI server; `pdclient serve --prefill URL --decode URL` runs it under uvicorn

``ServeConfig`` imports nothing beyond pdclient; ``create_app`` needs the extra
(starlette, uvicorn, prometheus-client) and is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._config import ServeConfig

if TYPE_CHECKING:
    from ._app import create_app


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from ._app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ServeConfig", "create_app"]
