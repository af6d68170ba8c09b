"""/v1/models from the store's catalog, adapters loaded and unloaded at run time, and /metrics."""

import openai
import pytest

from tests.adapter_store.conftest import ADMIN_TOKEN
from tests.e2e.conftest import until

from .conftest import ADAPTERS, MESSAGES
from .test_errors import error_of, get, post


def test_models_are_the_base_and_every_adapter_in_the_catalog(client, base_name, registered, sources_root):
    models = client.models.list().data
    assert [m.id for m in models] == [base_name, *sorted(ADAPTERS)]
    base, *adapters = models
    assert (base.object, base.owned_by, base.parent) == ("model", "loramux", None)
    for model in adapters:
        assert model.parent == base_name and model.root == f"file://{sources_root / model.id}"
        assert model.created == int(registered[model.id].created.timestamp())
    assert client.models.retrieve("qv4").id == "qv4"
    assert client.models.retrieve(base_name).id == base_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-adapter")


def load(gateway, name: str, path: str, token: str = ADMIN_TOKEN):
    return post(
        gateway, "/v1/load_lora_adapter", f'{{"lora_name": "{name}", "lora_path": "{path}"}}'.encode(), token
    )


def unload(gateway, name: str, token: str = ADMIN_TOKEN):
    return post(gateway, "/v1/unload_lora_adapter", f'{{"lora_name": "{name}"}}'.encode(), token)


def test_an_adapter_loaded_at_run_time_is_listed_served_and_gone_once_unloaded(client, gateway, sources_root):
    reply = load(gateway, "re2", str(sources_root / "re2"))  # a plain path, as vLLM takes it
    assert reply.status_code == 200, reply.body
    assert "re2" in [m.id for m in client.models.list().data]
    chat = client.chat.completions.create(model="re2", messages=MESSAGES, max_tokens=3, temperature=0)
    assert chat.usage.completion_tokens == 3

    assert load(gateway, "re2", f"file://{sources_root / 're2'}").status_code == 400  # the name is taken
    assert unload(gateway, "re2").status_code == 200
    assert "re2" not in [m.id for m in client.models.list().data]

    def refused() -> bool:  # the worker hears of the delete on its watch stream
        try:
            client.chat.completions.create(model="re2", messages=MESSAGES, max_tokens=1)
        except openai.NotFoundError as e:
            return e.response.json()["error"]["message"] == "The model `re2` does not exist."
        return False

    until(refused)
    assert unload(gateway, "re2").status_code == 404


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b'{"lora_name": "x2"}', 400, "lora_path"),
        (b'{"lora_path": "/x"}', 400, "lora_name"),
        (b'{"lora_name": "x2", "lora_path": "relative/dir"}', 400, "absolute path"),
        (b'{"lora_name": "all8", "lora_path": "/x"}', 400, "already been loaded"),
        (b'{"lora_name": "bad name!", "lora_path": "/x"}', 400, "invalid"),
    ],
)
def test_load_refusals_name_the_field(gateway, body, status, says):
    reply = post(gateway, "/v1/load_lora_adapter", body, ADMIN_TOKEN)
    assert reply.status_code == status and says in reply.json()["error"]["message"], reply.body


def test_load_from_a_missing_or_forbidden_path(gateway, sources_root, tmp_path):
    missing = load(gateway, "x3", f"file://{sources_root / 'no-such-dir'}")
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]
    forbidden = load(gateway, "x3", f"file://{tmp_path}")  # outside the store's allowed root
    assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"


def test_metrics_count_requests_by_route_model_and_status(client, gateway):
    client.chat.completions.create(model="all8", messages=MESSAGES, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="unknown-7", messages=MESSAGES, max_tokens=1)
    with pytest.raises(openai.NotFoundError) as raised:
        client.post("/no/such/route", body={}, cast_to=object)
    assert error_of(raised)["message"] == "Not Found"
    text = get(f"{gateway.url}/metrics").body.decode()
    assert (
        'loramux_gateway_http_requests_total{model="all8",route="/v1/chat/completions",status="200"}' in text
    )
    assert 'loramux_gateway_http_requests_total{model="",route="/v1/chat/completions",status="404"}' in text
    assert 'route="<unmatched>",status="404"' in text
    assert "unknown-7" not in text  # names nobody registered do not become series
    assert "loramux_gateway_time_to_first_token_seconds_count" in text
