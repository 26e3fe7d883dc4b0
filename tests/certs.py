"""Throwaway certificates for TLS tests: a CA, a server certificate for 127.0.0.1, a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here: trusting it must fail


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _certificate(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool, usage=None, sans=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certificates(directory: Path) -> Certificates:
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate("tandem test CA", ca_key, _name("tandem test CA"), ca_key, ca=True)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other_cert = _certificate("unrelated CA", other_key, _name("unrelated CA"), other_key, ca=True)
    for label, cert in (("ca", ca_cert), ("other_ca", other_cert)):
        paths[label] = directory / f"{label}.pem"
        paths[label].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    sans = (x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"))
    for label, usage, names in (("server", ExtendedKeyUsageOID.SERVER_AUTH, sans),
                                ("client", ExtendedKeyUsageOID.CLIENT_AUTH, ())):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(f"tandem {label}", key, ca_cert.subject, ca_key, ca=False, usage=usage, sans=names)
        paths[f"{label}_cert"] = directory / f"{label}.pem"
        paths[f"{label}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{label}_key"] = directory / f"{label}.key"
        _write_key(paths[f"{label}_key"], key)
    return Certificates(**paths)
