"""A local S3 holding the LoRA adapters of `make serve PD_MODELS=2`.

What flows through here: adapter directories (name -> local folder; by default the tiny model's
own adapter, local/tiny_lora.py) -> moto's S3 server (moto[server], which `make venv`
installs from requirements-dev.lock) in a thread of this process on 127.0.0.1 and a free port ->
one bucket holding `<prefix>/<adapter>/<file>` -> the environment the Ray nodes need to reach it
and the `s3://bucket/prefix` path for the spec's `lora.adaptersPath`. Ray Serve LLM then lists
and downloads the adapters with its own S3 code, as in the cloud: only the object store is local.

The server runs in a thread, not a child process: the kernel picks its port (no race for a free
one) and it dies with the process that started it, so a killed `make serve` leaves nothing
behind. moto keeps its buckets in process-wide memory: two servers in one process share them.

Endpoint facts, read in the installed sources:
- Ray Serve LLM 2.60 (ray/llm/_internal/common/utils/cloud_filesystem/s3_filesystem.py):
  `boto3.client("s3", config=...)` with no endpoint_url; `list_subfolders(path)` lists `path/`
  with Delimiter "/" and each common prefix is an adapter (lora_utils.py `get_lora_model_ids`
  names it `<model id>:<folder>`); `download_files` fetches every object under
  `<path>/<adapter>/`; serve/utils/lora_serve_utils.py reads `<path>/<adapter>/adapter_config.json`.
- botocore 1.44 (configprovider.py `EndpointConfigProvider.provide`): the endpoint comes from
  AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL, then the shared config file, and none of them is
  used when AWS_IGNORE_CONFIGURED_ENDPOINT_URLS is true (args.py): ENV sets it false, so that a
  developer's shell cannot send the nodes to real S3. The S3-only variable leaves other AWS
  clients (and the Run:ai streamer, which reads AWS_ENDPOINT_URL) alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

BUCKET = "pd-local-lora"
PREFIX = "tiny-llama"
HOST = "127.0.0.1"
REGION = "us-east-1"  # S3's default region: no LocationConstraint needed to create a bucket
# moto accepts any credentials; these keep the nodes off a developer's real ones.
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "pd-local", "AWS_SECRET_ACCESS_KEY": "pd-local"}


class LocalS3:
    """moto's S3 server for the life of the local stack: start(), put_adapters(), env(), stop()."""

    def __init__(self, host: str = HOST):
        self.host = host
        self._server: Any = None
        self._endpoint: str | None = None

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("the local S3 is not started")
        return self._endpoint

    def start(self) -> str:
        """Listen on a free port of `host`; returns the endpoint URL once the socket is bound."""
        import logging

        from moto.server import ThreadedMotoServer

        # One line per S3 request (werkzeug's access log) would bury make serve's own lines.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)

        server = ThreadedMotoServer(ip_address=self.host, port=0, verbose=False)  # port 0: a free one
        server.start()
        host, port = server.get_host_and_port()
        self._server, self._endpoint = server, f"http://{host}:{port}"
        return self._endpoint

    def env(self) -> dict[str, str]:
        """What a process (a Ray node and its workers) needs for boto3 to use this server."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "false",
            **_CREDENTIALS,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",  # no wait on an instance metadata service
        }

    def client(self) -> Any:
        """A boto3 S3 client for this server, whatever this process's own AWS environment says."""
        import boto3

        return boto3.session.Session(
            aws_access_key_id=_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=REGION,
        ).client("s3", endpoint_url=self.endpoint)

    def put_adapters(self, adapters: Mapping[str, Path], bucket: str = BUCKET, prefix: str = PREFIX) -> str:
        """Upload each adapter folder's files to `<prefix>/<name>/`; returns `s3://bucket/prefix`."""
        s3 = self.client()
        s3.create_bucket(Bucket=bucket)  # idempotent in us-east-1, on S3 and on moto
        prefix = prefix.strip("/")
        for name, folder in sorted(adapters.items()):
            if not name or "/" in name or ":" in name:
                # Ray splits `<model id>:<adapter>` at the first ":" and the adapter is one folder.
                raise ValueError(f"{name!r} is not an adapter name (one folder, no ':')")
            files = sorted(f for f in Path(folder).iterdir() if f.is_file())
            if not any(f.name == "adapter_config.json" for f in files):
                raise ValueError(f"{folder} has no adapter_config.json")
            for f in files:
                key = f"{prefix}/{name}/{f.name}" if prefix else f"{name}/{f.name}"
                s3.upload_file(str(f), bucket, key)
        return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        self._server = self._endpoint = None


@contextlib.contextmanager
def local_adapters(
    adapters: Mapping[str, Path] | None = None, bucket: str = BUCKET, prefix: str = PREFIX
) -> Iterator[tuple[dict[str, str], str]]:
    """A local S3 holding `adapters` (default: the tiny model's, as tiny_lora.ADAPTER_NAME) for
    the life of the block: yields (env for the Ray nodes, adapters_path for `lora.adaptersPath`).

    A model served with that path answers `<model id>:<adapter name>` for each adapter.
    """
    if adapters is None:
        from local.tiny_lora import ADAPTER_NAME, ensure_tiny_lora

        adapters = {ADAPTER_NAME: ensure_tiny_lora()}
    s3 = LocalS3()
    s3.start()
    try:
        path = s3.put_adapters(adapters, bucket, prefix)
        yield s3.env(), path
    finally:
        s3.stop()
