"""serving/app.py's many-model form (unit): the front door routes by model, the model apps.

What flows through here: a `serving.models` spec -> its Serve config (front door `llm` with
args.mode "models" and the model table in its user_config; one `llm-model-<id>` application
per model) -> `build_app` / `build_model_app` graphs, compared with what Ray's own builders
make for the same model; and the front door's ingress, driven with fake model handles keyed by
application name, as Serve's `reconfigure` and HTTP calls would drive it. No Ray is started.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from serving.app import build_app, build_model_app
from serving.ingress.catalog import ModelCatalog
from serving.ingress.server import AuthenticatedIngress
from serving.spec import APP_NAME, MODEL_APP_PREFIX, ServingSpec
from tests.serving.engines.test_pd_server import _graph, no_ray  # noqa: F401  (a fixture)
from tests.serving.spec.test_models import AGG, GPU, PD  # llama P/D; qwen aggregated, with LoRA
from tests.serving.test_app import FakeHandle, error_of, make_request

KEY = "sk-unit-1"


def _spec(*entries) -> ServingSpec:
    return ServingSpec.model_validate({"models": list(entries or (PD, AGG))})


def _apps(spec: ServingSpec) -> dict[str, dict]:
    return {a["name"]: a for a in spec.serve_config(GPU)["applications"]}


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


# --- the applications -------------------------------------------------------------------------
def test_the_front_door_app_is_the_ingress_alone_in_models_mode(no_ray):  # noqa: F811
    front = _apps(_spec())[APP_NAME]
    graph = _graph(build_app(front["args"]))
    assert list(graph) == ["AuthenticatedIngress"]
    ingress = graph["AuthenticatedIngress"]
    assert ingress["kwargs"]["llm_deployments"] == {} and ingress["kwargs"]["model_cards"] == {}
    assert ingress["kwargs"]["models_mode"] is True
    # the deployment options the spec rendered, as in the one-model form
    rendered = front["args"]["ingress_deployment_config"]
    assert ingress["config"]["max_ongoing_requests"] == rendered["max_ongoing_requests"]
    assert ingress["actor"]["label_selector"] == rendered["ray_actor_options"]["label_selector"]


def test_a_pd_model_app_is_the_one_model_graph_without_its_ingress(no_ray):  # noqa: F811
    """The same engines (names, options, placement, init args) as the one-model form renders
    for that model: a model keeps its deployments when it joins a many-model stack."""
    many = _apps(_spec())[MODEL_APP_PREFIX + "llama"]
    ours = _graph(build_model_app(many["args"]))
    one = _graph(build_app(ServingSpec.model_validate(PD).app_args(GPU)))
    del one["AuthenticatedIngress"]
    assert ours.keys() == one.keys() and any(n.startswith("Decode:") for n in ours)
    for name in ours:
        for part in ("cls", "config", "actor", "placement"):
            assert ours[name][part] == one[name][part], (name, part)


def test_an_aggregated_model_app_is_rays_llm_server_with_its_lora_config(no_ray):  # noqa: F811
    from ray.serve.llm import LLMConfig, build_llm_deployment

    args = _apps(_spec())[MODEL_APP_PREFIX + "qwen"]["args"]
    ours = _graph(build_model_app(args))
    theirs = _graph(build_llm_deployment(LLMConfig.model_validate(args["llm_configs"][0])))
    assert ours.keys() == theirs.keys() and len(ours) == 1
    (name,) = ours
    assert ours[name]["config"] == theirs[name]["config"]
    lora = ours[name]["kwargs"]["llm_config"].lora_config
    assert lora.dynamic_lora_loading_path == "s3://acme-models/adapters/qwen"


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"model_id": "other"}, "its engines serve 'qwen'"),
        ({"mode": "hybrid"}, "is not 'disaggregated' or 'aggregated'"),
        ({"route": "/"}, "unknown keys in a model application's args: route"),
    ],
)
def test_a_model_app_refuses_args_that_do_not_describe_one_model(no_ray, change, fragment):  # noqa: F811
    args = {**_apps(_spec())[MODEL_APP_PREFIX + "qwen"]["args"], **change}
    with pytest.raises(ValueError, match=fragment):
        build_model_app(args)


def test_adding_a_model_changes_no_other_application():
    """What makes adding a model an in-place update that restarts no engine of the others:
    every existing application's config is byte-for-byte the same, and the front door's
    changes only in its user_config (Serve's lightweight update, `reconfigure`)."""
    third = {"model": {"id": "mistral", "source": "mistralai/Mistral-7B-Instruct-v0.3"}, "mode": "aggregated"}
    before, after = _apps(_spec(PD, AGG)), _apps(_spec(PD, AGG, third))
    assert set(after) - set(before) == {MODEL_APP_PREFIX + "mistral"}
    for name in before:
        if name != APP_NAME:
            assert after[name] == before[name], name
    front_b, front_a = before[APP_NAME], after[APP_NAME]
    assert {k: v for k, v in front_a.items() if k != "deployments"} == {
        k: v for k, v in front_b.items() if k != "deployments"
    }
    ids = [m["model_id"] for m in front_a["deployments"][0]["user_config"]["models"]]
    assert ids == ["llama", "qwen", "mistral"]


# --- the front door's ingress -----------------------------------------------------------------
class Apps:
    """Serve's applications as `serve.get_app_handle` sees them: a FakeHandle per app name."""

    def __init__(self, *names: str):
        self.handles = {n: FakeHandle() for n in names}
        self.lookups: list[str] = []

    def __call__(self, app_name: str):
        self.lookups.append(app_name)
        if app_name not in self.handles:
            from ray.serve.exceptions import RayServeException

            raise RayServeException(f"Application '{app_name}' does not exist.")
        return self.handles[app_name]


def _front_door(monkeypatch, apps: Apps, spec: ServingSpec | None = None):
    monkeypatch.setenv("TEST_PD_KEYS", KEY)
    ingress = AuthenticatedIngress({}, {}, api_keys_env="TEST_PD_KEYS", models_mode=True)
    ingress._door.models.catalog = ModelCatalog(apps)
    # The adapters' storage: one adapter per model with adapters.
    ingress._door.models._list = lambda path, base: [f"{base}:support-v2"]
    user_config = (spec or _spec()).serve_config(GPU)["applications"][0]["deployments"][0]["user_config"]
    asyncio.run(ingress.reconfigure(user_config))
    return ingress, user_config


def _served_model(handle: FakeHandle) -> list[str]:
    return [body.model for _, body, _ in handle.calls]


def test_each_model_is_served_by_its_own_application(monkeypatch):
    apps = Apps(MODEL_APP_PREFIX + "llama", MODEL_APP_PREFIX + "qwen")
    ingress, _ = _front_door(monkeypatch, apps)

    async def go():
        for model in ("llama", "qwen", "llama"):
            resp = await ingress.chat(make_request(chat(model)))
            assert resp.status_code == 200, resp.body
            assert json.loads(resp.body)["model"] == model

    asyncio.run(go())
    assert _served_model(apps.handles[MODEL_APP_PREFIX + "llama"]) == ["llama", "llama"]
    assert _served_model(apps.handles[MODEL_APP_PREFIX + "qwen"]) == ["qwen"]
    # one lookup per model, however many requests
    assert sorted(apps.lookups) == [MODEL_APP_PREFIX + "llama", MODEL_APP_PREFIX + "qwen"]


@pytest.mark.parametrize("model", ["gpt-9", "llama:an-adapter", "qwe"])
def test_an_unknown_model_or_an_adapter_of_a_model_without_lora_is_openais_404(monkeypatch, model):
    apps = Apps(MODEL_APP_PREFIX + "llama", MODEL_APP_PREFIX + "qwen")
    ingress, _ = _front_door(monkeypatch, apps)
    status, err = error_of(asyncio.run(ingress.chat(make_request(chat(model)))))
    assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert err["message"] == f"The model '{model}' does not exist or you do not have access to it."
    assert apps.lookups == [] and all(h.calls == [] for h in apps.handles.values())


def test_an_adapter_goes_to_its_base_models_app_multiplexed(monkeypatch):
    apps = Apps(MODEL_APP_PREFIX + "llama", MODEL_APP_PREFIX + "qwen")
    seen_options: list[dict] = []
    handle = apps.handles[MODEL_APP_PREFIX + "qwen"]
    handle.options = lambda **kw: (seen_options.append(kw), handle)[1]  # type: ignore[method-assign]
    ingress, _ = _front_door(monkeypatch, apps)
    resp = asyncio.run(ingress.chat(make_request(chat("qwen:support-v2"))))
    assert resp.status_code == 200, resp.body
    assert _served_model(handle) == ["qwen:support-v2"]
    assert {"stream": True, "multiplexed_model_id": "qwen:support-v2"} in seen_options


def test_a_model_whose_app_is_not_deployed_yet_is_a_503_then_serves(monkeypatch):
    apps = Apps(MODEL_APP_PREFIX + "llama")
    ingress, _ = _front_door(monkeypatch, apps)
    resp = asyncio.run(ingress.chat(make_request(chat("qwen"))))
    status, err = error_of(resp)
    assert err["message"] == "The model is not available yet; retry later."
    assert status == 503 and resp.headers["retry-after"] == "5"
    apps.handles[MODEL_APP_PREFIX + "qwen"] = FakeHandle()  # Serve finished deploying it
    assert asyncio.run(ingress.chat(make_request(chat("qwen")))).status_code == 200


def test_models_lists_every_model_and_adapter_with_its_context_length(monkeypatch):
    listed_paths: list[str] = []

    def lora_ids(dynamic_lora_loading_path: str, base_model_id: str) -> list[str]:
        listed_paths.append(dynamic_lora_loading_path)
        return [f"{base_model_id}:support-v2"]

    apps = Apps(MODEL_APP_PREFIX + "llama", MODEL_APP_PREFIX + "qwen")
    ingress, _ = _front_door(monkeypatch, apps)
    ingress._door.models._list = lora_ids
    listing = asyncio.run(ingress.models(make_request(path="/v1/models", method="GET")))
    ids = [m.id for m in listing.data]
    assert ids == ["llama", "qwen", "qwen:support-v2"]
    assert listed_paths == ["s3://acme-models/adapters/qwen"]
    assert listing.data[0].metadata["max_request_context_length"] == 8192
    # No card shows where the adapters are stored; the listing is read once, not per request.
    assert "s3://" not in json.dumps([m.model_dump() for m in listing.data])
    asyncio.run(ingress.models(make_request(path="/v1/models", method="GET")))
    assert listed_paths == ["s3://acme-models/adapters/qwen"]


def test_a_model_removed_from_the_table_is_404_and_the_others_keep_their_handles(monkeypatch):
    apps = Apps(MODEL_APP_PREFIX + "llama", MODEL_APP_PREFIX + "qwen")
    ingress, user_config = _front_door(monkeypatch, apps)
    for model in ("llama", "qwen"):
        assert asyncio.run(ingress.chat(make_request(chat(model)))).status_code == 200
    kept = ingress._default_serve_handles["llama"]
    asyncio.run(ingress.reconfigure({**user_config, "models": user_config["models"][:1]}))
    status, _ = error_of(asyncio.run(ingress.chat(make_request(chat("qwen")))))
    assert status == 404
    assert asyncio.run(ingress.chat(make_request(chat("llama")))).status_code == 200
    assert ingress._default_serve_handles["llama"] is kept
    assert apps.lookups.count(MODEL_APP_PREFIX + "llama") == 1


def test_the_catalog_looks_a_model_up_once_under_concurrent_requests_and_not_a_missing_app():
    calls: list[str] = []

    def lookup(app: str):
        calls.append(app)
        if app.endswith("missing"):
            raise LookupError(app)
        return object()

    catalog = ModelCatalog(lookup)
    catalog.update(
        [
            {"model_id": "a", "app_name": "llm-model-a", "mode": "aggregated"},
            {"model_id": "m", "app_name": "llm-model-missing", "mode": "aggregated"},
        ]
    )

    async def go():
        handles = await asyncio.gather(*(catalog.resolve("a") for _ in range(8)))
        assert len({id(h) for h in handles}) == 1
        for _ in range(2):
            with pytest.raises(LookupError):
                await catalog.resolve("m")

    asyncio.run(go())
    assert calls == ["llm-model-a", "llm-model-missing", "llm-model-missing"]
    # a moved application is looked up again
    catalog.update([{"model_id": "a", "app_name": "llm-model-a2", "mode": "aggregated"}])
    assert catalog.handle("a") is None


def test_the_catalog_refuses_a_repeated_or_malformed_row():
    with pytest.raises(ValueError, match=r"models\[1\]: model id 'a' is listed twice"):
        ModelCatalog().update([{"model_id": "a", "app_name": "x", "mode": "aggregated"}] * 2)
    with pytest.raises(ValueError, match=r"models\[0\]: not a model row"):
        ModelCatalog().update([{"model_id": "a"}])


# --- keys limited to some models --------------------------------------------------------------
OTHER_KEY = "sk-unit-limited"


def _limited_front_door(monkeypatch):
    from serving.spec import key_id

    spec = ServingSpec.model_validate(
        {"models": [PD, AGG], "limits": {"keys": {key_id(OTHER_KEY): {"models": ["llama"]}}}}
    )
    apps = Apps(MODEL_APP_PREFIX + "llama", MODEL_APP_PREFIX + "qwen")
    ingress, _ = _front_door(monkeypatch, apps, spec)
    monkeypatch.setattr(ingress._door.auth, "_keys", (KEY.encode(), OTHER_KEY.encode()))
    return ingress, apps


def test_a_limited_key_lists_and_reads_only_its_models(monkeypatch):
    ingress, _ = _limited_front_door(monkeypatch)
    ingress._door.models._list = lambda path, base: []  # no adapters in storage
    get = {"path": "/v1/models", "method": "GET"}
    assert [m.id for m in asyncio.run(ingress.models(make_request(key=OTHER_KEY, **get))).data] == ["llama"]
    assert [m.id for m in asyncio.run(ingress.models(make_request(key=KEY, **get))).data] == ["llama", "qwen"]
    status, err = error_of(asyncio.run(ingress.model_data("qwen", make_request(key=OTHER_KEY, **get))))
    assert status == 404 and err["message"] == "The model 'qwen' does not exist or you do not have access to it."
    assert asyncio.run(ingress.model_data("qwen", make_request(key=KEY, **get))).id == "qwen"


@pytest.mark.parametrize("model", ["qwen", "qwen:support-v2"])
def test_a_limited_key_gets_the_unknown_models_404_for_another_model_and_nothing_is_served(monkeypatch, model):
    ingress, apps = _limited_front_door(monkeypatch)
    denied = error_of(asyncio.run(ingress.chat(make_request(chat(model), key=OTHER_KEY))))
    unknown = error_of(asyncio.run(ingress.chat(make_request(chat("gpt-9"), key=OTHER_KEY))))
    assert denied[0] == unknown[0] == 404
    assert denied[1] == {**unknown[1], "message": unknown[1]["message"].replace("gpt-9", model)}
    assert apps.handles[MODEL_APP_PREFIX + "qwen"].calls == []
    assert asyncio.run(ingress.chat(make_request(chat("llama"), key=OTHER_KEY))).status_code == 200
    assert asyncio.run(ingress.chat(make_request(chat(model), key=KEY))).status_code == 200


def test_tokenize_of_another_model_is_404_for_a_limited_key(monkeypatch):
    ingress, _ = _limited_front_door(monkeypatch)
    body = {"model": "qwen", "prompt": "hello"}
    status, err = error_of(asyncio.run(ingress.tokenize(make_request(body, key=OTHER_KEY, path="/tokenize"))))
    assert status == 404 and err["code"] == "model_not_found"


def test_a_refusal_is_counted_under_the_model_that_was_asked(monkeypatch):
    """PDRequestsRefused is per model: the ingress's refusal counter carries the model id."""
    from ray.serve.exceptions import BackPressureError

    apps = Apps(MODEL_APP_PREFIX + "llama", MODEL_APP_PREFIX + "qwen")
    apps.handles[MODEL_APP_PREFIX + "qwen"] = FakeHandle(
        BackPressureError(num_queued_requests=9, max_queued_requests=8)
    )
    ingress, _ = _front_door(monkeypatch, apps)
    counted: list[dict] = []
    monkeypatch.setattr(ingress._door.router._refusals, "inc", lambda tags: counted.append(tags))
    assert asyncio.run(ingress.chat(make_request(chat("llama")))).status_code == 200
    assert asyncio.run(ingress.chat(make_request(chat("qwen")))).status_code == 503
    assert [c["model"] for c in counted] == ["qwen"] and counted[0]["reason"] == "overloaded"
