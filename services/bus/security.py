"""Connection settings for a managed Kafka cluster (TLS, SASL PLAIN or SCRAM), from the
environment, the same for every service and client:

    KAFKA_SECURITY_PROTOCOL    PLAINTEXT (default) | SSL | SASL_PLAINTEXT | SASL_SSL
    KAFKA_SSL_CAFILE           CA bundle that signed the brokers' certificates (default: the system's)
    KAFKA_SSL_CERTFILE, KAFKA_SSL_KEYFILE   a client certificate and its key (mutual TLS)
    KAFKA_SASL_MECHANISM       PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512 (with a SASL_* protocol)
    KAFKA_SASL_USERNAME, KAFKA_SASL_PASSWORD

`client_settings(environ)` turns them into aiokafka's keyword arguments; a combination that
cannot work (SASL without credentials, an unknown protocol) is refused with the variable named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def client_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    protocol = environ.get("KAFKA_SECURITY_PROTOCOL", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise ValueError(f"KAFKA_SECURITY_PROTOCOL must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    settings: dict[str, Any] = {"security_protocol": protocol}
    if protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        settings["ssl_context"] = create_ssl_context(
            cafile=environ.get("KAFKA_SSL_CAFILE") or None,
            certfile=environ.get("KAFKA_SSL_CERTFILE") or None,
            keyfile=environ.get("KAFKA_SSL_KEYFILE") or None,
        )
    if protocol.startswith("SASL_"):
        mechanism = environ.get("KAFKA_SASL_MECHANISM", "PLAIN").upper()
        if mechanism not in MECHANISMS:
            raise ValueError(
                f"KAFKA_SASL_MECHANISM must be one of {', '.join(MECHANISMS)}, got {mechanism!r}"
            )
        username, password = environ.get("KAFKA_SASL_USERNAME"), environ.get("KAFKA_SASL_PASSWORD")
        if not username or password is None:
            raise ValueError(f"{protocol} needs KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD")
        settings.update(sasl_mechanism=mechanism, sasl_plain_username=username, sasl_plain_password=password)
    return settings
