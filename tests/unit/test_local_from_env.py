"""pair_from_env_or_local: the servers in the environment, else a LocalPD (here a stand-in), without vLLM."""

from __future__ import annotations

from types import TracebackType
from typing import Any, ClassVar

import httpx
import pytest
import respx

from pdclient import PDChatClient, PDConfigError
from pdclient.local import PDServers, _pair, pair_from_env_or_local

P1, P2, D1 = "http://p1:8100/v1", "http://p2:8100/v1", "http://d1:8200/v1"


class FakeLocalPD:
    """Stands in for LocalPD: records its arguments, start and stop."""

    made: ClassVar[list[FakeLocalPD]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.running = False
        FakeLocalPD.made.append(self)

    def __enter__(self) -> FakeLocalPD:
        self.running = True
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.running = False

    prefill_urls: ClassVar[list[str]] = ["http://127.0.0.1:20001/v1"]
    decode_urls: ClassVar[list[str]] = ["http://127.0.0.1:20003/v1", "http://127.0.0.1:20005/v1"]
    model = "smollm2"


@pytest.fixture(autouse=True)
def fake_local(monkeypatch: pytest.MonkeyPatch) -> type[FakeLocalPD]:
    FakeLocalPD.made = []
    monkeypatch.setattr(_pair, "LocalPD", FakeLocalPD)
    return FakeLocalPD


def test_servers_from_the_environment_start_nothing() -> None:
    env = {
        "PDCLIENT_PREFILL_BASE_URL": f" {P1}/, {P2} ",
        "PDCLIENT_DECODE_BASE_URL": D1,
        "PDCLIENT_MODEL": "m",
    }
    with pair_from_env_or_local(environ=env, extra_server_args=("--x",)) as servers:
        assert servers == PDServers((P1, P2), (D1,), "m", None)
        assert (servers.prefill_url, servers.decode_url) == (P1, D1)
        assert servers.env() == {
            "PDCLIENT_PREFILL_BASE_URL": f"{P1},{P2}",
            "PDCLIENT_DECODE_BASE_URL": D1,
            "PDCLIENT_MODEL": "m",
        }
    assert FakeLocalPD.made == []


def test_the_model_is_the_first_the_decode_server_lists() -> None:
    env = {"PDCLIENT_PREFILL_BASE_URL": P1, "PDCLIENT_DECODE_BASE_URL": D1, "OPENAI_API_KEY": "sk-1"}
    with respx.mock() as router:
        models = router.get(f"{D1}/models").respond(json={"data": [{"id": "served"}, {"id": "other"}]})
        with pair_from_env_or_local(environ=env) as servers:
            assert servers.model == "served"
        assert models.calls.last.request.headers["authorization"] == "Bearer sk-1"
        with pair_from_env_or_local(environ=env, model="given") as servers:
            assert servers.model == "given"
        assert models.call_count == 1


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (httpx.Response(200, json={"data": []}), "serves no model; set \\$PDCLIENT_MODEL"),
        (httpx.Response(401, json={"error": "no"}), "could not list the models of the decode server"),
        (httpx.ConnectError("refused"), "could not list the models .*ConnectError"),
    ],
)
def test_a_decode_server_that_names_no_model_is_a_config_error(answer: Any, message: str) -> None:
    env = {"PDCLIENT_PREFILL_BASE_URL": P1, "PDCLIENT_DECODE_BASE_URL": D1}
    with respx.mock() as router:
        router.get(f"{D1}/models").mock(side_effect=[answer])
        with pytest.raises(PDConfigError, match=message), pair_from_env_or_local(environ=env):
            pass


@pytest.mark.parametrize("only", ["PDCLIENT_PREFILL_BASE_URL", "PDCLIENT_DECODE_BASE_URL"])
def test_one_variable_without_the_other_names_both(only: str) -> None:
    with (
        pytest.raises(PDConfigError, match=r"PDCLIENT_PREFILL_BASE_URL.*PDCLIENT_DECODE_BASE_URL"),
        pair_from_env_or_local(environ={only: P1}),
    ):
        pass
    assert FakeLocalPD.made == []


def test_a_bad_url_in_the_environment_is_a_config_error() -> None:
    env = {"PDCLIENT_PREFILL_BASE_URL": "p1:8100", "PDCLIENT_DECODE_BASE_URL": D1, "PDCLIENT_MODEL": "m"}
    with (
        pytest.raises(PDConfigError, match=r"PDCLIENT_PREFILL_BASE_URL.*not an http"),
        pair_from_env_or_local(environ=env),
    ):
        pass


def test_without_servers_in_the_environment_a_local_pd_runs_for_the_block() -> None:
    env = {"PDCLIENT_PREFILL_BASE_URL": " ", "PDCLIENT_MODEL": "ignored"}  # blank counts as unset
    with pair_from_env_or_local(environ=env, decode_servers=2, cpus=(0, 1, 1)) as servers:
        (local,) = FakeLocalPD.made
        assert local.kwargs == {"decode_servers": 2, "cpus": (0, 1, 1)}
        assert local.running and servers.local is local
        assert servers.prefill_urls == ("http://127.0.0.1:20001/v1",)
        assert servers.decode_urls == ("http://127.0.0.1:20003/v1", "http://127.0.0.1:20005/v1")
        assert servers.model == "smollm2"
        with servers.client() as client:
            assert isinstance(client, PDChatClient)
            assert str(client.base_url).rstrip("/") == "http://127.0.0.1:20003/v1"
    assert not local.running


def test_os_environ_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLIENT_PREFILL_BASE_URL", P1)
    monkeypatch.setenv("PDCLIENT_DECODE_BASE_URL", D1)
    monkeypatch.setenv("PDCLIENT_MODEL", "m")
    with pair_from_env_or_local() as servers:
        assert servers.local is None and servers.prefill_urls == (P1,)
