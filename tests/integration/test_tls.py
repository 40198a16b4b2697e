"""`kvgate up --tls`: the gateway (and the worker's /metrics) speak HTTPS only, with a development CA
that the official openai client trusts the way the README says; a plain HTTP request fails."""
from __future__ import annotations

import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from openai import OpenAI

from kvgate.tls import dev_certs
from tests.conftest import start_stack, stop_stack


@pytest.fixture(scope="module")
def tls_stack(tiny_model_dir, tmp_path_factory):
    s = start_stack(tiny_model_dir, tmp_path_factory.mktemp("tls"), "paged", args=["--tls"])
    yield s
    stop_stack(s.proc)
    assert s.proc.returncode == 0, f"kvgate up exited with {s.proc.returncode}"


def _ca(stack) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(stack.state / "tls" / "ca.pem"))


def test_openai_client_streams_over_https_with_the_generated_ca(tls_stack):
    assert tls_stack.url.startswith("https://127.0.0.1:")
    client = OpenAI(base_url=f"{tls_stack.url}/v1", api_key=tls_stack.key,
                    http_client=httpx.Client(verify=_ca(tls_stack)))
    stream = client.chat.completions.create(model="demo", stream=True, max_tokens=8,
                                            messages=[{"role": "user", "content": "Hello"}])
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) >= 1


def test_the_ca_is_needed_and_plain_http_fails(tls_stack):
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{tls_stack.url}/healthz", timeout=5)  # the system's CAs do not know ours
    plain = tls_stack.url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):  # the port speaks only TLS: no answer in clear
        httpx.get(f"{plain}/healthz", timeout=5)
    assert httpx.get(f"{tls_stack.url}/healthz", timeout=5, verify=_ca(tls_stack)).status_code == 200


def test_worker_metrics_are_served_over_https(tls_stack):
    url = (tls_stack.state / "worker.metrics.url").read_text().strip()
    assert url.startswith("https://")
    resp = httpx.get(url, timeout=5, verify=_ca(tls_stack))
    assert resp.status_code == 200 and "kvgate_" in resp.text
    with pytest.raises(httpx.TransportError):
        httpx.get(url.replace("https://", "http://"), timeout=5)


def test_admin_cli_reaches_the_https_gateway_with_ssl_cert_file(tls_stack):
    env = {**os.environ, "SSL_CERT_FILE": str(tls_stack.state / "tls" / "ca.pem")}
    out = subprocess.run([sys.executable, "-m", "kvgate", "keys", "create", "--name", "tls-user",
                          "--url", tls_stack.url, "--admin-key",
                          (tls_stack.state / "admin.key").read_text().strip()],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sk-" in out.stdout


def test_dev_certs_are_made_once_and_cover_the_loopback_names(tmp_path: Path):
    first = dev_certs(tmp_path)
    again = dev_certs(tmp_path)
    assert first.cert.read_bytes() == again.cert.read_bytes()  # clients that trusted it still do
    assert oct(first.key.stat().st_mode & 0o777) == "0o600"
    cert = x509.load_pem_x509_certificate(first.cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert {str(a) for a in names.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1", "::1"}
    before, ca = first.cert.read_bytes(), first.ca.read_bytes()
    wider = dev_certs(tmp_path, ("localhost", "127.0.0.1", "gateway"))  # a new name: a new cert
    assert wider.cert.read_bytes() != before
    assert wider.ca.read_bytes() == ca  # signed by the same CA: clients need not trust anew


def test_probe_healthcheck_trusts_only_the_ca_it_is_given(tls_stack):
    ca = str(tls_stack.state / "tls" / "ca.pem")

    def probe(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvgate", "probe", *args], capture_output=True,
                              text=True, timeout=60)
    assert probe(f"{tls_stack.url}/readyz", "--cafile", ca).returncode == 0
    refused = probe(f"{tls_stack.url}/readyz")
    assert refused.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr
    assert probe(f"{tls_stack.url.replace('https://', 'http://')}/readyz").returncode == 1
    missing = probe(f"{tls_stack.url}/nope", "--cafile", ca)
    assert missing.returncode == 1 and "404" in missing.stderr
