"""``pdclient serve``: an OpenAI-compatible P/D proxy (the ``pdclient[serve]`` extra).

    from pdclient import PDOptions
    from pdclient.serve import ServeConfig, create_app, run

    config = ServeConfig(options=PDOptions(prefill_base_url="http://p:8100/v1", decode_base_url="http://d:8200/v1"))
    app = create_app(config)        # any ASGI server
    run(config)                     # or under uvicorn, as `pdclient serve --prefill URL --decode URL` does

``ServeConfig`` and ``SETTINGS`` (every setting's flag, config-file key and environment
variable) import nothing beyond pdclient; ``create_app`` and ``run`` need the extra
(starlette, uvicorn, prometheus-client), imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._config import CONFIG_FILE_ENV, SETTINGS, ServeConfig, Setting

if TYPE_CHECKING:
    from ._app import create_app
    from ._run import run


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from ._app import create_app

        return create_app
    if name == "run":
        from ._run import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CONFIG_FILE_ENV", "SETTINGS", "ServeConfig", "Setting", "create_app", "run"]
