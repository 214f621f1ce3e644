"""Smaller cloud items of issue 10: S3 through a gateway endpoint, a read-only cluster role.

- AWS VPC gateway endpoints: an `com.amazonaws.<region>.s3` endpoint of type Gateway adds a
  prefix-list route to the route tables it names; traffic from subnets using those tables to
  S3 in that region then bypasses the NAT gateway. The private route tables must be named.
- EKS access policies: `arn:aws:eks::aws:cluster-access-policy/AmazonEKSViewPolicy` grants
  get/list/watch; with server-side apply, pulumi-kubernetes previews need `patch` for a
  dry-run and fall back to a client-side diff without it (pulumi/pulumi-kubernetes#2419).
"""

from __future__ import annotations

from infra.components.cluster import ADMIN_POLICY, VIEW_POLICY


def test_private_route_tables_reach_s3_through_a_gateway_endpoint(rendered_stacks):
    for stack, rendered in rendered_stacks.items():
        res = rendered.result
        if rendered.config.existing_vpc is not None:
            continue
        (ep,) = res.of_type("aws:ec2/vpcEndpoint:VpcEndpoint")
        region = rendered.config.availability_zones[0][:-1]
        assert ep.inputs["serviceName"] == f"com.amazonaws.{region}.s3" and ep.inputs["vpcEndpointType"] == "Gateway"
        private_rts = {f"{r.name}-id" for r in res.of_type("aws:ec2/routeTable:RouteTable") if "-private-" in r.name}
        assert private_rts and set(ep.inputs["routeTableIds"]) == private_rts, stack


def test_view_roles_get_read_only_entries(rendered_stacks):
    for rendered in rendered_stacks.values():
        entries = rendered.result.one("eks:index:Cluster").inputs["accessEntries"]
        views = {e["principalArn"]: e for k, e in entries.items() if k.startswith("view-")}
        assert set(views) == set(rendered.config.view_role_arns)
        for e in views.values():
            (policy,) = e["accessPolicies"].values()
            assert policy["policyArn"] == VIEW_POLICY != ADMIN_POLICY
