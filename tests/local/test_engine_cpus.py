"""local/engine_cpus.py: PD_ENGINE_CPUS binds each engine role's compute threads to its cores.

Contract (vLLM 0.32, `vllm/utils/ompmultiprocessing.py` OMPProcessManager and
`vllm/utils/cpu_resource_utils.py` parse_id_list): VLLM_CPU_OMP_THREADS_BIND is "auto",
"nobind", or per local rank a core list of ids and ranges joined by commas; each list is read
by vLLM's own parser below.
"""

from __future__ import annotations

import pytest
from vllm.utils.cpu_resource_utils import parse_id_list

from local import engine_cpus
from local.engine_cpus import EngineCpusError, cores, parse, pin


def test_roles_and_core_lists_as_vllm_reads_them():
    got = parse("prefill=0,decode=1,aggregated=0-1", cpu_count=lambda: 2)
    assert got == {"prefill": "0", "decode": "1", "aggregated": "0-1"}
    # A comma not followed by a role continues the list before it.
    wide = parse("aggregated=0,2-3, prefill = 1", cpu_count=lambda: 4)
    assert wide == {"aggregated": "0,2-3", "prefill": "1"}
    for text in (*got.values(), *wide.values()):
        assert cores(text) == parse_id_list(text)  # the same cores vLLM binds
    assert parse("", cpu_count=lambda: 2) == {} and parse(None) == {}


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ("0-1", "start with a role"),
        ("encode=0", "'encode' is not one of prefill, decode, aggregated"),
        ("prefill=0,prefill=1", "prefill is named twice"),
        ("decode=1-0", "decode's cores '1-0'"),
        ("decode=1,", "decode's cores '1,'"),
        ("decode=a", "decode's cores 'a'"),
        ("aggregated=0-2", "aggregated names core 2; this machine has cores 0-1"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable_and_the_part(raw, named):
    with pytest.raises(EngineCpusError) as err:
        parse(raw, cpu_count=lambda: 2)
    msg = str(err.value)
    assert msg.startswith(f"{engine_cpus.ENGINE_CPUS_ENV}={raw!r}: ") and named in msg and "\n" not in msg


def test_each_engine_config_gets_its_roles_cores_in_its_runtime_env():
    config = {
        "applications": [
            {"args": {"prefill_config": {"runtime_env": {"env_vars": {"X": "1"}}}, "decode_config": {}}},
            {"args": {"llm_configs": [{"runtime_env": {"env_vars": {}}}]}},
        ]
    }
    out = pin(config, {"prefill": "0", "aggregated": "0-1"})
    pd, agg = (a["args"] for a in out["applications"])
    assert pd["prefill_config"]["runtime_env"]["env_vars"] == {"X": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert "runtime_env" not in pd["decode_config"]  # not named: the local default stays
    assert agg["llm_configs"][0]["runtime_env"]["env_vars"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert config["applications"][0]["args"]["prefill_config"]["runtime_env"]["env_vars"] == {"X": "1"}  # a copy


def test_make_serve_takes_it_from_the_environment_or_the_flag_and_refuses_a_bad_one(capsys):
    from local.__main__ import parse_args

    env = {engine_cpus.ENGINE_CPUS_ENV: "prefill=0,decode=1"}
    assert parse_args([], environ=env).engine_cpus == {"prefill": "0", "decode": "1"}
    assert parse_args(["--engine-cpus", "aggregated=0"], environ=env).engine_cpus == {"aggregated": "0"}
    assert parse_args([], environ={}).engine_cpus == {}
    with pytest.raises(SystemExit):
        parse_args([], environ={engine_cpus.ENGINE_CPUS_ENV: "gpu=0"})
    assert "'gpu' is not one of prefill, decode, aggregated" in capsys.readouterr().err
