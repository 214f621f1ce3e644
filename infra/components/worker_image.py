"""WorkerImage: the worker image (the EFA userspace and the Run:ai model streamer on top of the
stock Ray LLM image), built from images/ray-llm-efa and pushed to a private ECR repo.

What flows through here: the pinned base Ray image and the EFA installer pin -> an ECR
repository (immutable tags, scan on push, KMS-encrypted with ECR's managed key, old images
expired) and a `docker-build` Image whose one tag is the content hash of images/ray-llm-efa
plus its build arguments -> `ref`, the image the Ray head and workers run.

The tag changes exactly when the build would produce something new, so a pull request that
touches the Dockerfile (or the base image, or the EFA pin) shows a new tag in the rendered
diff and an Image update in `pulumi preview`; an unchanged folder never rebuilds. The tag
being immutable in ECR means a tag names one build forever.

`docker-build` needs Docker with buildx where `pulumi up` runs (the deploy job's runner);
the base image is ~20 GB, so use a runner with the disk for it, or build once by hand and
set `imageBuild: none` with `rayImage` naming that image (docs/efa.md).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pulumi_aws as aws
import pulumi_docker_build as docker_build

from infra import paths, versions

IMAGE_DIR = paths.ROOT / "images" / "ray-llm-efa"


def build_args(base_image: str) -> dict[str, str]:
    """The Dockerfile's arguments: the base and the EFA installer pin (infra/versions.py)."""
    return {
        "BASE_IMAGE": base_image,
        "EFA_INSTALLER_VERSION": versions.EFA_INSTALLER_VERSION,
        "EFA_INSTALLER_SHA256": versions.EFA_INSTALLER_SHA256,
    }


def content_tag(context_dir: Path, args: dict[str, str]) -> str:
    """`<ray version>-efa-<hash>`: the hash of every file in the build context and the arguments."""
    h = hashlib.sha256()
    for f in sorted(p for p in context_dir.rglob("*") if p.is_file()):
        h.update(f.relative_to(context_dir).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(json.dumps(args, sort_keys=True).encode())
    return f"{versions.RAY_VERSION}-efa-{h.hexdigest()[:16]}"


@dataclass
class WorkerImageArgs:
    repository: str
    """Name of the ECR repository the stack creates for the image."""
    base_image: str
    """The FROM image: the stack's rayImage (pinned)."""
    context_dir: Path = IMAGE_DIR
    """The build context holding the Dockerfile."""
    keep_images: int = 10
    """How many images ECR keeps before it expires the oldest."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags for every AWS resource of the component."""


class WorkerImage(pulumi.ComponentResource):
    ref: pulumi.Output[str]
    tag: str

    def __init__(self, name: str, args: WorkerImageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:image:WorkerImage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        repo = aws.ecr.Repository(
            f"{name}-repo",
            name=args.repository,
            image_tag_mutability="IMMUTABLE",
            image_scanning_configuration=aws.ecr.RepositoryImageScanningConfigurationArgs(scan_on_push=True),
            # KMS with ECR's AWS-managed key (aws/ecr): no key of ours to manage or to grant pulls on.
            encryption_configurations=[aws.ecr.RepositoryEncryptionConfigurationArgs(encryption_type="KMS")],
            tags=args.tags,
            opts=child,
        )
        aws.ecr.LifecyclePolicy(
            f"{name}-expiry",
            repository=repo.name,
            policy=json.dumps(
                {
                    "rules": [
                        {
                            "rulePriority": 1,
                            "description": f"keep the newest {args.keep_images} images",
                            "selection": {
                                "tagStatus": "any",
                                "countType": "imageCountMoreThan",
                                "countNumber": args.keep_images,
                            },
                            "action": {"type": "expire"},
                        }
                    ]
                }
            ),
            opts=child,
        )
        bargs = build_args(args.base_image)
        self.tag = content_tag(args.context_dir, bargs)
        tagged = pulumi.Output.concat(repo.repository_url, ":", self.tag)
        token = aws.ecr.get_authorization_token_output(registry_id=repo.registry_id)
        image = docker_build.Image(
            f"{name}-image",
            context=docker_build.BuildContextArgs(location=str(args.context_dir)),
            dockerfile=docker_build.DockerfileArgs(location=str(args.context_dir / "Dockerfile")),
            build_args=bargs,
            platforms=[docker_build.Platform.LINUX_AMD64],
            push=True,
            tags=[tagged],
            registries=[
                docker_build.RegistryArgs(
                    address=repo.repository_url, username=token.user_name, password=token.password
                )
            ],
            opts=child,
        )
        # The pods name the image only once it is pushed (the Image's id exists after the push).
        self.ref = pulumi.Output.all(tagged, image.id).apply(lambda v: v[0])
        self.register_outputs({"ref": self.ref, "tag": self.tag, "repository": repo.repository_url})
