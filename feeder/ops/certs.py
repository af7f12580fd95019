"""`feeder certs`: a deployment CA and the certificates it signs, for development, tests and
small deployments (larger ones bring their own PKI, e.g. cert-manager). A certificate is
valid for server and client use, so one per feeder host serves TLS and, under mutual TLS,
lets probes and peers authenticate with it.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from feeder.core.errors import InvalidArgument


def _x509():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise InvalidArgument("feeder certs needs the cryptography package: pip install 'token-feeder[tls]'") from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    if private:
        os.chmod(tmp, 0o600)
    os.replace(tmp, path)  # a reloading feeder never sees half a file


def make_ca(out: str, name: str = "feeder deployment CA", days: int = 3650) -> tuple[Path, Path]:
    x509, hashes, serialization, ec, _, NameOID = _x509()
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    out_dir = Path(out)
    _write(out_dir / "ca.key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()), private=True)
    _write(out_dir / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))
    return out_dir / "ca.crt", out_dir / "ca.key"


def issue(ca_dir: str, out: str, name: str, hosts: list[str] | tuple[str, ...] = ("localhost", "127.0.0.1"),
          days: int = 365) -> tuple[Path, Path]:
    """NAME.crt / NAME.key in `out`, signed by ca_dir/ca.{crt,key}, for `hosts` (DNS names or IPs)."""
    x509, hashes, serialization, ec, EKU, NameOID = _x509()
    ca = Path(ca_dir)
    try:
        ca_cert = x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes())
        ca_key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"cannot load the CA from {ca_dir} (ca.crt, ca.key; make one with `feeder certs ca`): "
                              f"{e}") from None
    sans = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out_dir = Path(out)
    _write(out_dir / f"{name}.key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()), private=True)
    _write(out_dir / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
    return out_dir / f"{name}.crt", out_dir / f"{name}.key"
