"""The P/D service dashboard's panels, as data: every PromQL expression it shows.

What flows through here: the monitors' series labels (`infra.k8s.monitoring`) and the serving
code's counter names (`infra.k8s.serving_metrics`, imported, not retyped) -> `ROWS`, the
dashboard's rows in order, each a title and its `PanelSpec`s (title, unit, description,
`Query`s of expression and legend, and the TraceQL queries its trace links run), which
`infra.k8s.dashboards` builds into a Grafana dashboard with Grafana's SDK. Per engine role:
latency (TTFT, ITL, TPOT p50/p99), requests and errors by status, queues, KV cache and
prefix-cache hits, NIXL KV transfer bytes and time per request; hybrid routing (fallback share,
per-key usage and cost, 429s, fallbacks, limiter errors); faults (refusals, retries, local prefills,
stream migrations); GPU utilisation, HBM, power and XID errors from DCGM; and the node
autoscaler's view.

The tests parse every expression of the rendered dashboard with a real PromQL parser and check
each metric name against a live scrape of the local stack (Ray, Serve, vLLM), the serving
code's declared event counters, or the exporter's published metric list (DCGM,
kube-state-metrics, Cluster Autoscaler).
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.k8s import serving_metrics as sm
from infra.k8s.monitoring import RAY_CLUSTER, ROLE

# Grafana's own range variable: at least four scrape intervals (Grafana docs).
RATE = "$__rate_interval"
# vLLM's engine series carry the served model id as `model_name`: filtered by the Model variable.
SEL = f'{ROLE}=~"$role", {RAY_CLUSTER}=~"$cluster", model_name=~"$model"'
# The ingress's own counters live on the head (no engine role): select by Ray cluster only.
CLUSTER_SEL = f'{RAY_CLUSTER}=~"$cluster"'
# The serving code's per-model counters (label `model`, the served model id): also by model.
MODEL_SEL = f'{CLUSTER_SEL}, model=~"$model"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""
    # TraceQL queries the panel links to (title -> query), shown when tracing is on.
    traces: tuple[tuple[str, str], ...] = ()


# Span names and attributes the trace links query: Ray Serve's proxy span
# (ray/serve/_private/proxy.py, `proxy_http_request`, Ray 2.60) and vLLM's request span
# (`llm_request` with `gen_ai.latency.time_to_first_token` in seconds: vllm/v1/engine/
# output_processor.py `do_tracing`, vllm/tracing/utils.py SpanAttributes, vLLM 0.32).
PROXY_SPAN = "proxy_http_request"
ENGINE_SPAN = "llm_request"
TTFT_ATTRIBUTE = "gen_ai.latency.time_to_first_token"
# The links (title, TraceQL): `${__value.numeric}` is the clicked point's value, which Grafana
# fills in (`infra.k8s.dashboards.explore_url` leaves it unencoded).
REQUEST_TRACES = ("Request traces (Tempo)", f'{{ name = "{PROXY_SPAN}" }}')
SLOW_FIRST_TOKENS = (
    "Engine requests at least this slow to first token (Tempo)",
    f'{{ name = "{ENGINE_SPAN}" && span.{TTFT_ATTRIBUTE} >= ${{__value.numeric}} }}',
)


def _quantiles(metric: str, by: str = ROLE) -> tuple[Query, ...]:
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
            f"p{int(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.99)
    )


ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    (
        "Latency per role",
        (
            PanelSpec(
                "Time to first token",
                "s",
                _quantiles("ray_vllm_time_to_first_token_seconds"),
                "vLLM's TTFT per engine: on decode it includes waiting for the KV cache from prefill.",
                traces=(SLOW_FIRST_TOKENS, REQUEST_TRACES),
            ),
            PanelSpec(
                "Inter-token latency", "s", _quantiles("ray_vllm_inter_token_latency_seconds"), traces=(REQUEST_TRACES,)
            ),
            PanelSpec(
                "Time per output token",
                "s",
                _quantiles("ray_vllm_request_time_per_output_token_seconds"),
                traces=(REQUEST_TRACES,),
            ),
        ),
    ),
    (
        "Requests",
        (
            PanelSpec(
                "Requests by status (ingress)",
                "reqps",
                (Query(f"sum by (status_code) (rate(ray_serve_num_http_requests_total[{RATE}]))", "{{status_code}}"),),
            ),
            PanelSpec(
                "Errors by status (ingress)",
                "reqps",
                (
                    Query(
                        f"sum by (error_code) (rate(ray_serve_num_http_error_requests_total[{RATE}]))", "{{error_code}}"
                    ),
                ),
            ),
            PanelSpec(
                "Finished requests per role, by reason",
                "reqps",
                (
                    Query(
                        f"sum by ({ROLE}, finished_reason) (rate(ray_vllm_request_success_total{{{SEL}}}[{RATE}]))",
                        "{{role}} {{finished_reason}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Queues",
        (
            PanelSpec(
                "Waiting requests",
                "short",
                (Query(f"sum by ({ROLE}) (ray_vllm_num_requests_waiting{{{SEL}}})", "waiting {{role}}"),),
                "Prefill's queue growing while decode idles: more prefill replicas, or a stuck KV hand-off.",
            ),
            PanelSpec(
                "Running requests",
                "short",
                (Query(f"sum by ({ROLE}) (ray_vllm_num_requests_running{{{SEL}}})", "running {{role}}"),),
            ),
        ),
    ),
    (
        "KV cache",
        (
            PanelSpec(
                "KV-cache usage",
                "percentunit",
                (Query(f"max by ({ROLE}) (ray_vllm_kv_cache_usage_perc{{{SEL}}})", "max {{role}}"),),
            ),
            PanelSpec(
                "Prefix-cache hit rate",
                "percentunit",
                (
                    Query(
                        f"sum by ({ROLE}) (rate(ray_vllm_prefix_cache_hits_total{{{SEL}}}[{RATE}])) / "
                        f"sum by ({ROLE}) (rate(ray_vllm_prefix_cache_queries_total{{{SEL}}}[{RATE}]))",
                        "{{role}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "KV transfer (NIXL, prefill -> decode)",
        (
            PanelSpec(
                "KV bytes per request",
                "bytes",
                (
                    Query(
                        f"sum(rate(ray_vllm_nixl_bytes_transferred_sum{{{SEL}}}[{RATE}])) / "
                        f'sum(rate(ray_vllm_request_success_total{{{ROLE}="decode", {RAY_CLUSTER}=~"$cluster", model_name=~"$model"}}[{RATE}]))',
                        "bytes / request",
                    ),
                ),
                "Zero while requests succeed: decode is recomputing prompts, KV transfer is not happening.",
            ),
            PanelSpec(
                "KV transfer time",
                "s",
                (
                    Query(
                        f"sum(rate(ray_vllm_nixl_xfer_time_seconds_sum{{{SEL}}}[{RATE}])) / "
                        f"sum(rate(ray_vllm_nixl_xfer_time_seconds_count{{{SEL}}}[{RATE}]))",
                        "mean per transfer",
                    ),
                    Query(
                        f"histogram_quantile(0.99, sum by (le) (rate(ray_vllm_nixl_xfer_time_seconds_bucket{{{SEL}}}[{RATE}])))",
                        "p99 per transfer",
                    ),
                ),
                "Far above the plan's line-rate time: the transfer fell back to TCP.",
            ),
            PanelSpec(
                "Prompt tokens by source (decode)",
                "short",
                (
                    Query(
                        f'sum by (source) (rate(ray_vllm_prompt_tokens_by_source_total{{{ROLE}="decode", '
                        f'{RAY_CLUSTER}=~"$cluster", model_name=~"$model"}}[{RATE}]))',
                        "{{source}}",
                    ),
                ),
                "external_kv_transfer: arrived from prefill; local_compute: decode recomputed them.",
            ),
        ),
    ),
    (
        "Hybrid routing and limits",
        (
            PanelSpec(
                "Fallback share",
                "percentunit",
                (Query(sm.fallback_share("model", RATE, MODEL_SEL), "{{model}}"),),
                "Share of answered requests that the external fallback served (cluster unavailable, "
                "overloaded, or first token late). Empty while nothing went to the fallback.",
            ),
            PanelSpec(
                "Requests per key and destination",
                "reqps",
                (
                    Query(
                        f"sum by (key, destination) (rate({sm.REQUESTS}{{{MODEL_SEL}}}[{RATE}]))",
                        "{{key}} {{destination}}",
                    ),
                ),
                "Answered requests per API key id (k-<12 hex>; `python -m tools.keyid` maps keys to ids).",
            ),
            PanelSpec(
                "Tokens per key and destination",
                "short",
                (
                    Query(
                        f"sum by (key, destination) (rate({sm.PROMPT_TOKENS}{{{MODEL_SEL}}}[{RATE}]))",
                        "prompt {{key}} {{destination}}",
                    ),
                    Query(
                        f"sum by (key, destination) (rate({sm.COMPLETION_TOKENS}{{{MODEL_SEL}}}[{RATE}]))",
                        "completion {{key}} {{destination}}",
                    ),
                ),
                "Tokens per second as billed (each answer's usage); destination fallback is the provider's bill.",
            ),
            PanelSpec(
                "Cost per key, destination and phase (USD per hour)",
                "currencyUSD",
                (
                    Query(
                        f"3600 * sum by (key, destination, phase) (rate({sm.COST}{{{MODEL_SEL}}}[{RATE}]))",
                        "{{key}} {{destination}} {{phase}}",
                    ),
                ),
                "What each key's requests cost: on the cluster, engine time at the pools' price (prefill: "
                "prompt tokens computed; decode: output tokens); on the fallback, the provider's price. "
                "`make usage` prints it per key and day.",
            ),
            PanelSpec(
                "Prefix-cache hit share per key",
                "percentunit",
                (
                    Query(
                        f"sum by (key) (rate({sm.CACHED_TOKENS}{{{MODEL_SEL}}}[{RATE}])) / "
                        f"sum by (key) (rate({sm.PROMPT_TOKENS}{{{MODEL_SEL}}}[{RATE}]))",
                        "{{key}}",
                    ),
                ),
                "Prompt tokens served from a prefix cache over all prompt tokens. Each key has a cache of "
                "its own (limits.cacheIsolation), so a key's hits are its own prompts'.",
            ),
            PanelSpec(
                "Rate-limited requests (429) per key and limit",
                "reqps",
                (
                    Query(
                        f"sum by (key, limit) (rate({sm.RATE_LIMITED}{{{MODEL_SEL}}}[{RATE}]))",
                        "{{key}} {{limit}}",
                    ),
                ),
                "Requests refused with 429 per key id, by the limit hit (rpm, tpm, budget).",
            ),
            PanelSpec(
                "Requests past their key's budget, served elsewhere",
                "reqps",
                (
                    Query(
                        f"sum by (key, to) (rate({sm.BUDGET_OVERFLOWS}{{{MODEL_SEL}}}[{RATE}]))",
                        "{{key}} to {{to}}",
                    ),
                ),
                "Requests of keys whose budget is spent that its budget sends to the fallback or a cheaper model.",
            ),
            PanelSpec(
                "Fallback requests by reason and outcome",
                "reqps",
                (
                    Query(
                        f"sum by (reason, outcome) (rate({sm.FALLBACKS}{{{CLUSTER_SEL}}}[{RATE}]))",
                        "{{reason}} {{outcome}}",
                    ),
                ),
                "Why requests left the cluster, and whether the provider answered (ok) or not (failed).",
            ),
            PanelSpec(
                "Limiter errors",
                "ops",
                (Query(f"sum(rate({sm.LIMITER_ERRORS}{{{CLUSTER_SEL}}}[{RATE}]))", "ledger unreachable"),),
                "Limit checks skipped because the limits ledger did not answer: requests pass unlimited.",
            ),
        ),
    ),
    (
        "Faults",
        (
            PanelSpec(
                "Refused requests by reason and status (ingress)",
                "reqps",
                (
                    Query(
                        f"sum by (reason, status) (rate({sm.INGRESS_REFUSALS}{{{MODEL_SEL}}}[{RATE}]))",
                        "{{reason}} {{status}}",
                    ),
                ),
                "Requests the cluster could not serve: 503 (decode_unavailable, overloaded) or 504 "
                "(deadline), or handed to the fallback when it is configured for the reason.",
            ),
            PanelSpec(
                "Ingress retries by reason",
                "reqps",
                (
                    Query(
                        f"sum by (reason) (rate({sm.INGRESS_RETRIES}{{{CLUSTER_SEL}}}[{RATE}]))",
                        "{{reason}}",
                    ),
                ),
                "Requests sent to decode again before their first byte (a decode replica died, an engine error).",
            ),
            PanelSpec(
                "Remote prefill share (the P/D mode)",
                "percentunit",
                (Query(f"1 - ({sm.local_prefill_share('model', RATE, MODEL_SEL)})", "{{model}}"),),
                "Share of P/D requests prefilled by the prefill tier (remote, or remote after a retry). Near 100% "
                "is the designed mode; a dip during a prefill fault must come back once the replica is back "
                "(alert PDRunningAggregated).",
            ),
            PanelSpec(
                "Stream migrations",
                "reqps",
                (
                    Query(
                        f"sum by (model, reason, outcome) (rate({sm.STREAM_MIGRATIONS}{{{MODEL_SEL}}}[{RATE}]))",
                        "{{model}} {{reason}} {{outcome}}",
                    ),
                ),
                "Streams cut after their first byte (reason: replica_died, engine_error, stall) and what became of "
                "them: continued on another decode replica, or ended with an error event (failed: no replica took "
                "the continuation within the bound or the deadline; not_migratable: a request that cannot be "
                "continued). Alert PDStreamMigrationsFailing.",
            ),
            PanelSpec(
                "Prefill retries and local prefills (decode)",
                "reqps",
                (
                    Query(
                        f"sum by (reason) (rate({sm.PREFILL_RETRIES}{{{CLUSTER_SEL}}}[{RATE}]))",
                        "retry {{reason}}",
                    ),
                    Query(
                        f"sum by (reason) (rate({sm.LOCAL_PREFILLS}{{{CLUSTER_SEL}}}[{RATE}]))",
                        "local {{reason}}",
                    ),
                ),
                "Decode re-sent the prefill call, or prefilled on its own engine (prefill failed, slow, its "
                "circuit open, or the KV never arrived): served, but without disaggregation.",
            ),
            PanelSpec(
                "KV-aware prefill routing (decode)",
                "reqps",
                (
                    Query(
                        f"sum by (model, outcome) (rate({sm.KV_ROUTES}{{{MODEL_SEL}}}[{RATE}]))",
                        "{{model}} {{outcome}}",
                    ),
                ),
                "How a prefill replica was chosen where prefill.router is kv-aware: scored (by where the prompt's "
                "KV cache is, and load: the designed mode), or by load because nothing could be scored "
                "(unscored: no text prompt or no replica registered yet), the scorer was late (timeout) or "
                "failed (error). The prefix cache hit rate per role shows what scoring buys.",
            ),
            PanelSpec(
                "KV-routed prompt tokens cached where they were sent",
                "percentunit",
                (
                    Query(
                        f'sum by (model) (rate({sm.KV_ROUTE_TOKENS}{{{MODEL_SEL}, kind="cached"}}[{RATE}])) / '
                        f'sum by (model) (rate({sm.KV_ROUTE_TOKENS}{{{MODEL_SEL}, kind="prompt"}}[{RATE}]))',
                        "{{model}}",
                    ),
                ),
                "Of the prompt tokens of KV-scored requests, the share the chosen prefill replica already held "
                "in its KV cache (by the index built from the engines' KV events): the prefill compute routing "
                "saved. It falls when prompts stop sharing prefixes or the caches evict them.",
            ),
            PanelSpec(
                "KV scorer's round trip, mean per request (decode)",
                "s",
                (
                    Query(
                        f"sum by (model) (rate({sm.KV_ROUTE_WAIT}{{{MODEL_SEL}}}[{RATE}])) / "
                        f'sum by (model) (rate({sm.KV_ROUTES}{{{MODEL_SEL}, outcome!="skipped"}}[{RATE}]))',
                        "{{model}}",
                    ),
                ),
                "How long decode waited for the scorer's choice before each KV-routed prefill call: time "
                "every such request adds to its time to first token, against what a cache hit saves. "
                "It climbs toward the scorer's timeout when the scorer falls behind (then timeouts rise).",
            ),
            PanelSpec(
                "KV scorer: prefill bookings outstanding",
                "none",
                (
                    Query(
                        f'sum by (model) ({sm.KV_BOOKINGS}{{{MODEL_SEL}, event="booked"}}) - '
                        f'sum by (model) ({sm.KV_BOOKINGS}{{{MODEL_SEL}, event="freed"}})',
                        "{{model}}",
                    ),
                ),
                "Prefill load the scorer booked on the replicas it chose and has not yet seen freed (the engine "
                "reports a request finished; decode releases a call that never reached one). It follows the "
                "prefill tier's in-flight requests; a count that only grows means lifecycle reports are lost and "
                "the scorer sees those replicas busier than they are (Ray sweeps a booking after an hour).",
            ),
        ),
    ),
    (
        "GPUs (DCGM)",
        (
            PanelSpec(
                "GPU utilisation", "percent", (Query("avg by (Hostname) (DCGM_FI_DEV_GPU_UTIL)", "{{Hostname}}"),)
            ),
            PanelSpec(
                "HBM used",
                "percentunit",
                (
                    Query(
                        "sum by (Hostname) (DCGM_FI_DEV_FB_USED) / "
                        "sum by (Hostname) (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)",
                        "{{Hostname}}",
                    ),
                ),
            ),
            PanelSpec("Power", "watt", (Query("sum by (Hostname) (DCGM_FI_DEV_POWER_USAGE)", "{{Hostname}}"),)),
            PanelSpec(
                "XID errors (last XID per GPU)",
                "none",
                (Query("max by (Hostname, gpu) (DCGM_FI_DEV_XID_ERRORS) > 0", "{{Hostname}} GPU {{gpu}}"),),
            ),
        ),
    ),
    (
        "Nodes (Cluster Autoscaler)",
        (
            PanelSpec(
                "Unschedulable pods (node autoscaler)",
                "short",
                (Query("sum by (type) (cluster_autoscaler_unschedulable_pods_count)", "{{type}}"),),
                "Pods the node autoscaler sees as unschedulable; Ray workers waiting for a GPU node show here "
                "while a node is added.",
            ),
            PanelSpec(
                "Node scale-ups per hour",
                "short",
                (
                    Query(
                        "sum by (gpu_name) (increase(cluster_autoscaler_scaled_up_gpu_nodes_total[1h]))",
                        "added {{gpu_name}}",
                    ),
                    Query(
                        "sum by (reason) (increase(cluster_autoscaler_failed_scale_ups_total[1h]))", "failed {{reason}}"
                    ),
                ),
                "GPU nodes added, and scale-ups that failed (cloudProviderError: no capacity or quota; timeout: "
                "the node did not join within max-node-provision-time).",
            ),
        ),
    ),
)
