"""The `kvgate` console script. Each subcommand is a thin front for one process or tool."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import click

ENGINES = ["paged", "hf", "synthetic"]  # hf: the naive baseline; synthetic: no model, for load tests


@click.group()
def main() -> None:
    """kvgate: an LLM gateway and paged-KV workers that meet at Redis."""
    _secrets_from_dir()  # before a subcommand reads its options' variables


def _secrets_from_dir() -> None:
    """KVGATE_* variables left unset take the files of KVGATE_SECRETS_DIR (compose's volume)."""
    if folder := os.environ.get("KVGATE_SECRETS_DIR"):
        from kvgate.secrets_dir import load_into_env

        load_into_env(Path(folder))


@main.command("init-secrets")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--redis-host", default="redis", show_default=True,
              help="Host in the KVGATE_REDIS_URL written")
def init_secrets(directory: str, redis_host: str) -> None:
    """Write the server secret, an admin key, a first user key and Redis's password (with the
    URL and redis.conf that use it) into DIRECTORY, each unless it is there (mode 0600)."""
    from kvgate.secrets_dir import init_secrets as write

    written = write(Path(directory), redis_host=redis_host)
    click.echo(f"{directory}: wrote {', '.join(written)}" if written
               else f"{directory}: every secret is there already")


@main.command()
@click.argument("url")
@click.option("--cafile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Trust this CA for an https:// URL [default: the system's]")
def probe(url: str, cafile: str | None) -> None:
    """Exit 0 if URL answers 2xx within 3 s, else 1 with the reason (compose's healthchecks run the
    same as `python -m kvgate.probe`, which starts faster)."""
    from kvgate.probe import probe as check

    if why := check(url, cafile):
        raise click.ClickException(why)


@main.command("dev-cert")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--host", "hosts", multiple=True, help="A name or address the certificate is for "
              "(repeat) [default: localhost, 127.0.0.1, ::1]")
def dev_cert(directory: str, hosts: tuple[str, ...]) -> None:
    """A development CA and a server certificate it signs, in DIRECTORY (ca.pem, server.pem,
    server.key), made once and reused while they cover the hosts."""
    from kvgate.tls import DEFAULT_HOSTS, dev_certs

    certs = dev_certs(Path(directory), tuple(hosts) or DEFAULT_HOSTS)
    click.echo(f"CA (clients trust it): {certs.ca}\ncertificate: {certs.cert}\nkey: {certs.key}")


@main.command("demo-model")
@click.argument("directory", type=click.Path(file_okay=False))
def demo_model(directory: str) -> None:
    """Write the small random-weight demo Llama (with tokenizer and chat template) to DIRECTORY."""
    from worker.models.demo import build_model_dir

    path = build_model_dir(directory)
    click.echo(f"demo model written to {path}")


@main.command()
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False),
              help="Local Hugging Face model folder")
@click.option("--served-name", envvar="KVGATE_SERVED_NAME", default=None,
              help="Model name clients ask for [default: the model folder's name]")
@click.option("--version", "version_", envvar="KVGATE_VERSION", default="v1", show_default=True)
@click.option("--engine", type=click.Choice(ENGINES), envvar="KVGATE_ENGINE", default="paged",
              show_default=True, help="synthetic: no model, fixed tokens (load tests of the serving path)")
@click.option("--redis-url", envvar="KVGATE_REDIS_URL", default="redis://127.0.0.1:6379/0",
              show_default=True)
@click.option("--device", default=None, help="cpu, cuda or auto [default: auto]")
@click.option("--dtype", default=None, help="float32, bfloat16, float16 or auto [default: auto]")
@click.option("--max-num-seqs", type=int, default=None)
@click.option("--max-num-batched-tokens", type=int, default=None)
@click.option("--max-model-len", type=int, default=None)
@click.option("--block-size", type=int, default=None)
@click.option("--kv-cache-memory", type=int, default=None,
              help="KV cache bytes on CPU [default: measured, half the memory left after the weights]")
@click.option("--gpu-memory-utilization", type=float, default=None)
@click.option("--prefix-caching/--no-prefix-caching", "enable_prefix_caching", default=None,
              help="Reuse KV blocks of shared prefixes [default: on]")
@click.option("--attention-backend", type=click.Choice(["auto", "torch", "triton"]), default=None,
              help="auto: triton on CUDA, torch with native fp32 kernels on CPU [default: auto]")
@click.option("--cpu-linear-kernel", type=click.Choice(["auto", "onednn", "aten", "onednn_t", "aten_t", "onednn_p", "native"]),
              default=None, help="The linears' GEMM path on CPU [default: auto, timed at load]")
@click.option("--enforce-eager", is_flag=True, default=None, help="No CUDA graphs for decode steps")
@click.option("--reasoning-parser", type=click.Choice(["qwen3", "deepseek_r1", "harmony"]), default=None,
              help="How the model marks its thinking [default: from the chat template]")
@click.option("--task", type=click.Choice(["auto", "generate", "embed", "score"]), default=None,
              help="auto: embeddings for an embedding model folder, scores for a reranker's, else "
                   "generation [default: auto]")
@click.option("--score-tokens", default=None,
              help="Task score on a causal LM: its answer tokens, comma-separated (Qwen3-Reranker: no,yes)")
@click.option("--score-template", default=None,
              help="A reranker's pair template: a Jinja file over messages of roles query and document, or "
                   "a bundled one's name (qwen3_reranker) [default: the tokenizer's pair encoding]")
@click.option("--tool-call-parser", type=click.Choice(["hermes", "llama3"]), default=None,
              help="How the model writes tool calls [default: from the chat template]")
@click.option("--structured-compile-timeout-s", type=float, default=None,
              help="A grammar not compiled by then fails its request [default: 10]")
@click.option("--structured-max-spec-bytes", type=int, default=None,
              help="Largest schema, regex, choice list or grammar compiled [default: 65536]")
@click.option("--structured-cache-mb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Memory compiled grammars may hold; a larger grammar is refused [default: 512]")
@click.option("--structured-max-token-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="CPU a grammar's matching may take a token (mean of 16) [default: 20]")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=None,
              help="Processes (GPUs on CUDA) the model is sharded across [default: 1]")
@click.option("--tensor-parallel-timeout-s", type=float, default=None,
              help="A collective waiting longer stops the worker [default: 60]")
@click.option("--fault-error-rate", type=click.FloatRange(0, 1), default=None,
              help="Tests: answer this share of requests with an engine error")
@click.option("--fault-latency-ms", type=click.FloatRange(min=0), default=None,
              help="Tests: wait this long before admitting each request")
@click.option("--metrics-port", type=int, default=None,
              help="Port of the worker's /metrics [default: KVGATE_METRICS_PORT, else 0 = any free]")
@click.option("--metrics-host", default=None, help="Bind address of /metrics [default: 127.0.0.1]")
def worker(model, served_name, version_, engine, redis_url, **engine_opts) -> None:
    """Serve MODEL from the stream of (served name, version)."""
    from shared.settings import WorkerSettings
    from worker.main import run_worker

    # options are named as the settings (tests/worker/test_engine_knobs.py): given ones override
    overrides = {k: v for k, v in engine_opts.items() if v is not None}
    if served_name:
        overrides["served_name"] = served_name
    settings = WorkerSettings(model=model, version=version_, engine=engine, redis_url=redis_url,
                              **overrides)
    run_worker(settings)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--redis-url", envvar="KVGATE_REDIS_URL", default="redis://127.0.0.1:6379/0",
              show_default=True)
@click.option("--workers", type=int, default=1, show_default=True, help="Gateway processes")
@click.option("--ssl-certfile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Serve HTTPS (only) with this certificate chain [default: KVGATE_SSL_CERTFILE]")
@click.option("--ssl-keyfile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The certificate's private key [default: KVGATE_SSL_KEYFILE]")
def gateway(host: str, port: int, redis_url: str, workers: int, ssl_certfile: str | None,
            ssl_keyfile: str | None) -> None:
    """Run the gateway (secrets come from KVGATE_SECRET, KVGATE_ADMIN_KEY, KVGATE_API_KEY, or
    files named so in KVGATE_SECRETS_DIR, never the command line)."""
    import uvicorn

    os.environ["KVGATE_REDIS_URL"] = redis_url
    os.environ["KVGATE_HOST"], os.environ["KVGATE_PORT"] = host, str(port)
    if not os.environ.get("KVGATE_SECRET"):
        raise click.UsageError("set KVGATE_SECRET: the server secret API keys are HMAC-ed with")
    from shared import logs
    from shared.settings import GatewaySettings

    settings = GatewaySettings()
    logs.setup(settings.log_level, "gateway")
    _raise_open_files()
    grace = settings.drain_grace_s  # SIGTERM: stop accepting, let open streams finish
    certfile, keyfile = ssl_certfile or settings.ssl_certfile, ssl_keyfile or settings.ssl_keyfile
    if bool(certfile) != bool(keyfile):
        raise click.UsageError("TLS needs both a certificate (--ssl-certfile, KVGATE_SSL_CERTFILE) "
                               "and its key (--ssl-keyfile, KVGATE_SSL_KEYFILE)")
    for path in (certfile, keyfile):
        if path and not Path(path).is_file():  # from the environment: the option checked its own
            raise click.UsageError(f"TLS: no file {path}")
    with _metrics_dir():  # before prometheus_client is imported here or in any worker process
        # with TLS the port speaks only TLS: a plain HTTP request fails its handshake, no redirect
        uvicorn.run("gateway.app:create_app_from_env", factory=True, host=host, port=port,
                    workers=workers, log_level="warning", log_config=None,
                    timeout_graceful_shutdown=int(grace),
                    loop=settings.event_loop, http=_http_protocol(settings.http_parser),
                    timeout_keep_alive=settings.http_keepalive_s,
                    h11_max_incomplete_event_size=settings.max_head_bytes,
                    ssl_certfile=str(certfile) if certfile else None,
                    ssl_keyfile=str(keyfile) if keyfile else None)


def _raise_open_files() -> None:
    """The soft limit on open files up to the hard one, for this process and the gateway processes
    it starts (what nginx's worker_rlimit_nofile and Go's runtime do). Every client connection is a
    descriptor, and so is every Redis connection: at the usual soft limit of 1024 (256 here in the
    test) a few hundred idle connections from anyone left the gateway resetting every new one, and
    unable to open the Redis connections its requests need, until the head deadline freed them."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):  # a platform that refuses: keep what it gave
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _http_protocol(parser: str):
    """httptools (auto's choice when installed) with a deadline on request heads; h11 as uvicorn has it."""
    if parser == "h11" or importlib.util.find_spec("httptools") is None:
        return parser
    from gateway.http_protocol import HeadDeadlineProtocol

    return HeadDeadlineProtocol


@contextlib.contextmanager
def _metrics_dir():
    """PROMETHEUS_MULTIPROC_DIR for this gateway's processes, so /metrics sums all of them: a
    fresh folder removed at exit, or the one given, emptied of an earlier run's files."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    folder = Path(given) if given else Path(tempfile.mkdtemp(prefix="kvgate-metrics-"))
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.db"):
        stale.unlink()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    if not given:
        _remove_on_signal(folder)
    try:
        yield
    finally:
        if not given:
            shutil.rmtree(folder, ignore_errors=True)


def _remove_on_signal(folder: Path) -> None:
    """uvicorn shuts down on SIGTERM or SIGINT, then raises the signal again with the handlers it
    found (ours, set here) so the process ends as killed by it: the `finally` above never runs.
    Each stop left its folder in /tmp. The handler removes it, then lets the signal end the
    process as before (the same exit status)."""
    import signal

    def remove_then_resignal(signum, frame) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        signal.signal(signum, previous[signum])
        signal.raise_signal(signum)

    previous = {sig: signal.signal(sig, remove_then_resignal) for sig in (signal.SIGTERM, signal.SIGINT)}


@main.command()
@click.option("--model", envvar="MODEL", default=None,
              help="Hugging Face model folder (default: the demo model, built once)")
@click.option("--served-name", default=None,
              help="Model name clients ask for [default: the model folder's name; `demo` for the demo]")
@click.option("--version", "version_", default="v1", show_default=True)
@click.option("--engine", type=click.Choice(ENGINES), default="paged", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True, help="Gateway port (0 = any free)")
@click.option("--redis-port", type=int, default=0, show_default=True, help="0 = any free port")
@click.option("--redis-url", default=None, help="Use this Redis (KVGATE_REDIS_MODE says single, "
              "cluster or sentinel) instead of starting one")
@click.option("--state-dir", default=".kvgate", show_default=True,
              help="Where URLs and keys for scripts are written")
@click.option("--gateway-workers", type=int, default=1, show_default=True, help="Gateway processes")
@click.option("--tls", is_flag=True, help="HTTPS only, with a development CA and certificate made "
              "once in STATE_DIR/tls (the worker's /metrics too); prints how to trust the CA")
def up(**opts) -> None:
    """Redis, a worker, the gateway and Celery (worker, beat) on 127.0.0.1; Ctrl-C stops all."""
    from kvgate.up import run_up

    sys.exit(run_up(**opts))


@main.group()
def bench() -> None:
    """Benchmarks that print a table and write JSON."""


@bench.command("engine")
@click.option("--model", type=click.Path(exists=True, file_okay=False), default=None,
              help="Model folder to measure [default: a random ~58M Llama built for the run]")
@click.option("--quick", is_flag=True, help="A smaller version of each workload (smoke check)")
@click.option("--out", default="bench-out/engine.json", show_default=True)
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Above 1: W1 at TP 1 vs TP N on the same cores, and the communication per step")
def bench_engine(model: str | None, quick: bool, out: str, tensor_parallel_size: int) -> None:
    """W1 throughput, W2 prefix cache, W3 KV efficiency: kvgate vs transformers, one process."""
    from kvgate.bench.engine import run_bench

    run_bench(quick=quick, out_json=out, model_dir=model, tensor_parallel_size=tensor_parallel_size)


@bench.command("structured")
@click.option("--model", type=click.Path(exists=True, file_okay=False), default=None,
              help="Model folder to measure [default: a random ~58M Llama built for the run]")
@click.option("--quick", is_flag=True, help="16 requests instead of 64 (smoke check)")
@click.option("--out", default="bench-out/structured.json", show_default=True)
def bench_structured(model: str | None, quick: bool, out: str) -> None:
    """JSON-schema constrained requests vs the same free, tokens/s per output token; compile ms."""
    from kvgate.bench.structured import run_bench

    run_bench(quick=quick, out_json=out, model_dir=model)


@bench.command("programs")
@click.option("--model", default=None, help="A model folder (default: a random ~58M Llama built for the run)")
@click.option("--quick", is_flag=True, help="The tiny model and smaller programs (a smoke run)")
@click.option("--questions", type=int, default=None, help="Multiple-choice questions (default 64)")
@click.option("--only", multiple=True, type=click.Choice(["tot", "extract", "select"]),
              help="Run only these programs (repeatable; default all three)")
@click.option("--out", default="docs/perf/programs.json", show_default=True)
def bench_programs(model: str | None, quick: bool, questions: int | None, only: tuple[str, ...],
                   out: str) -> None:
    """Generation programs (kvgate.lang) through the gateway: cached, uncached, and naive calls."""
    from kvgate.bench.programs import run_bench

    run_bench(quick=quick, out_json=out, model_dir=model, questions=questions,
              **({"only": only} if only else {}))


@bench.command("embeddings")
@click.option("--model", type=click.Path(exists=True, file_okay=False), default=None,
              help="A causal model folder, served with task embed [default: a random ~58M Llama built for the run]")
@click.option("--encoder", is_flag=True,
              help="A BERT folder of all-MiniLM-L6's sizes on the encoder engine, against sentence-transformers' way")
@click.option("--quick", is_flag=True, help="A tiny model and 32 inputs (smoke check)")
@click.option("--out", default="bench-out/embeddings.json", show_default=True)
def bench_embeddings(model: str | None, encoder: bool, quick: bool, out: str) -> None:
    """/v1/embeddings: the engine vs transformers' padded batches, cached, and through the stack."""
    from kvgate.bench.embeddings import run_bench

    run_bench(quick=quick, out_json=out, model_dir=model, encoder=encoder)


from kvgate.bench.serve import serve_command  # noqa: E402  (client-side serving benchmark)

bench.add_command(serve_command, "serve")

from kvgate.bench.burst import burst_command  # noqa: E402  (drills: overload shed cleanly)
from kvgate.bench.soak import soak_command  # noqa: E402  (drills: nothing grows under steady load)

bench.add_command(burst_command, "burst")
bench.add_command(soak_command, "soak")

from kvgate.bench.fairness import fairness_command  # noqa: E402  (noisy neighbour: fair order vs FIFO)

bench.add_command(fairness_command, "fairness")

from kvgate.bench.cpu import cpu_command  # noqa: E402  (CPU per request of each process of the path)

bench.add_command(cpu_command, "cpu")


@bench.command("sampler")
@click.option("--reps", default=5, show_default=True, help="Timed calls per figure (median)")
@click.option("--forward", is_flag=True, help="Also time a Qwen3-0.6B decode step's GEMMs (2.4 GB)")
@click.option("--model", "model_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Also run the engine on this folder: 32 requests of 128 prompt and 64 output "
              "tokens, sampled (top_k 50, top_p 0.9) vs greedy output tokens/s")
@click.option("--out", default="bench-out/sampler.json", show_default=True)
def bench_sampler(reps: int, forward: bool, model_dir: str | None, out: str) -> None:
    """The sampler alone on vocab 151,936: the former full sort vs the shortlist."""
    from kvgate.bench.sampler import run

    run(reps, forward, out, model_dir)


from kvgate.admin_cli import keys, usage  # noqa: E402  (commands that talk to the admin API)

main.add_command(keys)
main.add_command(usage)


@main.command("celery", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                          "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def celery_(args: tuple[str, ...]) -> None:
    """Celery for kvgate's services: `kvgate celery worker` runs the tasks, `kvgate celery beat`
    the schedule (canary checks); further arguments go to celery."""
    from celery.bin.celery import main as celery_main

    # --quiet: no banner, so the log is JSON lines only
    sys.argv = ["celery", "-A", "services.celery_app", "--quiet", *args]
    sys.exit(celery_main())


from kvgate.canary_cli import canary  # noqa: E402  (canary releases, through the admin API)

main.add_command(canary)

from kvgate.batches_cli import batches  # noqa: E402  (batch jobs, through /v1/batches)

main.add_command(batches)
