"""``pdclient serve`` finds a stored response's decode endpoint from its id (two decode endpoints)."""

from __future__ import annotations

import httpx
import openai

from pdclient.dialects import endpoint_tag
from tests.fake_vllm import DECODE, DECODE2, PREFILL
from tests.mocked.test_stored_state import StoringDecodes
from tests.serve.conftest import config_for, running_proxy


def _legs(fake: StoringDecodes) -> httpx.MockTransport:
    """The servers behind the proxy, as its leg transport reaches them."""

    def route(request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        if url.startswith(PREFILL):
            return fake.prefill(request)
        base = DECODE2 if url.startswith(DECODE2) else DECODE
        return (fake.create if url == f"{base}/responses" else fake.retrieve)(base)(request)

    return httpx.MockTransport(route)


def test_serve_routes_a_follow_up_and_a_retrieve_to_the_endpoint_that_stored_it() -> None:
    fake = StoringDecodes()
    config = config_for(PREFILL, [DECODE, DECODE2])
    with running_proxy(config, leg_transport=_legs(fake)) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="-", max_retries=0)
        for n in range(6):
            first = client.responses.create(model="m", input=f"hi {n}")
            stored_at = fake.bodies[-1][0]
            own = first.id.removesuffix(f".pd{endpoint_tag(stored_at)}")
            assert own != first.id and own in fake.stored[stored_at]
            follow_up = client.responses.create(model="m", input="and?", previous_response_id=first.id)
            assert fake.bodies[-1] == (stored_at, fake.bodies[-1][1])
            assert fake.bodies[-1][1]["previous_response_id"] == own
            assert follow_up.previous_response_id == first.id
            assert client.responses.retrieve(first.id).id == first.id
            assert fake.paths[-1] == (stored_at, f"/v1/responses/{own}")
        for n in range(10):  # ids each endpoint stored, whichever the routing would pick
            base = (DECODE, DECODE2)[n % 2]
            fake.stored[base].add(f"resp_seeded{n}")
            tagged = f"resp_seeded{n}.pd{endpoint_tag(base)}"
            follow_up = client.responses.create(model="m", input="and?", previous_response_id=tagged)
            assert fake.bodies[-1][0] == base and follow_up.previous_response_id == tagged
