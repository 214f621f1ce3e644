"""Network: the VPC the cluster lives in, new or existing.

What flows through here: the stack's CIDR, zones and EFA zone (or an existing VPC's ids) ->
a VPC with private subnets for nodes in every zone, public subnets for load balancers and
NAT gateways -> the ids the Cluster and the GPU node pools use. EFA node groups get the one
private subnet in the EFA zone: EFA needs every node of a pool in one zone.
"""

from __future__ import annotations

import ipaddress
import json
import math
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.components.iam import trusted_by
from infra.config import ExistingVpc, NatGateways


@dataclass
class NetworkArgs:
    cidr: str
    """Range of a new VPC (private, /16 to /20)."""
    availability_zones: list[str]
    """Zones of the node subnets (a private and a public subnet each)."""
    efa_zone: str
    """The zone of the EFA pools (its private subnet is `efa_subnet_id`)."""
    nat_gateways: NatGateways = NatGateways.SINGLE
    """One NAT gateway, or one per zone."""
    existing: ExistingVpc | None = None
    """Use this existing VPC and its subnets instead of creating one."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags for every AWS resource of the component."""


def subnet_cidrs(cidr: str, zones: int) -> tuple[list[str], list[str]]:
    """(private, public) CIDRs: equal slices of the VPC, private first, one per zone each."""
    net = ipaddress.ip_network(cidr)
    bits = math.ceil(math.log2(2 * zones))
    slices = [str(s) for s in net.subnets(prefixlen_diff=bits)]
    return slices[:zones], slices[zones : 2 * zones]


class Network(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    private_subnet_ids: pulumi.Output[list[str]]
    public_subnet_ids: pulumi.Output[list[str]]
    efa_subnet_id: pulumi.Output[str]

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("pd-inference:network:Network", name, None, opts)
        if args.existing is not None:
            self._adopt(args.existing)
        else:
            self._create(name, args)
        self.register_outputs(
            {
                "vpcId": self.vpc_id,
                "privateSubnetIds": self.private_subnet_ids,
                "publicSubnetIds": self.public_subnet_ids,
                "efaSubnetId": self.efa_subnet_id,
            }
        )

    def _adopt(self, existing: ExistingVpc) -> None:
        self.vpc_id = pulumi.Output.from_input(existing.vpc_id)
        self.private_subnet_ids = pulumi.Output.from_input(list(existing.private_subnet_ids))
        self.public_subnet_ids = pulumi.Output.from_input(list(existing.public_subnet_ids))
        self.efa_subnet_id = pulumi.Output.from_input(existing.efa_subnet_id)

    def _create(self, name: str, args: NetworkArgs) -> None:
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=args.cidr,
            enable_dns_hostnames=True,
            enable_dns_support=True,
            tags={**tags, "Name": f"{name}-vpc"},
            opts=child,
        )
        # No rules: the default security group of a new VPC should allow nothing.
        aws.ec2.DefaultSecurityGroup(f"{name}-default-sg", vpc_id=vpc.id, tags=tags, opts=child)
        igw = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=vpc.id, tags=tags, opts=child)
        subnets = create_subnets(name, args, vpc, igw, self)
        create_s3_endpoint(name, args, vpc, subnets.private_route_tables, child)
        create_flow_logs(name, tags, vpc, child)

        efa_index = args.availability_zones.index(args.efa_zone)
        self.vpc_id = vpc.id
        self.private_subnet_ids = pulumi.Output.all(*[s.id for s in subnets.private])
        self.public_subnet_ids = pulumi.Output.all(*[s.id for s in subnets.public])
        self.efa_subnet_id = subnets.private[efa_index].id


@dataclass
class Subnets:
    public: list[aws.ec2.Subnet]
    private: list[aws.ec2.Subnet]
    private_route_tables: list[aws.ec2.RouteTable]
    """One per zone, each routing to its NAT gateway: the S3 endpoint's route tables."""


def create_subnets(
    name: str, args: NetworkArgs, vpc: aws.ec2.Vpc, igw: aws.ec2.InternetGateway, parent: pulumi.Resource
) -> Subnets:
    """Per zone a public subnet (routed to the internet gateway) and a private one (routed to
    a NAT gateway: the first zone's, or the zone's own with one per zone)."""
    child = pulumi.ResourceOptions(parent=parent)
    tags = dict(args.tags)
    private_cidrs, public_cidrs = subnet_cidrs(args.cidr, len(args.availability_zones))
    public_rt = aws.ec2.RouteTable(
        f"{name}-public-rt",
        vpc_id=vpc.id,
        routes=[aws.ec2.RouteTableRouteArgs(cidr_block="0.0.0.0/0", gateway_id=igw.id)],
        tags=tags,
        opts=child,
    )
    out = Subnets([], [], [])
    nats: list[aws.ec2.NatGateway] = []
    for i, zone in enumerate(args.availability_zones):
        pub = aws.ec2.Subnet(
            f"{name}-public-{zone}",
            vpc_id=vpc.id,
            cidr_block=public_cidrs[i],
            availability_zone=zone,
            map_public_ip_on_launch=False,
            tags={**tags, "Name": f"{name}-public-{zone}", "kubernetes.io/role/elb": "1"},
            opts=child,
        )
        aws.ec2.RouteTableAssociation(
            f"{name}-public-{zone}-rta", subnet_id=pub.id, route_table_id=public_rt.id, opts=child
        )
        out.public.append(pub)
        if i == 0 or args.nat_gateways is NatGateways.PER_ZONE:
            nats.append(create_nat_gateway(name, zone, pub, igw, tags, parent))
        priv, rt = create_private_subnet(name, zone, private_cidrs[i], vpc, nats[-1], tags, child)
        out.private.append(priv)
        out.private_route_tables.append(rt)
    return out


def create_nat_gateway(
    name: str,
    zone: str,
    subnet: aws.ec2.Subnet,
    igw: aws.ec2.InternetGateway,
    tags: dict[str, str],
    parent: pulumi.Resource,
) -> aws.ec2.NatGateway:
    """A NAT gateway with its Elastic IP in the zone's public subnet, after the internet gateway."""
    eip = aws.ec2.Eip(f"{name}-nat-{zone}-eip", domain="vpc", tags=tags, opts=pulumi.ResourceOptions(parent=parent))
    return aws.ec2.NatGateway(
        f"{name}-nat-{zone}",
        allocation_id=eip.id,
        subnet_id=subnet.id,
        tags={**tags, "Name": f"{name}-nat-{zone}"},
        opts=pulumi.ResourceOptions(parent=parent, depends_on=[igw]),
    )


def create_private_subnet(
    name: str,
    zone: str,
    cidr: str,
    vpc: aws.ec2.Vpc,
    nat: aws.ec2.NatGateway,
    tags: dict[str, str],
    opts: pulumi.ResourceOptions,
) -> tuple[aws.ec2.Subnet, aws.ec2.RouteTable]:
    """The zone's private subnet (the nodes') and its route table, whose default route is `nat`."""
    priv = aws.ec2.Subnet(
        f"{name}-private-{zone}",
        vpc_id=vpc.id,
        cidr_block=cidr,
        availability_zone=zone,
        tags={**tags, "Name": f"{name}-private-{zone}", "kubernetes.io/role/internal-elb": "1"},
        opts=opts,
    )
    rt = aws.ec2.RouteTable(
        f"{name}-private-{zone}-rt",
        vpc_id=vpc.id,
        routes=[aws.ec2.RouteTableRouteArgs(cidr_block="0.0.0.0/0", nat_gateway_id=nat.id)],
        tags=tags,
        opts=opts,
    )
    aws.ec2.RouteTableAssociation(f"{name}-private-{zone}-rta", subnet_id=priv.id, route_table_id=rt.id, opts=opts)
    return priv, rt


def create_s3_endpoint(
    name: str,
    args: NetworkArgs,
    vpc: aws.ec2.Vpc,
    route_tables: list[aws.ec2.RouteTable],
    opts: pulumi.ResourceOptions,
) -> None:
    """S3 through a gateway endpoint, not the NAT gateway: model weights (tens of GiB per
    node) and the serving code stay on AWS's network and cost no NAT data processing."""
    region = args.availability_zones[0][:-1]  # us-east-2a -> us-east-2
    aws.ec2.VpcEndpoint(
        f"{name}-s3",
        vpc_id=vpc.id,
        service_name=f"com.amazonaws.{region}.s3",
        vpc_endpoint_type="Gateway",
        route_table_ids=[rt.id for rt in route_tables],
        tags={**args.tags, "Name": f"{name}-s3"},
        opts=opts,
    )


def create_flow_logs(name: str, tags: dict[str, str], vpc: aws.ec2.Vpc, opts: pulumi.ResourceOptions) -> None:
    """Flow logs of rejected traffic: the first thing asked for when a pod cannot connect."""
    log_group = aws.cloudwatch.LogGroup(f"{name}-flow-logs", retention_in_days=30, tags=tags, opts=opts)
    flow_role = aws.iam.Role(
        f"{name}-flow-logs-role",
        assume_role_policy=trusted_by("vpc-flow-logs.amazonaws.com"),
        tags=tags,
        opts=opts,
    )
    aws.iam.RolePolicy(
        f"{name}-flow-logs-policy",
        role=flow_role.id,
        policy=log_group.arn.apply(
            lambda arn: json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [
                        {
                            "Effect": "Allow",
                            "Action": ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                            "Resource": f"{arn}:*",
                        }
                    ],
                }
            )
        ),
        opts=opts,
    )
    aws.ec2.FlowLog(
        f"{name}-flow-log",
        vpc_id=vpc.id,
        traffic_type="REJECT",
        log_destination=log_group.arn,
        iam_role_arn=flow_role.arn,
        tags=tags,
        opts=opts,
    )
