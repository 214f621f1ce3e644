"""The project's S3 buckets' common shape: private, owner-enforced, KMS-encrypted.

What flows through here: a resource name, tags and resource options -> an `aws.s3.Bucket`
(`bucket_prefix` from the name, so the name AWS gives it is unique) with, beside it, its
public access block, owner-enforced object ownership and default `aws:kms` encryption with
an S3 bucket key (`<name>-pab`, `<name>-owner`, `<name>-sse`). The caller adds what is its
own (versioning for the code bucket, a lifecycle for the traces bucket).
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws


def private_bucket(name: str, tags: dict[str, str], opts: pulumi.ResourceOptions) -> aws.s3.Bucket:
    bucket = aws.s3.Bucket(name, bucket_prefix=f"{name}-", force_destroy=True, tags=tags, opts=opts)
    aws.s3.BucketPublicAccessBlock(
        f"{name}-pab",
        bucket=bucket.id,
        block_public_acls=True,
        block_public_policy=True,
        ignore_public_acls=True,
        restrict_public_buckets=True,
        opts=opts,
    )
    aws.s3.BucketOwnershipControls(
        f"{name}-owner",
        bucket=bucket.id,
        rule=aws.s3.BucketOwnershipControlsRuleArgs(object_ownership="BucketOwnerEnforced"),
        opts=opts,
    )
    aws.s3.BucketServerSideEncryptionConfiguration(
        f"{name}-sse",
        bucket=bucket.id,
        rules=[
            aws.s3.BucketServerSideEncryptionConfigurationRuleArgs(
                apply_server_side_encryption_by_default=aws.s3.BucketServerSideEncryptionConfigurationRuleApplyServerSideEncryptionByDefaultArgs(
                    sse_algorithm="aws:kms"
                ),
                bucket_key_enabled=True,
            )
        ],
        opts=opts,
    )
    return bucket
