"""GCS fault tolerance over TLS: Ray verifies the Redis server against a CA it is told about.

Contracts:
- ray-project/ray 2.60.0 `src/ray/common/ray_config_def.h` (REDIS_CA_CERT, env
  RAY_REDIS_CA_CERT, default "") and `src/ray/gcs/store_client/redis_context.cc`: the C++ Redis
  client hands hiredis (1.2.0, BoringSSL) a NULL CA file when the variable is unset, so no
  certificate verifies: ray#41161 (ElastiCache over TLS, CERTIFICATE_VERIFY_FAILED), fixed by
  the maintainers with RAY_REDIS_CA_CERT=/etc/ssl/certs/ca-certificates.crt. (The installed
  Ray 2.60 reads the variable: `ray._raylet.Config.REDIS_CA_CERT()`.)
- ray-project/kuberay v1.7.0 `ray-operator/controllers/ray/raycluster_controller.go`
  `buildRedisCleanupJob`: the Redis cleanup Job runs the head pod's Ray container (env
  included) and connects with `use_ssl` for a `rediss://` address.
Reproduced in tests.upstream.ray_redis_ca_file and redis_cleanup_job_env.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

from infra.k8s.ray_env import REDIS_CA_CERT_ENV, SYSTEM_CA_BUNDLE, gcs_uses_tls
from tests.conftest import STACKS
from tests.upstream import ray_redis_ca_file, redis_cleanup_job_env


def _rayservice(stack) -> dict:
    return next(o for o in stack.manifests().values() if o.get("kind") == "RayService")


def _head_env(rs: dict) -> list[dict]:
    return rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].get("env") or []


def _tls_stacks(rendered_stacks) -> list[str]:
    out = []
    for name in STACKS:
        gcs = _rayservice(rendered_stacks[name])["spec"]["rayClusterConfig"].get("gcsFaultToleranceOptions") or {}
        if str(gcs.get("redisAddress", "")).startswith("rediss://"):
            out.append(name)
    return out


def test_a_shipped_stack_uses_gcs_over_tls(rendered_stacks):
    assert "deepseek-p5" in _tls_stacks(rendered_stacks), "the case the other tests guard"


@pytest.mark.parametrize("name", STACKS)
def test_the_head_and_the_cleanup_job_trust_the_system_bundle_over_tls(rendered_stacks, name):
    rs = _rayservice(rendered_stacks[name])
    if name not in _tls_stacks(rendered_stacks):
        # No TLS: nothing to verify, and nothing set (a stray CA would change no behaviour).
        assert ray_redis_ca_file(_head_env(rs)) is None
        return
    assert ray_redis_ca_file(_head_env(rs)) == "/etc/ssl/certs/ca-certificates.crt"
    assert ray_redis_ca_file(redis_cleanup_job_env(rs)) == "/etc/ssl/certs/ca-certificates.crt"
    # Workers talk to the GCS, not to Redis: only the head (and the Job built from it) needs it.
    for group in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert ray_redis_ca_file(group["template"]["spec"]["containers"][0].get("env") or []) is None


def test_without_it_ray_has_no_trust_anchor(rendered_stacks):
    """The rule bites: yesterday's head (no RAY_REDIS_CA_CERT) gives hiredis a NULL CA."""
    rs = copy.deepcopy(_rayservice(rendered_stacks["deepseek-p5"]))
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["env"] = [e for e in head["env"] if e["name"] != REDIS_CA_CERT_ENV]
    assert ray_redis_ca_file(_head_env(rs)) is None
    assert ray_redis_ca_file(redis_cleanup_job_env(rs)) is None


@pytest.mark.parametrize(
    ("address", "tls"),
    [
        ("rediss://master.x.use1.cache.amazonaws.com:6379", True),
        ("redis://redis.internal:6379", False),
        ("redis.internal:6379", False),
        (None, False),
    ],
)
def test_tls_is_the_rediss_form(address, tls):
    # Ray speaks TLS to Redis only for rediss:// (ray/_private/services.py); so does KubeRay's Job.
    assert gcs_uses_tls(address) is tls


def test_installed_ray_reads_the_variable():
    """Sanity check of the mirror against the installed Ray (skipped where Ray is absent). Ray
    reads its config once per process, so a fresh interpreter does the reading."""
    pytest.importorskip("ray")
    code = "from ray._raylet import Config; print(Config.REDIS_CA_CERT().decode())"
    env = {**os.environ, REDIS_CA_CERT_ENV: SYSTEM_CA_BUNDLE}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == SYSTEM_CA_BUNDLE
