"""Time to serve (Pending pod -> serving replica) per role: the arithmetic by hand, and what the
stack's choices do to it (local NVMe vs the gp3 root volume, S3 gateway endpoint vs NAT, the
model's size), through `planning.plan` on the shipped stacks."""

from __future__ import annotations

import copy

import pytest

from infra.catalog import lookup
from infra.config import load
from infra.plan import planning
from infra.sizing import startup
from tools.stackfile import read_as_deployed as read

P5 = lookup("p5.48xlarge")
LLAMA70_GIB = 70.6e9 * 2 / 2**30  # bf16 checkpoint, 131.5 GiB


def _plan(stack: str, edit=None) -> planning.Plan:
    values, secrets, _ = read(stack)
    values = copy.deepcopy(values)
    if edit:
        edit(values)
    return planning.plan(load(values, secret_keys=secrets, source=f"stacks/Pulumi.{stack}.yaml"))


def _role(p: planning.Plan, role: str = "decode") -> startup.TimeToServe:
    t = next(r.startup for r in p.roles if r.role == role)
    assert t is not None
    return t


def _tts(source: str, *, raid0: bool = True, endpoint: bool = True, gib: float | None = LLAMA70_GIB, inst=P5):
    per_gpu = None if gib is None else gib / 8
    return startup.time_to_serve(
        "decode",
        inst,
        raid0=raid0,
        model_source=source,
        s3_gateway_endpoint=endpoint,
        checkpoint_gib=gib,
        weights_gib_per_gpu=per_gpu,
    )


def test_the_sum_by_hand():
    """Worked out by hand from the sources infra/sizing/startup.py cites, to 4 digits:
    anyscale/ray-serve-llm-perf-examples replica_initialization/ (commit 04ba8ab4), logs
    llama70b-s3-runai.txt (131.4 GiB streamed from S3 in 91.06 s) and llama70b-base.txt
    (32.8601 GiB loaded per rank in 15.82 s; engine init 91.82 s); the AWS ML blog on SOCI
    (15 GB pulled in 4 minutes); 5 minutes to provision a node (aws-parallelcluster#4236)."""
    t = _tts("s3://b/meta-llama/Llama-3.3-70B-Instruct")
    # S3 binds on p5 with RAID0 and the gateway endpoint: 131.4 / 91.06 = 1.443 GiB/s.
    assert t.source == startup.Source.S3_ENDPOINT and t.bound_by == "the source"
    assert t.download_gibps == pytest.approx(1.443, rel=1e-3)
    # The checkpoint: 70.6e9 x 2 B = 131.50 GiB; 131.50 / 1.443 = 91.13 s on every node.
    assert t.download_s == pytest.approx(91.13, rel=1e-3)
    # One GPU's eighth (16.438 GiB) at 32.8601 / 15.82 = 2.0771 GiB/s: 7.914 s, ranks in parallel.
    assert t.load_s == pytest.approx(7.914, rel=1e-3)
    assert t.image_s == pytest.approx(240)  # 15 GB at 15 GB per 4 minutes
    # Warm node: 91.13 + 7.914 + 91.82 = 190.86 s; new node: 300 + 240 + 190.86 = 730.86 s.
    assert t.warm_node_s == pytest.approx(190.86, rel=1e-3)
    assert t.new_node_s == pytest.approx(730.86, rel=1e-3)


def test_raid0_nvme_shortens_the_weights_against_the_gp3_root_volume():
    """Without RAID0 the checkpoint lands on the gp3 root volume: 125 MiB/s binds."""
    nvme, gp3 = _tts("s3://b/m", raid0=True), _tts("s3://b/m", raid0=False)
    assert gp3.bound_by == "the gp3 root volume" and gp3.download_gibps == pytest.approx(125 / 1024)
    assert nvme.weights_s is not None and gp3.weights_s is not None
    assert gp3.weights_s > 10 * nvme.weights_s  # 18 minutes against 1.6
    assert gp3.disk == "gp3 root volume" and nvme.disk == "NVMe RAID0"


def test_the_s3_gateway_endpoint_shortens_the_weights_against_nat():
    endpoint, nat = _tts("s3://b/m", endpoint=True), _tts("s3://b/m", endpoint=False)
    assert nat.source == startup.Source.S3_NAT and nat.bound_by == "the NAT gateway"
    assert nat.download_gibps == pytest.approx(5e9 / 8 / 2**30)
    assert nat.download_s > endpoint.download_s


def test_a_repo_id_comes_from_the_hub_through_nat_whatever_the_endpoint():
    t = _tts("meta-llama/Llama-3.1-70B-Instruct", endpoint=True)
    assert t.source == startup.Source.HF_HUB and t.bound_by == "the NAT gateway"
    assert t.streamer_s is None  # the Run:ai streamer reads object storage, not the Hub


def test_a_small_instance_is_bound_by_its_line_rate():
    t = _tts("s3://b/m", inst=lookup("g5.xlarge"), gib=3.0)
    assert t.bound_by == "g5.xlarge line rate" and t.download_gibps == pytest.approx(10e9 / 8 / 2**30)


def test_a_bigger_model_takes_longer():
    """The same prod stack serving Llama 3.1 8B instead of 3.3 70B: a sixth of the download."""

    def smaller(values):
        values["serving"]["model"]["source"] = "s3://pd-inference-prod-models/meta-llama/Llama-3.1-8B-Instruct"
        values["serving"]["model"]["id"] = "llama-3.1-8b-instruct"
        # An 8B model on the same GPUs is planned for ~8x the requests: a head and an ingress
        # that carry them (infra/sizing/head.py refuses prod's m7i.4xlarge and 4 replicas).
        values["systemNodes"]["instanceType"] = "m7i.12xlarge"
        values["serving"]["ingress"] = {"minReplicas": 2, "maxReplicas": 20}

    big, small = _role(_plan("prod")), _role(_plan("prod", smaller))
    assert small.new_node_s is not None and big.new_node_s is not None
    assert small.new_node_s < big.new_node_s and small.warm_node_s < big.warm_node_s  # type: ignore[operator]
    assert small.download_s is not None and big.download_s is not None
    assert big.download_s / small.download_s == pytest.approx(70.6 / 8.03, rel=0.01)


def test_unknown_shape_leaves_the_weights_and_totals_open():
    t = _tts("s3://b/m", gib=None)
    assert t.download_s is None and t.weights_s is None and t.new_node_s is None and t.warm_node_s is None
    assert t.engine_s == startup.ENGINE_START_S  # the rest is still known


# --- through the planner, on the shipped stacks -------------------------------------------
def test_prod_reads_s3_through_the_gateway_endpoint_onto_nvme():
    t = _role(_plan("prod"))
    assert t.source == startup.Source.S3_ENDPOINT and t.disk == "NVMe RAID0"
    assert t.checkpoint_gib == pytest.approx(LLAMA70_GIB)


def test_staging_fetches_from_the_hub_through_nat():
    assert _role(_plan("staging")).source == startup.Source.HF_HUB


def test_an_existing_vpc_is_taken_to_have_no_s3_endpoint():
    def existing(values):
        values["existingVpc"] = {
            "vpcId": "vpc-0123456789abcdef0",
            "privateSubnetIds": ["subnet-0123456789abcdef0", "subnet-0123456789abcdef1"],
            "efaSubnetId": "subnet-0123456789abcdef0",
        }
        values.pop("vpcCidr", None)

    assert _role(_plan("prod", existing)).source == startup.Source.S3_NAT


def test_local_storage_none_in_the_stack_lengthens_the_plan():
    """On the copy path (weights: download) the checkpoint lands on the node's disk."""

    def no_raid(values):
        values["nodePools"]["decode"]["localStorage"] = "none"
        values["serving"]["model"]["loading"] = {"weights": "download"}

    def download(values):
        values["serving"]["model"]["loading"] = {"weights": "download"}

    base, edited = _role(_plan("prod", download)), _role(_plan("prod", no_raid))
    assert edited.disk == "gp3 root volume"
    assert edited.new_node_s > base.new_node_s  # type: ignore[operator]
    # The other role's pool keeps its RAID0.
    assert _role(_plan("prod", no_raid), "prefill").disk == "NVMe RAID0"


def test_the_plan_prints_time_to_serve_per_role():
    text = planning.format_plan(_plan("prod"))
    for label in ("Time to serve, new node", "Time to serve, warm node", "  weights from", "  download"):
        assert label in text, label
    assert "S3 via gateway endpoint, streamed to GPUs" in text


# --- the Run:ai streamer ---------------------------------------------------------
def test_streamed_weights_take_the_streamers_rate_and_skip_the_disk():
    """anyscale/ray-serve-llm-perf-examples replica_initialization/ llama70b-s3-runai.txt
    (commit 04ba8ab4): 131.4 GiB streamed from S3 in 91.06 s with `load_format: runai_streamer`.
    Streamed, the weights take checkpoint / that rate, with no disk bound and no load step."""
    copied = _tts("s3://b/m", raid0=False)
    streamed = startup.time_to_serve(
        "decode",
        P5,
        raid0=False,
        model_source="s3://b/m",
        s3_gateway_endpoint=True,
        checkpoint_gib=LLAMA70_GIB,
        weights_gib_per_gpu=LLAMA70_GIB / 8,
        streamed=True,
    )
    # 131.50 GiB / (131.4 / 91.06) GiB/s = 91.13 s, whatever the root volume.
    assert streamed.weights_s == pytest.approx(91.13, rel=1e-3)
    assert copied.weights_s is not None and copied.weights_s > 10 * streamed.weights_s
    assert streamed.streamer_faster is True
    # Through NAT the stream is bound by the NAT gateway, like a download.
    nat = _tts("s3://b/m", endpoint=False)
    assert nat.streamer_s == pytest.approx(LLAMA70_GIB / (5e9 / 8 / 2**30), rel=1e-3)


def test_a_hub_repo_id_is_never_streamed():
    t = startup.time_to_serve(
        "decode",
        P5,
        raid0=True,
        model_source="org/model",
        s3_gateway_endpoint=True,
        checkpoint_gib=LLAMA70_GIB,
        weights_gib_per_gpu=LLAMA70_GIB / 8,
        streamed=True,
    )
    assert t.streamed is False and t.weights_s == t.copied_s


def test_prod_streams_its_s3_weights_in_the_plan():
    t = _role(_plan("prod"))
    assert t.streamed and t.weights_s == t.streamer_s
    text = planning.format_plan(_plan("prod"))
    assert "streamed to GPUs" in text
