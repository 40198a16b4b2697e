"""One pydantic-settings class per process kind; all read `KVGATE_*` from the environment."""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

RouteKind = Literal["chat", "completions", "responses", "messages"]
MAX_TIMEOUT_S = 7 * 86400  # the longest any request may be allowed to run (a week)


class RouteTimeout(BaseModel):
    """One route kind's limits in KVGATE_ROUTE_TIMEOUTS; a field left out keeps the default."""

    model_config = ConfigDict(extra="forbid")

    ttft_s: float | None = Field(None, ge=0, le=MAX_TIMEOUT_S, description="To the first token "
                                 "(0: no limit but the total)")
    total_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, description="In total")


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Where every process finds Redis "
                           "(AUTH in the URL; rediss:// for TLS; sentinel mode: the sentinels, "
                           "comma-separated host:port)")
    redis_mode: Literal["single", "cluster", "sentinel"] = Field(
        "single", description="single (one Redis), cluster (Redis Cluster; the URL names any one "
        "node) or sentinel (the URL names the sentinels)")
    redis_sentinel_service: str | None = Field(None, description="Sentinel mode: the name of the "
                                               "master the sentinels watch (required there)")
    redis_ca_file: Path | None = Field(None, description="CA certificates that rediss:// servers "
                                       "(Redis and the Celery broker) are verified against "
                                       "(default: the system's)")
    broker_url: str | None = Field(None, description="Celery's broker (default: KVGATE_REDIS_URL in "
                                   "single mode; required in cluster and sentinel modes: Celery's "
                                   "Redis transport cannot use a cluster)")
    secrets_dir: Path | None = Field(None, description="A folder of files named like KVGATE_* "
                                     "variables, one value each (`kvgate init-secrets` writes "
                                     "them; compose keeps them on a volume): a variable left unset "
                                     "takes its file's value")
    log_level: str = Field("INFO", description="Logging level")
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP collector traces go to "
                                      "(e.g. http://otel-collector:4318); unset: no tracing")


class FilesSettings(CommonSettings):
    """What the gateway (uploads, downloads) and the services (batch runs) share: the files."""

    data_dir: Path = Field(Path(".kvgate/data"), description="Where uploaded and generated files "
                           "are kept (shared by the gateway and the Celery worker)")
    file_retention_days: float = Field(30.0, gt=0, description="Files (and finished batches) are "
                                       "deleted this long after they were made")

    @property
    def file_retention_s(self) -> float:
        return self.file_retention_days * 86400


class GatewaySettings(FilesSettings):
    host: str = Field("127.0.0.1", description="Bind address (loopback by default)")
    port: int = Field(8000, description="HTTP port")
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto", description="uvicorn's event loop for the gateway (`--loop`): auto takes uvloop "
        "when installed (uvicorn[standard] installs it); asyncio is the standard library's")
    http_parser: Literal["auto", "httptools", "h11"] = Field(
        "auto", description="uvicorn's HTTP/1.1 implementation for the gateway (`--http`): auto "
        "takes httptools when installed; h11 is pure Python")
    http_keepalive_s: int = Field(
        75, ge=1, le=3600, description="Seconds an idle client connection stays open (uvicorn's "
        "--timeout-keep-alive, 5 by default there): longer than a client's own pool keeps one (the "
        "openai client's httpx: 5 s), so the client, not the server, closes it first, and a request "
        "sent as the server hangs up never fails")
    ssl_certfile: Path | None = Field(None, description="TLS: the gateway's certificate chain "
                                      "(PEM); with KVGATE_SSL_KEYFILE the port speaks HTTPS only")
    ssl_keyfile: Path | None = Field(None, description="TLS: the private key of "
                                     "KVGATE_SSL_CERTFILE (PEM)")
    api_key: SecretStr | None = Field(None, description="Bootstrap user key, valid besides the keys in Redis")
    secret: SecretStr | None = Field(None, description="Server secret that keys are HMAC-ed with (required)")
    admin_key: SecretStr | None = Field(None, description="Bootstrap admin key: the way into /admin")
    default_rpm: int = Field(10_000, ge=1, description="Requests per minute of a key that sets none")
    default_tpm: int = Field(10_000_000, ge=1, description="Tokens per minute of a key that sets none")
    redis_max_connections: int = Field(256, ge=2, description="Redis connections per gateway process")
    redis_idle_timeout_s: float = Field(30.0, ge=0, description="Seconds a pooled Redis connection of a "
                                        "gateway may sit idle before it is closed (0: never)")
    key_cache_s: float = Field(2.0, ge=0, le=60, description="Seconds a gateway keeps a key record it looked "
                               "up; a change made through any gateway or the CLI drops every copy at once "
                               "(pub/sub), this bounds a missed message (0: look up every request)")
    usage_retention_days: int = Field(400, ge=1, description="Days per-key usage counters are kept")
    gateway_id: str = Field(default_factory=lambda: secrets.token_hex(6),
                            description="Names this process's reply channel")
    max_stream_depth: int = Field(1000, ge=1, description="Waiting + in-flight requests per model "
                                  "version beyond which the gateway answers 503 (backpressure)")
    drain_grace_s: float = Field(30.0, ge=0, description="On SIGTERM: time to finish open streams")
    fair_queue_per_key: int = Field(16, ge=0, le=4096, description="A key's interactive requests "
                                    "one gateway keeps waiting on a model version's stream (sent, not "
                                    "yet admitted by a worker); its next ones wait in the gateway, so "
                                    "no tenant's flood fills the stream beyond the workers' fair "
                                    "look-ahead (gateway/queue_gate.py; 0: no limit)")
    max_body_bytes: int = Field(1 << 20, ge=1, description="Largest request body accepted (413 above)")
    max_entry_bytes: int = Field(1 << 20, ge=1024, description="Largest queue entry one request may "
                                 "put in Redis (413 above); Redis holds at most "
                                 "KVGATE_MAX_STREAM_DEPTH of them per model version")
    request_timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S, description="Total time a "
                                     "request may take (504 timeout beyond, and it is cancelled)")
    ttft_timeout_s: float = Field(0.0, ge=0, le=MAX_TIMEOUT_S, description="Time an interactive "
                                  "request may wait for its first token (504 ttft_timeout beyond, "
                                  "and it is cancelled; 0: no limit but the total)")
    route_timeouts: dict[RouteKind, RouteTimeout] = Field(
        default_factory=dict, description="Per route kind (chat, completions, responses, "
        "messages), JSON replacing the two defaults above, e.g. "
        '{"chat": {"ttft_s": 20, "total_s": 300}}; a key\'s own limits replace these')
    keepalive_s: float = Field(5.0, description="SSE keep-alive comment interval while waiting")
    retries_before_first_token: int = Field(1, ge=0, le=5, description="Times a request that "
                                            "failed on a worker before its first token (engine "
                                            "error, failed step, unresumable takeover) is sent "
                                            "again: to the same version, or a canary's stable one")
    breaker_failures: int = Field(10, ge=0, le=100_000, description="Failures (5xx answers and "
                                  "timeouts, also those a retry absorbed) of one model version "
                                  "within KVGATE_BREAKER_WINDOW_S that open its circuit breaker, "
                                  "shared by every gateway (0: no breaker)")
    breaker_window_s: float = Field(30.0, gt=0, le=86400, description="The window failures are "
                                    "counted over for the circuit breaker")
    breaker_open_s: float = Field(30.0, gt=0, le=86400, description="How long an open breaker "
                                  "refuses its version (503 + Retry-After, or a canary's requests "
                                  "go to stable) before one probe request may try it; also how "
                                  "long a probe may take to its first token")
    resume_grace_s: float = Field(3.0, ge=0, le=300, description="A streamed request whose client "
                                  "went away keeps running this long, so the client can resume it "
                                  "(Last-Event-ID) at any gateway; then it is cancelled and its "
                                  "usage settled (0: cancelled at once)")
    admission_wait_s: float = Field(5.0, ge=0, description="How long a streamed request waits for "
                                    "its worker's admission verdict before the 200 and keep-alives "
                                    "go out (an error known by then is an HTTP error, one after it "
                                    "an SSE error event; 0: at once)")
    max_resumes_per_minute: int = Field(10, ge=1, le=10_000, description="Resumes of one stream "
                                        "(Last-Event-ID) a minute; beyond, 429 with Retry-After")
    max_answer_logprobs: int = Field(262144, ge=1, description="Log-probabilities (each token's "
                                     "and each of its top alternatives count one) a non-streamed "
                                     "answer may carry, ~330 bytes each held in the gateway; "
                                     "beyond, 400 answer_too_large (a stream has no such bound)")
    max_unread_replies: int = Field(16384, ge=1, description="Replies (a choice's token or tokens "
                                    "each) one streamed request may leave unread in the gateway "
                                    "while its client does not read; beyond, the stream ends with "
                                    "client_not_reading and its worker stops")
    client_read_timeout_s: float = Field(30.0, gt=0, le=MAX_TIMEOUT_S, description="Longest a "
                                         "client may take to send its request's head (the "
                                         "connection is closed beyond), and between pieces of its "
                                         "body (408 beyond)")
    max_head_bytes: int = Field(65536, ge=1024, le=1 << 24, description="Longest request head "
                                "(request line and headers) a client may send; beyond, the "
                                "connection is answered 431 and closed")
    client_write_timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S, description="Longest a "
                                          "client may take to read the next piece (64 KiB) of "
                                          "its response; beyond, the response ends and a "
                                          "stream's request is cancelled (gateway/client_writes.py)")
    max_unread_replies_total: int = Field(262144, ge=1, description="The same for all of one "
                                          "gateway process's requests together: beyond, the "
                                          "request with the most unread ends")
    grammar_check_timeout_s: float = Field(2.0, gt=0, description="Longest the gateway spends "
                                           "compiling a request's JSON schema, regex or grammar "
                                           "to check it (400 beyond: simplify it)")
    grammar_check_processes: int = Field(2, ge=1, le=64, description="Checks of schemas, regexes "
                                         "and grammars run at once, each in a child process of "
                                         "the gateway's checker (one per API key at a time)")
    grammar_check_memory_mb: int = Field(1024, ge=64, description="Memory one request's checks "
                                         "may take in the checker (400 beyond: simplify it)")
    default_reserve_tokens: int = Field(2048, ge=0, description="Completion tokens a request "
                                        "without max_tokens reserves against its key's TPM and "
                                        "daily budget (capped at the context its prompt leaves; "
                                        "settled to the actual usage at the end)")
    max_file_bytes: int = Field(64 << 20, ge=1, description="Largest file /v1/files accepts "
                                "(413 above)")
    max_file_lines: int = Field(50_000, ge=1, description="Most lines (requests) a batch input "
                                "file may have (400 above)")
    max_stored_bytes_per_key: int = Field(10 << 30, ge=0, le=1 << 50, description="Bytes of files "
                                          "(uploads and batch results) a key may keep, unless its "
                                          "max_stored_bytes says otherwise (429 above)")
    max_files_per_key: int = Field(1000, ge=0, le=100_000, description="Files a key may keep, "
                                   "unless its max_files says otherwise (429 above)")
    max_batches_in_progress_per_key: int = Field(10, ge=0, le=10_000, description="Batches of a "
                                                 "key not yet in a final status, unless its "
                                                 "max_batches_in_progress says otherwise (429 above)")
    response_retention_days: float = Field(30.0, gt=0, description="How long /v1/responses keeps "
                                           "a stored response (store: true, the default) for "
                                           "GET and previous_response_id")
    max_stored_response_bytes_per_key: int = Field(256 << 20, ge=0, le=1 << 40, description="Bytes "
                                                   "of stored responses a key may keep (a request "
                                                   "with store: true is refused with 429 above; "
                                                   "delete some, or send store: false)")
    interactive_mark_ms: int = Field(1000, ge=0, description="Batch lines of a model run at most "
                                     "KVGATE_BATCH_CONCURRENCY_BUSY at a time until this long after "
                                     "its last interactive request (0: batches never yield)")
    worker_stale_s: float = Field(3.0, gt=0, description="A worker whose last heartbeat is older "
                                  "gets no canary-routed traffic (failover to another version)")
    auth_failures_per_minute: int = Field(60, ge=1, description="Failed authentications (no, "
                                          "unknown, revoked or expired key) a client address may "
                                          "make per minute, per gateway process; beyond, every "
                                          "request from it that needs a key gets 429")
    public_per_minute: int = Field(1200, ge=1, description="Requests per minute a client address "
                                   "may make to /healthz, /readyz and /metrics together, per "
                                   "gateway process (429 beyond)")


class WorkerSettings(CommonSettings):
    """The engine knobs among these carry EngineConfig's names and defaults: the worker fills it
    from them by name, and `kvgate worker` has an option of each name (tests/worker/test_engine_knobs.py)."""

    model: str = Field("", description="Local Hugging Face model folder")
    served_name: str = Field("", description="Model name clients ask for (default: the model "
                             "folder's name)")
    version: str = Field("v1", description="Version of the served name this worker serves")
    engine: str = Field("paged", description="paged (continuous batching) or hf (naive baseline)")
    device: str = Field("auto", description="cpu, cuda or auto")
    dtype: str = Field("auto", description="float32, bfloat16, float16 or auto (GPU: the "
                       "checkpoint's; CPU: fp32, or bf16 where the CPU has native bf16, the "
                       "checkpoint is 16-bit and a start-up measurement finds it faster)")
    max_num_seqs: int = Field(64, description="Cap on concurrently running sequences")
    max_num_batched_tokens: int | None = Field(None, description="Token budget per engine step "
                                               "(default: 2048 on CUDA, 256 on CPU)")
    max_model_len: int | None = Field(None, ge=1, description="Context cap (default: the "
                                      "model's, lowered to what the KV cache holds; an explicit "
                                      "one the KV cache cannot hold stops the worker at start-up)")
    block_size: int = Field(16, description="Tokens per KV block")
    kv_cache_memory: int | None = Field(None, ge=1, description="KV cache bytes on CPU (default: "
                                        "half the memory available after the weights load, at "
                                        "least 256 MiB, at most 32 GiB and what max_num_seqs "
                                        "sequences of max_model_len tokens could use)")
    gpu_memory_utilization: float = Field(0.9, description="Share of GPU memory to use on CUDA")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prefixes")
    torch_threads: int | None = Field(None, ge=1, description="Torch intra-op threads on CPU "
                                      "(default: torch's, one per core; `kvgate up` gives the "
                                      "worker half the cores, shared with gateway, Redis, Celery)")
    attention_backend: str = Field("auto", description="auto (triton on CUDA; on CPU torch with the "
                                   "native fp32 kernels, docs/engine.md), torch (pure torch) or triton")
    cpu_linear_kernel: str = Field("auto", description="The linears' GEMM path on CPU: auto "
                                   "(oneDNN or MKL over row-major, transposed or oneDNN-packed "
                                   "weights, or kvgate's own GEMM over weights in panels: timed at "
                                   "load on the model's own weights, fp32 on CPU) or one of onednn, "
                                   "aten, onednn_t, aten_t, onednn_p, native (forced; "
                                   "`kvgate_engine_kernel_info` says which ran)")
    enforce_eager: bool = Field(False, description="No CUDA graphs for decode steps (on CUDA they "
                                "are captured at start-up)")
    reasoning_parser: str | None = Field(None, description="How the model marks its thinking "
                                         "(qwen3, deepseek_r1, harmony; default: from the chat template): "
                                         "thinking goes to reasoning_content")
    tool_call_parser: str | None = Field(None, description="How the model writes tool calls (hermes, "
                                         "llama3; default: from the chat template)")
    task: Literal["auto", "generate", "embed", "score"] = Field(
        "auto", description="What the worker serves: auto (embeddings for an embedding model folder — "
        "sentence-transformers pooling files, or a bare base model such as MistralModel —, scores for a "
        "<X>ForSequenceClassification reranker, else generation), generate, embed (a causal LM's "
        "last-token state, normalized, as vLLM's embed task) or score (a causal LM as a reranker, by "
        "score_tokens)")
    score_tokens: str = Field("", description="Task score on a causal LM: the answer tokens whose logits "
                              "score a pair, comma-separated (Qwen3-Reranker: no,yes — the score is P(yes); "
                              "one token: the sigmoid of its logit), as vLLM's classifier_from_token")
    score_template: str | None = Field(None, description="A reranker's pair template: a Jinja chat "
                                       "template file over messages of roles query and document (vLLM's "
                                       "score template), or a bundled one's name (qwen3_reranker); "
                                       "default: the tokenizer's pair encoding")
    generation_config: Literal["auto", "none"] = Field(
        "auto", description="auto: a request that leaves temperature, top_p, top_k, min_p or "
        "repetition_penalty out gets the model folder's generation_config.json value, where it sets "
        "one (vLLM's default); none: OpenAI's defaults")
    structured_compile_timeout_s: float = Field(10.0, gt=0, description="A structured_outputs grammar "
                                                "not compiled by then ends its request with a 400 "
                                                "(the batch never waits for a compile)")
    structured_max_spec_bytes: int = Field(65536, ge=1, description="Largest JSON schema, regex, "
                                           "choice list or grammar the worker compiles (larger: 400)")
    structured_cache_mb: float = Field(512.0, gt=0, description="Memory the worker's compiled "
                                       "structured_outputs grammars may hold (least recently used "
                                       "dropped first; vLLM's VLLM_XGRAMMAR_CACHE_MB); a grammar "
                                       "larger than all of it is refused with a 400")
    structured_max_token_ms: float = Field(20.0, gt=0, description="Most CPU time matching an "
                                           "output token against a structured_outputs grammar may "
                                           "take (its mask and its accept), on average over a "
                                           "choice's last 16 tokens; more ends the request with a "
                                           "400 (an ambiguous grammar's matching grows with the "
                                           "output, on the step loop)")
    tensor_parallel_size: int = Field(1, ge=1, description="Processes the model is sharded across "
                                      "(tensor parallelism; one GPU each on CUDA, gloo on CPU): the "
                                      "worker starts the other ranks itself")
    tensor_parallel_timeout_s: float = Field(60.0, gt=0, description="A tensor-parallel collective "
                                             "that waits longer fails, and the worker stops all its "
                                             "ranks and exits non-zero (a dead rank stops it at once)")
    fair_order: bool = Field(True, description="Admit queued requests token-fairly across tenants "
                             "(API keys): within a priority, the tenant served the fewest tokens "
                             "(divided by its key's weight) goes first (worker/fairness.py); false: "
                             "first in, first out")
    fair_yield: bool = Field(True, description="Under the fair order on the paged engine, a full "
                             "batch makes room for a tenant below its weighted share of the sequence "
                             "slots: a tenant above its share, served more, yields one sequence "
                             "(preempted, recomputed later); false: it waits for a slot to free")
    fair_lookahead: int = Field(64, ge=1, le=4096, description="Under the fair order, entries per lane "
                                "the worker reads ahead of its engine's room so it can choose (they "
                                "stay pending in Redis: a crash loses none)")
    hold_s: float = Field(1.0, ge=0, le=60, description="A whole (non-streamed) answer's deltas after "
                          "its first token are held and sent together when a choice ends, or after this "
                          "many seconds (0: each as it is made, like a stream's)")
    first_hold_s: float = Field(0.02, ge=0, le=1, description="A whole answer's admission verdict and "
                                "first token wait at most this long (or KVGATE_HOLD_S, if shorter), so "
                                "an answer done by then goes out in one message (0: at once)")
    heartbeat_s: float = Field(1.0, description="Heartbeat period")
    heartbeat_ttl_s: float = Field(10.0, description="Registry entry TTL; also how long a dead "
                                   "worker's requests stay unclaimed")
    drain_grace_s: float = Field(30.0, ge=0, description="On SIGTERM: time to finish in-flight "
                                 "requests before leaving the rest for other workers")
    worker_id: str = Field(default_factory=lambda: secrets.token_hex(6), description="Consumer name")
    max_deliveries: int = Field(3, ge=1, description="Poison cap: an entry already delivered this "
                                "many times (workers that took it and never finished it) is answered "
                                "with request_failed_repeatedly and retired instead of handed on")
    max_checkpoint_bytes: int = Field(4 << 20, ge=4096, description="Bytes of one request's "
                                      "checkpoint log in Redis; past it the worker stops appending "
                                      "(streaming goes on) and a takeover answers resume_failed")
    fault_error_rate: float = Field(0.0, ge=0, le=1, description="Tests only: share of requests "
                                    "answered with an engine error")
    fault_latency_ms: float = Field(0.0, ge=0, description="Tests only: delay before admitting a "
                                    "request (so before its first token)")
    fault_step_ms: float = Field(0.0, ge=0, le=10_000, description="Tests only: a pause after every "
                                 "engine step (a slow device)")
    fault_crash_marker: str | None = Field(None, min_length=1, description="Tests only: a worker "
                                           "that admits a request whose prompt contains this string "
                                           "exits at once (os._exit), like a crash no code can catch")
    metrics_host: str = Field("127.0.0.1", description="Bind address of the worker's /metrics")
    metrics_port: int = Field(0, ge=0, description="Port of the worker's /metrics (0: any free "
                              "port; the URL is in its registry entry)")
    metrics_ssl_certfile: Path | None = Field(None, description="TLS: certificate chain (PEM) "
                                              "of the worker's /metrics; with "
                                              "KVGATE_METRICS_SSL_KEYFILE it speaks HTTPS only")
    metrics_ssl_keyfile: Path | None = Field(None, description="TLS: the private key of "
                                             "KVGATE_METRICS_SSL_CERTFILE (PEM)")

    @model_validator(mode="after")
    def _name_from_folder(self) -> WorkerSettings:
        if not self.served_name and self.model:
            self.served_name = served_name_for(self.model)
        return self


def served_name_for(model_dir: str | Path) -> str:
    """What a model folder is served as by default: its name (`Qwen3-0.6B`); a Hugging Face cache
    snapshot (`models--Qwen--Qwen3-0.6B/snapshots/<hash>`) is named after its repository."""
    path = Path(os.path.abspath(Path(model_dir).expanduser()))  # `.` and `..` resolved, links kept
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--")[-1]
    return path.name


class ServicesSettings(FilesSettings):
    canary_check_s: float = Field(10.0, gt=0, description="How often Celery beat runs the canary check")
    maintenance_s: float = Field(30.0, gt=0, description="How often Celery beat reaps dead workers, "
                                 "expires files, restarts stalled batches and rolls up usage")
    gateway_url: str = Field("http://127.0.0.1:8000", description="Where batch lines are sent (the "
                             "gateway's own API, so they are governed like any request)")
    secret: SecretStr | None = Field(None, description="The gateway's server secret: batch lines "
                                     "carry a token derived from it (required to run batches)")
    batch_concurrency: int = Field(8, ge=1, description="Lines of one batch in flight at once")
    batch_concurrency_busy: int = Field(1, ge=0, description="Lines of one batch in flight while "
                                        "the model has interactive traffic (0: the batch waits "
                                        "until there is none)")
    batch_busy_duty: float = Field(0.25, gt=0, le=1, description="Share of the time a batch's "
                                   "sender sends while its model has interactive traffic (it rests "
                                   "after each line in proportion to how long the line took)")
    batch_max_running: int = Field(2, ge=1, description="Batches run at once (the rest wait)")
    batch_max_attempts: int = Field(8, ge=1, description="Tries of a line that meets 503 or a "
                                    "connection error (429s only slow the batch down)")
