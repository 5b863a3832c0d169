"""Running the proxy under uvicorn: one process, or ``workers`` processes on one socket."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ._config import CONFIG_ENV, MULTIPROC_ENV, ServeConfig
from ._logging import logging_config

if TYPE_CHECKING:
    from ._protocol import ServerConfig

STARTUP_FAILURE = 3
"""The exit status when the server could not start (uvicorn's)."""

WORKER_HEALTHCHECK_SECONDS = 30
"""How long the supervisor waits for a worker to answer its ping before killing it and starting
another. uvicorn's 5 s is shorter than a spawned worker's imports take on a busy machine (13 s
measured on 2 cores at load average 14): each replacement was killed in turn and no worker ever
served."""


def server_config(config: ServeConfig, app: Any, **overrides: Any) -> ServerConfig:
    """uvicorn's config for serving ``app`` as ``config`` says: its address, its limits on
    clients (slow heads and bodies, idle and concurrent connections), its logging."""
    from ._protocol import ServerConfig

    settings: dict[str, Any] = {
        "host": config.host,
        "port": config.port,
        "timeout_graceful_shutdown": config.grace_period,
        "timeout_keep_alive": config.keep_alive_timeout,
        "limit_concurrency": config.max_client_connections or None,
        "header_timeout": config.header_timeout,
        "body_timeout": config.body_timeout,
        "max_header_size": config.max_header_size,
        "log_config": logging_config(config.log_format, config.log_level),
        "access_log": False,  # the proxy logs one line per call itself
        "lifespan": "on",
        **overrides,
    }
    return ServerConfig(app, **settings)


def settle() -> None:
    """Take what the process holds once started (modules, the app, its pools) out of the
    garbage collector's full collections.

    A full collection walks every tracked object: ~120k in a started proxy, tens of ms in
    which the worker answers nothing, once every few thousand calls under load (measured on
    loopback stubs: the slowest calls waited on it). Frozen, those objects are no longer
    walked; what calls create is collected as before. Startup's own garbage is collected
    first, so none of it is kept.
    """
    gc.collect()
    gc.freeze()


def worker_app() -> Any:
    """The app factory of ``--workers N``: each worker builds its app, then settles."""
    from ._app import app_from_environment

    app = app_from_environment()
    settle()
    return app


def run(config: ServeConfig) -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting and give in-flight requests
    ``config.grace_period`` seconds before closing them (uvicorn's graceful shutdown)."""
    if config.workers == 1:
        from ._app import create_app
        from ._server import Server

        # What uvicorn.run does for one process, with the config above.
        server = Server(server_config(config, create_app(config)))
        settle()
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
        if not server.started:
            sys.exit(STARTUP_FAILURE)
        return
    from uvicorn.supervisors import Multiprocess

    class Supervisor(Multiprocess):
        """uvicorn's worker supervisor, closing its copy of the listening socket when it stops
        the workers: else the socket stays open until the supervisor exits, and connections
        made during the workers' grace period wait in its backlog instead of being refused."""

        def terminate_all(self) -> None:
            for sock in self.sockets:
                sock.close()
            super().terminate_all()

    with _multiprocess_metrics():
        # Worker processes are spawned: they inherit the environment, not our objects.
        os.environ[CONFIG_ENV] = config.to_json()
        workers = server_config(
            config,
            "pdclient.serve._run:worker_app",
            factory=True,
            workers=config.workers,
            timeout_worker_healthcheck=WORKER_HEALTHCHECK_SECONDS,
        )
        # What uvicorn.run does for workers > 1, with the supervisor above.
        Supervisor(workers, sockets=[workers.bind_socket()]).run()


@contextlib.contextmanager
def _multiprocess_metrics() -> Iterator[None]:
    """prometheus_client's multiprocess mode for the workers: each writes its metrics to
    files in one directory and a scrape, whichever worker answers it, sums them all.

    The directory is ``$PROMETHEUS_MULTIPROC_DIR`` if set (emptied first, as
    prometheus_client requires between runs), else a temporary one removed at exit.
    """
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        for entry in os.scandir(given):
            if entry.name.endswith(".db"):
                os.unlink(entry.path)
        yield
        return
    directory = tempfile.mkdtemp(prefix="pdclient-serve-metrics-")
    os.environ[MULTIPROC_ENV] = directory
    try:
        yield
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(directory, ignore_errors=True)
