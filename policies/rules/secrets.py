"""Credentials: they reach pods only by Secret reference, and only a Secret holds secret data.

What flows through here: every pod template's env, the RayService's serveConfigV2 runtime_env,
KubeRay's GCS Redis password, any Kubernetes object's stringData and ConfigMaps' keys -> each
name that looks like a credential (`secret_like`) with a literal value -> `secrets-by-reference`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from .inputs import K8S_CONFIGMAP, K8S_SECRET, RAY_TYPES, Context, as_list, dig
from .manifests import containers, mappings, pod_specs, ray_clusters, serve_doc

# Env var names that carry credentials: any "_"-separated word of the name.
SECRET_WORDS = {"TOKEN", "TOKENS", "KEY", "KEYS", "PASSWORD", "PASSWD", "SECRET", "SECRETS", "CREDENTIALS"}
SECRET_ENV_NAMES = {"PD_API_KEYS"}


def secret_like(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    upper = name.upper()
    return upper in SECRET_ENV_NAMES or bool(SECRET_WORDS & set(re.split(r"[^A-Z0-9]+", upper)))


def _serve_config_env(serve_config: Any) -> Iterator[tuple[str, str]]:
    """(path, env var name) of literal env vars in a serveConfigV2 document's runtime_env."""
    for path, node in mappings(serve_doc(serve_config)):
        env = node.get("env_vars")
        if isinstance(env, Mapping):
            for name in env:
                yield f"{path}.env_vars", str(name)


def check_secrets_by_reference(type_: str, props: dict[str, Any], ctx: Context) -> Iterator[str]:
    fix = "put the value in a Kubernetes Secret (fed from a Pulumi secret) and use valueFrom.secretKeyRef"
    for where, _, pod in pod_specs(type_, props):
        for c in containers(pod):
            for e in as_list(c.get("env")):
                if isinstance(e, Mapping) and secret_like(e.get("name")) and "value" in e:
                    yield f"{where} container {c.get('name')!r} sets {e.get('name')} as a literal value: {fix}"
    if type_ in RAY_TYPES:
        for where, name in _serve_config_env(dig(props, "spec", "serveConfigV2")):
            if secret_like(name):
                yield f"{where} sets {name} as a literal runtime_env variable: {fix} on the pods instead"
        for prefix, cluster in ray_clusters(type_, props.get("spec")):
            password = dig(cluster, "gcsFaultToleranceOptions", "redisPassword")
            if isinstance(password, Mapping) and "value" in password:
                yield (
                    f"{prefix}.gcsFaultToleranceOptions.redisPassword is a literal value: use "
                    "redisPassword.valueFrom.secretKeyRef (the stack's gcsRedisPassword secret)"
                )
    if type_.startswith("kubernetes:") and type_ != K8S_SECRET and "stringData" in props:
        yield f"stringData on a {type_.rsplit(':', 1)[-1]}: only a Secret (kubernetes:core/v1:Secret) may hold secret data"
    if type_ == K8S_CONFIGMAP:
        for field in ("data", "binaryData"):
            data = props.get(field)
            for k in data if isinstance(data, Mapping) else ():
                if secret_like(k):
                    yield f"ConfigMap {field} key {k!r} looks like a credential: {fix}"
