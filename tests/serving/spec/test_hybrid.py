"""serving/spec/serving.py, hybrid routing: the `fallback` and `limits` sections and what they render."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from serving.spec import (
    FALLBACK_API_KEY_ENV,
    INGRESS_DEPLOYMENT,
    FallbackSpec,
    ServingSpec,
    Target,
    key_id,
)

MODEL = {"id": "llama-8b", "source": "meta-llama/Llama-3.1-8B-Instruct"}


def spec(**over) -> ServingSpec:
    return ServingSpec.model_validate({"model": MODEL, **over})


def test_no_fallback_and_no_limits_by_default():
    uc = spec().ingress_user_config()
    assert uc["fallback"] is None
    assert (uc["limits"]["requests_per_minute"], uc["limits"]["tokens_per_minute"], uc["limits"]["keys"]) == (0, 0, {})


def test_fallback_renders_into_the_ingress_user_config_not_the_args():
    s = spec(
        fallback={"baseUrl": "https://api.example.com/v1/", "model": "meta/llama-3.1-8b", "when": ["unavailable"]},
        decode={"maxOngoingRequests": 32},
        limits={"requestsPerMinute": 60, "keys": {key_id("sk-a"): {"tokensPerMinute": 1000}}},
    )
    cfg = s.serve_config(Target(accelerator_type="H100"))
    (app,) = cfg["applications"]
    assert "fallback" not in repr(app["args"]) and "limits" not in app["args"]
    assert app["deployments"] == [{"name": INGRESS_DEPLOYMENT, "user_config": s.ingress_user_config()}]
    fb = s.ingress_user_config()["fallback"]
    assert fb["base_url"] == "https://api.example.com/v1"  # trailing slash dropped
    assert fb["models"] == {"llama-8b": "meta/llama-3.1-8b"}
    assert fb["when"] == ["unavailable"]
    assert fb["overflow_at"] == 32  # default: decode's maxOngoingRequests
    assert fb["api_key_env"] == FALLBACK_API_KEY_ENV
    # The relay batches as the engines do: the one streaming interval of the spec.
    assert fb["batch_interval_ms"] == s.streaming.batch_interval_ms == 50
    limits = s.ingress_user_config()["limits"]
    assert limits["requests_per_minute"] == 60
    assert limits["keys"] == {key_id("sk-a"): {"requests_per_minute": 0, "tokens_per_minute": 1000}}
    assert limits["label_selector"] == {"pd-inference/node-group": "head"}


def test_the_rendered_config_passes_ray_serves_schema():
    from ray.serve.schema import ServeDeploySchema

    s = spec(fallback={"baseUrl": "https://api.example.com/v1", "model": "x"})
    ServeDeploySchema.model_validate(s.serve_config(Target(accelerator_type="H100")))


def test_the_user_config_names_the_ingress_ray_builds():
    """Serve refuses an override for a deployment the app does not have; Ray's builders name
    the ingress deployment after its class (ray/llm/_internal/serve/core/ingress/builder.py)."""
    from serving.app import AuthenticatedIngress

    assert AuthenticatedIngress.__name__ == INGRESS_DEPLOYMENT


@pytest.mark.parametrize(
    "url,fragment",
    [
        ("ftp://x/v1", "not an http(s) URL"),
        ("https://user:pw@x/v1", "credentials"),
        ("https://x/v1?key=1", "query"),
        ("api.example.com/v1", "not an http(s) URL"),
    ],
)
def test_bad_base_urls(url, fragment):
    with pytest.raises(ValidationError, match=re.escape(fragment)):
        FallbackSpec.model_validate({"baseUrl": url, "model": "m"})


def test_model_map_must_cover_the_served_model():
    with pytest.raises(ValidationError, match=re.escape("maps no external model to serving.model.id 'llama-8b'")):
        spec(fallback={"baseUrl": "https://x/v1", "model": {"other": "m"}})
    s = spec(fallback={"baseUrl": "https://x/v1", "model": {"llama-8b": "m", "other": "n"}})
    assert s.ingress_user_config()["fallback"]["models"] == {"llama-8b": "m", "other": "n"}


@pytest.mark.parametrize(
    "over,fragment",
    [
        ({"when": []}, "at least one"),
        ({"when": ["deadline", "deadline"]}, "twice"),
        ({"when": ["sometimes"]}, "unavailable"),
        ({"overflowAt": 0}, "greater than or equal to 1"),
        ({"retries": 9}, "less than or equal to 5"),
        ({"model": " "}, "must not be empty"),
        ({"apiKey": "sk-x"}, "Extra inputs are not permitted"),
    ],
)
def test_bad_fallback_fields(over, fragment):
    with pytest.raises(ValidationError, match=fragment):
        FallbackSpec.model_validate({"baseUrl": "https://x/v1", "model": "m", **over})


def test_limits_keys_must_be_key_ids_never_keys():
    with pytest.raises(ValidationError, match="never put an API key itself"):
        spec(limits={"keys": {"sk-live-123": {"requestsPerMinute": 1}}})
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        spec(limits={"requestsPerMinute": -1})


def test_plain_http_host_and_port():
    fb = FallbackSpec.model_validate({"baseUrl": "http://10.0.0.5:8080/v1", "model": "m"})
    assert fb.plain_http and (fb.host, fb.port) == ("10.0.0.5", 8080)
    fb = FallbackSpec.model_validate({"baseUrl": "https://api.example.com/v1", "model": "m"})
    assert not fb.plain_http and (fb.host, fb.port) == ("api.example.com", 443)


# --- per-key model access and per-model limits -----------------------------------------
KID = "k-0123456789ab"
LLAMA = {"model": {"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct"}}
QWEN = {
    "model": {"id": "qwen", "source": "Qwen/Qwen2.5-7B-Instruct"},
    "mode": "aggregated",
    "pools": {"decode": "general"},
    "lora": {"adaptersPath": "s3://acme-models/adapters/qwen"},
}


def many(limits) -> ServingSpec:
    return ServingSpec.model_validate({"models": [LLAMA, QWEN], "limits": limits})


def error(data) -> str:
    with pytest.raises(ValidationError) as e:
        ServingSpec.model_validate(data)
    return str(e.value.errors()[0]["msg"]).removeprefix("Value error, ")


def test_key_models_and_model_limits_render_into_the_ingress_user_config():
    s = many(
        {
            "requestsPerMinute": 100,
            "keys": {
                KID: {"models": ["qwen"]},
                "k-00000000000b": {"requestsPerMinute": 5, "models": ["llama", "qwen"]},
                "k-00000000000c": {"tokensPerMinute": 100},
            },
            "models": {"llama": {"requestsPerMinute": 2, "tokensPerMinute": 50}},
        }
    )
    limits = s.ingress_user_config()["limits"]
    # A key that only lists models renders no limits of its own: it keeps everyone's.
    assert limits["keys"] == {
        KID: {"models": ["qwen"]},
        "k-00000000000b": {"requests_per_minute": 5, "tokens_per_minute": 0, "models": ["llama", "qwen"]},
        "k-00000000000c": {"requests_per_minute": 0, "tokens_per_minute": 100},
    }
    assert limits["models"] == {"llama": {"requests_per_minute": 2, "tokens_per_minute": 50}}
    assert (limits["requests_per_minute"], limits["tokens_per_minute"]) == (100, 0)
    # The per-model specs of the many-model form keep the shared limits as they are.
    assert all(m.limits == s.limits for m in s.served)


def test_the_one_model_form_names_its_one_model():
    s = spec(limits={"keys": {KID: {"models": ["llama-8b"]}}, "models": {"llama-8b": {"requestsPerMinute": 3}}})
    limits = s.ingress_user_config()["limits"]
    assert limits["keys"] == {KID: {"models": ["llama-8b"]}}
    assert limits["models"] == {"llama-8b": {"requests_per_minute": 3, "tokens_per_minute": 0}}
    msg = error({"model": MODEL, "limits": {"keys": {KID: {"models": ["qwen"]}}}})
    assert msg.startswith(f"@serving.limits.keys.{KID}.models[0]@ ")
    assert "'qwen' is not the id of a served model (ids: llama-8b)" in msg


@pytest.mark.parametrize(
    "limits,where,fragment",
    [
        (
            {"keys": {KID: {"models": ["llama", "foo"]}}},
            f"serving.limits.keys.{KID}.models[1]",
            "'foo' is not the id of a served model (ids: llama, qwen)",
        ),
        ({"models": {"foo": {"requestsPerMinute": 1}}}, "serving.limits.models.foo", "'foo' is not the id"),
        (
            {"keys": {KID: {"models": ["qwen:tenant-a"]}}},
            f"serving.limits.keys.{KID}.models[0]",
            "an adapter is allowed with its base model: list 'qwen'",
        ),
        ({"models": {"qwen:tenant-a": {}}}, "serving.limits.models.qwen:tenant-a", "list 'qwen'"),
    ],
)
def test_a_model_id_the_limits_name_must_be_served(limits, where, fragment):
    msg = error({"models": [LLAMA, QWEN], "limits": limits})
    assert msg.startswith(f"@{where}@ ") and fragment in msg


@pytest.mark.parametrize(
    "entry,fragment",
    [
        ({"models": []}, "list at least one model id"),
        ({"models": ["qwen", "qwen"]}, "'qwen' is listed twice"),
        ({"requestsPerMinute": -1}, "greater than or equal to 0"),
    ],
)
def test_bad_key_entries_name_the_key(entry, fragment):
    with pytest.raises(ValidationError) as e:
        many({"keys": {KID: entry}})
    err = e.value.errors()[0]
    assert err["loc"][:3] == ("limits", "keys", KID) and fragment in err["msg"]


# --- budgets, prices and prefix-cache isolation ---------------------------------------------------
FALLBACK = {"baseUrl": "https://api.example.com/v1", "model": "meta/llama-3.1-8b"}


def test_budgets_cache_groups_isolation_and_provider_prices_render_into_the_ingress_user_config():
    s = spec(
        fallback={**FALLBACK, "prices": {"llama-8b": {"promptPerMillion": 0.2, "completionPerMillion": 0.6}}},
        limits={
            "cacheIsolation": "key",
            "keys": {
                KID: {"budget": {"usd": 25, "period": "day", "whenExceeded": "fallback"}, "cacheGroup": "team-a"},
                "k-00000000000b": {"budget": {"usd": 100}},
            },
        },
    )
    uc = s.ingress_user_config()
    keys = uc["limits"]["keys"]
    assert keys[KID] == {"budget": {"usd": 25, "period": "day", "when_exceeded": "fallback"}, "cache_group": "team-a"}
    # A budget's defaults: a month, refused past it.
    assert keys["k-00000000000b"] == {"budget": {"usd": 100, "period": "month", "when_exceeded": "refuse"}}
    assert uc["limits"]["cache_isolation"] == "key"
    # Per million tokens in the stack, per token for the ingress; the cached prompt price is
    # the prompt price unless given.
    price = uc["fallback"]["prices"]["llama-8b"]
    assert price == pytest.approx({"prompt": 0.2e-6, "completion": 0.6e-6, "cached_prompt": 0.2e-6})
    assert spec().ingress_user_config()["limits"]["cache_isolation"] == "key"  # isolation by default


def test_a_targets_token_prices_become_the_clusters_costs_per_model():
    def costs(target):
        cfg = spec().serve_config(target)
        deployments = cfg["applications"][0]["deployments"]
        return next(d["user_config"] for d in deployments if d["name"] == INGRESS_DEPLOYMENT)["costs"]

    priced = costs(Target(accelerator_type="H100", token_prices={"prefill": 1e-7, "decode": 2e-6}))
    assert priced == {"llama-8b": {"prefill_usd_per_token": 1e-7, "decode_usd_per_token": 2e-6, "disaggregated": True}}
    assert costs(Target(accelerator_type="H100")) == {}  # unpriced: counted in tokens only


@pytest.mark.parametrize(
    "over,where,fragment",
    [
        (
            {"limits": {"keys": {KID: {"budget": {"usd": 5, "whenExceeded": "fallback"}}}}},
            f"serving.limits.keys.{KID}.budget.whenExceeded",
            "'fallback' needs serving.fallback",
        ),
        (
            {"limits": {"keys": {KID: {"budget": {"usd": 5, "whenExceeded": "tiny"}}}}},
            f"serving.limits.keys.{KID}.budget.whenExceeded",
            "'tiny' is not the id of a served model",
        ),
        (
            {"fallback": {**FALLBACK, "prices": {"other": {"promptPerMillion": 1, "completionPerMillion": 1}}}},
            "serving.fallback.prices.other",
            "'other' is not a model the fallback serves",
        ),
    ],
)
def test_a_budget_or_price_that_cannot_apply_is_one_error_naming_its_key(over, where, fragment):
    msg = error({"model": MODEL, **over})
    assert msg.startswith(f"@{where}@ ") and fragment in msg


@pytest.mark.parametrize(
    "entry",
    [
        {"budget": {"usd": 0}},
        {"budget": {"usd": 5, "period": "week"}},
        {"cacheGroup": "Team A"},
    ],
)
def test_a_budget_or_cache_group_out_of_range_is_refused(entry):
    with pytest.raises(ValidationError):
        spec(limits={"keys": {KID: entry}})
