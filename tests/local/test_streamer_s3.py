"""The Run:ai model streamer loads the tiny model from a local S3-compatible server.

What flows through here: the tiny model the project builds itself (local/tiny_model.py,
the copy `make serve` caches) is uploaded to moto's S3 server mode on a free loopback port;
vLLM 0.32's own `runai_streamer` code path then reads it back from `s3://<bucket>/<prefix>`
with the loading settings our spec renders (serving/spec/scaling.py `LoadingSpec`): the
engine config pulls config and tokenizer files through `ObjectStorageModel`
(vllm/config/model.py `maybe_pull_model_tokenizer_for_runai`), and the loader
(vllm/model_executor/model_loader/runai_streamer_loader.py) lists the safetensors files and
streams every tensor through the streamer's native S3 client (runai-model-streamer[s3],
pinned in infra/versions.py) with ranged GETs. Nothing is mocked inside vLLM or the
streamer: only the object store is local.

S3-compatible endpoint settings (run-ai/runai-model-streamer docs/src/usage.md, "Streaming
from S3 compatible storage", and docs/src/env-vars.md): `AWS_ENDPOINT_URL` (mandatory),
`RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0` (path-style addressing), and
`AWS_EC2_METADATA_DISABLED=true` (no wait on the instance metadata service). vLLM copies
`AWS_ENDPOINT_URL` to `RUNAI_STREAMER_S3_ENDPOINT` when the loader gets extra config.

The quick tests compare tensors and files; the e2e test starts a real vLLM CPU engine from the
bucket and generates a token (`-m e2e`, a few minutes on two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from local.tiny_model import ensure_tiny_model
from serving.spec.scaling import LoadingSpec

BUCKET = "pd-models"
PREFIX = "tiny-llama/v1"
# The streamer's own env that the vLLM loader sets from model_loader_extra_config: restored
# after the module, so the loader's os.environ writes do not leak into other tests.
STREAMER_ENV = ("RUNAI_STREAMER_CONCURRENCY", "RUNAI_STREAMER_MEMORY_LIMIT", "RUNAI_STREAMER_S3_ENDPOINT")


@dataclass(frozen=True)
class S3Model:
    uri: str  # s3://bucket/prefix
    local: Path  # the same model on disk
    endpoint: str


@pytest.fixture(scope="module")
def s3_model(tmp_path_factory) -> Iterator[S3Model]:
    """The tiny model in a moto S3 bucket, with the streamer's S3-compatible settings in the env."""
    import boto3
    from moto.server import ThreadedMotoServer

    local = ensure_tiny_model()  # the cached build `make serve` uses; built here if missing
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # port 0: a free one
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {
            "AWS_ENDPOINT_URL": endpoint,
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            "AWS_EC2_METADATA_DISABLED": "true",
            # moto accepts any key; these keep a developer's own ~/.aws out of the test.
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(tmp_path_factory.mktemp("aws") / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path_factory.mktemp("aws") / "credentials"),
            # ObjectStorageModel mirrors config and tokenizer files under $VLLM_ASSETS_CACHE.
            "VLLM_ASSETS_CACHE": str(tmp_path_factory.mktemp("vllm-assets")),
        }.items():
            mp.setenv(key, value)
        for key in STREAMER_ENV:
            mp.delenv(key, raising=False)
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket=BUCKET)
        for f in sorted(local.iterdir()):
            if f.is_file():
                s3.upload_file(str(f), BUCKET, f"{PREFIX}/{f.name}")
        try:
            yield S3Model(uri=f"s3://{BUCKET}/{PREFIX}", local=local, endpoint=endpoint)
        finally:
            server.stop()


def test_the_streamer_under_test_is_the_one_the_worker_image_installs():
    """requirements-dev.txt and the image (tests/images) both follow versions.py."""
    from importlib.metadata import version

    from infra import versions

    assert version("runai-model-streamer") == versions.RUNAI_STREAMER_VERSION
    assert version("runai-model-streamer-s3") == versions.RUNAI_STREAMER_VERSION


def _engine_args(uri: str, loading: LoadingSpec):
    """vLLM's EngineArgs for `uri` with the load settings our spec renders for it."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs = loading.engine_kwargs(uri)
    assert kwargs["load_format"] == "runai_streamer", kwargs  # s3:// is streamed by default
    return EngineArgs(model=uri, dtype="float32", max_model_len=256, **kwargs)


def test_vllm_streams_every_tensor_of_the_tiny_model_from_s3(s3_model):
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader import get_model_loader

    # memory_limit 0 is the streamer's smallest CPU buffer ("MIN", env-vars.md): the tensors
    # arrive in several fills of it, not in one read.
    loading = LoadingSpec(streamer_concurrency=2, streamer_memory_limit_bytes=0)
    args = _engine_args(s3_model.uri, loading)
    model_config = args.create_model_config()  # pulls config + tokenizer files from the bucket
    assert model_config.model_weights == s3_model.uri
    loader = get_model_loader(args.create_load_config())
    assert os.environ["RUNAI_STREAMER_S3_ENDPOINT"] == s3_model.endpoint  # set by vLLM's loader
    assert os.environ["RUNAI_STREAMER_CONCURRENCY"] == "2"

    streamed = {name: tensor for name, tensor in loader.get_all_weights(model_config, None)}

    expected = load_file(str(s3_model.local / "model.safetensors"))
    assert sorted(streamed) == sorted(expected)
    for name, tensor in expected.items():
        got = streamed[name]
        assert (got.dtype, tuple(got.shape)) == (tensor.dtype, tuple(tensor.shape)), name
        assert got.device.type == "cpu"
        assert bool((got == tensor).all()), f"{name}: streamed values differ from the local file"


def test_vllm_pulls_config_and_tokenizer_from_the_same_prefix(s3_model):
    args = _engine_args(s3_model.uri, LoadingSpec())
    model_config = args.create_model_config()
    mirror = Path(model_config.model)
    assert Path(model_config.tokenizer) == mirror
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (mirror / name).read_bytes() == (s3_model.local / name).read_bytes(), name
    # The weights stay in the bucket: only the streamer reads them.
    assert not list(mirror.glob("*.safetensors"))
    assert (
        model_config.hf_config.num_hidden_layers
        == json.loads((s3_model.local / "config.json").read_text())["num_hidden_layers"]
    )


def test_a_wrong_prefix_is_refused_naming_the_uri(s3_model):
    """A typo in the prefix: the loader finds no safetensors and says where it looked."""
    from vllm.model_executor.model_loader import get_model_loader

    wrong = f"s3://{BUCKET}/tiny-llama/v2"
    loader = get_model_loader(_engine_args(s3_model.uri, LoadingSpec()).create_load_config())
    with pytest.raises(RuntimeError, match="Cannot find any safetensors model weights") as err:
        loader.download_model(_StubModelConfig(wrong))
    assert wrong in str(err.value)


def test_a_wrong_prefix_stops_the_engine_config_before_any_weight_is_read(s3_model):
    """vLLM 0.32 pulls config.json first; from an empty prefix it has none, and the engine
    config is refused (ValueError) before the loader runs. Its message names the local mirror
    directory, not the s3:// URI (vllm/config/model.py): docs/scaling.md says so."""
    with pytest.raises(ValueError, match=r"config\.json"):
        _engine_args(f"s3://{BUCKET}/tiny-llama/v2", LoadingSpec()).create_model_config()


def test_a_wrong_bucket_is_refused_by_s3(s3_model):
    from botocore.exceptions import ClientError
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(_engine_args(s3_model.uri, LoadingSpec()).create_load_config())
    with pytest.raises(ClientError) as err:
        loader.download_model(_StubModelConfig(f"s3://no-such-bucket/{PREFIX}"))
    assert err.value.response["Error"]["Code"] == "NoSuchBucket"


@dataclass(frozen=True)
class _StubModelConfig:
    """What RunaiModelStreamerLoader.download_model reads of a ModelConfig (vLLM 0.32: `.model`,
    `.revision`); a real ModelConfig cannot be built for a prefix without config.json."""

    model: str
    revision: str | None = None


# --- e2e: a real vLLM CPU engine started from the bucket --------------------------------------
ENGINE_PROBE = r"""
import json, sys
from vllm import LLM, SamplingParams
uri, prompt = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=uri, load_format="runai_streamer", dtype="float32", enforce_eager=True,
          max_model_len=256, model_loader_extra_config={"concurrency": 2})
out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0))
print("RESULT " + json.dumps(list(out[0].outputs[0].token_ids)))
"""


@pytest.mark.e2e
def test_a_vllm_cpu_engine_starts_from_the_bucket_and_generates(s3_model):
    import torch
    from transformers import AutoModelForCausalLM

    from local.config import cluster_env

    prompt = [1, 17, 42, 99, 7]
    env = {
        **os.environ,
        **cluster_env(),
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, as the local stack runs it (local/config.py)
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    run = subprocess.run(
        [sys.executable, "-c", ENGINE_PROBE, s3_model.uri, json.dumps(prompt)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    line = next(x for x in reversed(run.stdout.splitlines()) if x.startswith("RESULT "))
    tokens = json.loads(line.removeprefix("RESULT "))
    assert len(tokens) == 1
    # The token greedy decoding picks from the local weights: the engine ran on the streamed ones.
    model = AutoModelForCausalLM.from_pretrained(s3_model.local, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    assert tokens[0] == int(logits.argmax())
