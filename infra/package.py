"""Packaging serving/ for the cluster: a deterministic, content-hashed zip.

What flows through here: the files of serving/ (sources only, without the local-only
local/) -> one zip whose bytes depend
only on those files' paths and contents -> its SHA-256, which names the object in the
stack's code bucket. Changing serving code changes the name, so the RayService's
`working_dir` changes and Serve rolls the application in place; unchanged code leaves the
RayService untouched.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

from infra import paths

ROOT = paths.ROOT
SERVING = paths.SERVING_DIR
# Ray unpacks a working_dir zip and uses its single top-level directory as the working dir.
TOP = "app"
_EPOCH = (1980, 1, 1, 0, 0, 0)


def serving_files() -> list[Path]:
    return sorted(
        p
        for p in SERVING.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in {".py", ".json", ".jinja", ".txt"}
    )


def serving_zip() -> tuple[bytes, str]:
    """(zip bytes, sha256 hex) of serving/; same files, same bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in serving_files():
            info = zipfile.ZipInfo(f"{TOP}/{path.relative_to(ROOT).as_posix()}", date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, path.read_bytes())
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def write_serving_zip(out_dir: Path) -> tuple[Path, str]:
    """Write the zip to out_dir/serving-<sha12>.zip (for a Pulumi FileAsset); return (path, sha)."""
    data, sha = serving_zip()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"serving-{sha[:12]}.zip"
    if not path.exists() or path.read_bytes() != data:
        path.write_bytes(data)
    return path, sha
