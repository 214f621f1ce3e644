"""The local S3 of `make serve PD_MODELS=2`: Ray Serve LLM's own S3 code sees the adapter there.

What flows through here: the tiny model's adapter (local/tiny_lora.py) -> moto's server
(local/s3.py) -> with the environment it returns, Ray Serve LLM 2.60's own listing
(ray/llm/_internal/common/utils/lora_utils.py `get_lora_model_ids`, through
`CloudFileSystem.list_subfolders`) and its replica-side loader
(ray/llm/_internal/serve/utils/lora_serve_utils.py `LoraModelLoader.load_model_from_config`,
which reads adapter_config.json and downloads the folder with boto3). No Ray cluster starts:
these functions run in the test's process, as they do inside a replica.
"""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

import pytest

from local import s3, tiny_lora
from serving.spec.models import LoraSpec

MODEL_ID = "tiny-llama-lora"  # any base model id: Ray prefixes the folder names with it


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return tiny_lora.ensure_tiny_lora(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def store(adapter, tmp_path_factory):
    """(env, adapters_path) of a running local S3, with that env applied over a hostile one: a
    developer's shell that ignores configured endpoints and points every AWS client elsewhere."""
    aws = tmp_path_factory.mktemp("aws")
    with s3.local_adapters({tiny_lora.ADAPTER_NAME: adapter}) as (env, path), pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
        mp.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing answers there
        mp.setenv("AWS_CONFIG_FILE", str(aws / "config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(aws / "credentials"))
        mp.delenv("AWS_PROFILE", raising=False)
        for key, value in env.items():
            mp.setenv(key, value)
        yield env, path


def test_the_adapters_path_is_one_the_spec_accepts(store):
    _, path = store
    spec = LoraSpec(adapters_path=path)
    assert (spec.adapters_path, spec.bucket, spec.prefix) == (path, s3.BUCKET, s3.PREFIX)


def test_ray_lists_exactly_the_model_colon_adapter(store):
    from ray.llm._internal.common.utils.cloud_utils import CloudFileSystem
    from ray.llm._internal.common.utils.lora_utils import get_lora_model_ids

    _, path = store
    assert CloudFileSystem.list_subfolders(path) == [tiny_lora.ADAPTER_NAME]
    assert get_lora_model_ids(path, MODEL_ID) == [f"{MODEL_ID}:{tiny_lora.ADAPTER_NAME}"]


def test_rays_lora_loader_downloads_the_adapter_byte_for_byte(store, adapter, tmp_path):
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.llm._internal.serve.utils.lora_serve_utils import LoraModelLoader

    _, path = store
    config = LLMConfig(
        model_loading_config={"model_id": MODEL_ID}, lora_config=LoraSpec(adapters_path=path).llm_config()
    )
    loader = LoraModelLoader(lora_root=str(tmp_path / "lora-cache"))
    model = f"{MODEL_ID}:{tiny_lora.ADAPTER_NAME}"
    disk = asyncio.run(loader.load_model_from_config(model, config))
    local = {f.name: f.read_bytes() for f in adapter.iterdir()}
    downloaded = {f.name: f.read_bytes() for f in tmp_path.joinpath("lora-cache", tiny_lora.ADAPTER_NAME).iterdir()}
    assert disk.local_path == str(tmp_path / "lora-cache" / tiny_lora.ADAPTER_NAME)
    assert downloaded == local
    assert disk.max_total_tokens is None  # the adapter sets no max_length: the model's limit holds


def test_the_env_names_only_the_s3_endpoint_on_the_loopback(store):
    env, _ = store
    url = urlsplit(env["AWS_ENDPOINT_URL_S3"])
    assert (url.scheme, url.hostname) == ("http", s3.HOST)
    assert "AWS_ENDPOINT_URL" not in env  # other AWS clients (and the Run:ai streamer) keep theirs


def test_names_ray_would_split_or_folders_without_a_config_are_refused(adapter, tmp_path):
    store = s3.LocalS3()
    store.start()
    try:
        with pytest.raises(ValueError, match="not an adapter name"):
            store.put_adapters({"a:b": adapter}, prefix="refused")
        (tmp_path / "adapter_model.safetensors").write_bytes(b"")
        with pytest.raises(ValueError, match=r"no adapter_config\.json"):
            store.put_adapters({"empty": tmp_path}, prefix="refused")
    finally:
        store.stop()


def test_leaving_the_block_closes_the_port(adapter):
    with s3.local_adapters({tiny_lora.ADAPTER_NAME: adapter}, prefix="closing") as (env, _):
        url = urlsplit(env["AWS_ENDPOINT_URL_S3"])
        socket.create_connection((url.hostname, url.port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((url.hostname, url.port), timeout=5)
