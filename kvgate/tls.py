"""Development certificates: a self-signed CA and a server certificate it signs, for HTTPS on one
machine (`kvgate up --tls`, `kvgate dev-cert`). Clients trust the CA file, never the server's."""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 825  # the longest a server certificate may live for Apple's clients


@dataclass(frozen=True)
class DevCerts:
    ca: Path    # what clients trust (SSL_CERT_FILE, curl --cacert, httpx verify=)
    cert: Path  # the server's chain: its certificate, then the CA's
    key: Path   # the server's private key (mode 0600)


def dev_certs(folder: Path, hosts: tuple[str, ...] = DEFAULT_HOSTS) -> DevCerts:
    """The CA and server certificate in `folder`, made once: an existing set is reused while it
    covers `hosts` and has a day left, so clients that trusted the CA keep trusting it."""
    folder.mkdir(parents=True, exist_ok=True)
    certs = DevCerts(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    if _usable(certs, hosts):
        return certs
    ca_key, ca_cert = _ca(folder)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _server_cert(key, ca_key, ca_cert, hosts)
    _write_key(certs.key, key)
    certs.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM)
                           + ca_cert.public_bytes(serialization.Encoding.PEM))
    return certs


def _ca(folder: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The folder's CA, made if absent (its key stays beside it, mode 0600, to sign renewals)."""
    key_path, cert_path = folder / "ca.key", folder / "ca.pem"
    if key_path.exists() and cert_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        return key, x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvgate development CA")])
    cert = (_builder(name, name, key.public_key(), days=3650)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def _server_cert(key, ca_key, ca_cert: x509.Certificate, hosts: tuple[str, ...]) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    return (_builder(name, ca_cert.subject, key.public_key(), days=VALID_DAYS)
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))


def _builder(subject: x509.Name, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days)))


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _usable(certs: DevCerts, hosts: tuple[str, ...]) -> bool:
    if not (certs.ca.exists() and certs.cert.exists() and certs.key.exists()):
        return False
    cert = x509.load_pem_x509_certificate(certs.cert.read_bytes())
    left = cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return left > dt.timedelta(days=1) and all(_san(h) in names for h in hosts)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(path, 0o600)


def trust_hint(ca: Path, url: str) -> str:
    """How a client trusts the development CA, in lines to print."""
    return "\n".join([
        f"TLS: a development CA signed the gateway's certificate; trust {ca}:",
        f"  curl --cacert {ca} {url}/healthz",
        f"  export SSL_CERT_FILE={ca}   # httpx, the openai client, `kvgate keys ...`",
        f"  OpenAI(base_url='{url}/v1', api_key=...,",
        f"         http_client=httpx.Client(verify=ssl.create_default_context(cafile='{ca}')))",
    ])
