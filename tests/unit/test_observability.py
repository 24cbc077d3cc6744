"""Logs, tracing configuration, `parkade trace`, and Kafka connection settings: the parts that
need no broker."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from parkade import trace as trace_cli
from parkade.services.bus import kafka, security
from parkade.services.common import logs, tracing

TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_log_lines_are_json_with_the_service_and_the_requests_ids(restore_logging):
    out = io.StringIO()
    logs.configure("scheduler", out, json=True)
    extra = {**logs.request("r1", (("traceparent", TRACEPARENT),)), "step_id": 7}
    logging.getLogger("parkade.test").warning("refused %s", "r1", extra=extra)
    line = json.loads(out.getvalue())
    assert line["event"] == "refused r1" and line["level"] == "warning" and line["service"] == "scheduler"
    assert line["request_id"] == "r1" and line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert line["step_id"] == 7 and line["timestamp"].endswith("Z")
    readable = io.StringIO()
    logs.configure("tokenizer", readable, json=False)
    logging.getLogger("parkade.test").info("ready")
    assert "ready" in readable.getvalue() and not readable.getvalue().startswith("{")


def test_tracing_is_on_only_when_the_environment_asks():
    assert not tracing.tracing_requested({})
    assert tracing.tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert tracing.tracing_requested({"OTEL_TRACES_EXPORTER": "console"})
    assert tracing.tracing_requested({"PARKADE_TRACE_FILE": "/tmp/x"})
    assert not tracing.tracing_requested({"PARKADE_TRACE_FILE": "/tmp/x", "OTEL_SDK_DISABLED": "true"})
    off = {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert not tracing.tracing_requested(off)  # the endpoint may be for metrics or logs
    assert tracing.carries_context((("traceparent", TRACEPARENT),))
    assert not tracing.carries_context((("traceparent", b"00-zz-yy-01"),)) and not tracing.carries_context(())
    assert tracing.configure("tokenizer", {}) is None and not tracing.enabled()
    assert not tracing.start_span("x", (("traceparent", TRACEPARENT),)).is_recording()


def test_a_trace_file_and_parkade_trace_show_one_requests_waterfall(tmp_path, capsys):
    path = tmp_path / "traces.jsonl"
    provider = tracing.configure("scheduler", {"PARKADE_TRACE_FILE": str(path)})
    try:
        span = tracing.start_span("scheduler.request", (("traceparent", TRACEPARENT),),
                                  attributes={"parkade.request_id": "r1"})  # fmt: skip
        step = tracing.tracer().start_span(
            "executor.step", links=tracing.link_to(tracing.traceparent_of(span))
        )
        step.end()
        span.end()
        other = tracing.start_span("scheduler.request", attributes={"parkade.request_id": "r2"})
        other.end()
        provider.force_flush()
    finally:
        tracing.install(None)
    records = trace_cli.load(path)
    assert {r["trace_id"] for r in records if r["name"] == "scheduler.request"} >= {
        "0af7651916cd43dd8448eb211c80319c"
    }
    mine = trace_cli.request_spans(records, "r1")
    assert [s["name"] for s in mine] == ["scheduler.request", "executor.step x1"]
    assert mine[0]["service"] == "parkade-scheduler" and mine[0]["parent_id"] == "b7ad6b7169203331"
    assert trace_cli.main("r1", path) == 0
    shown = capsys.readouterr().out
    assert "scheduler.request" in shown and "executor.step x1" in shown and "█" in shown
    assert trace_cli.main("nope", path) == 1
    assert trace_cli.request_spans(records, "r") == []  # an id is not a prefix of another
    assert trace_cli.main("r1", tmp_path / "missing.jsonl") == 2


def test_kafka_connection_settings_for_a_managed_cluster():
    assert security.client_settings({}) == {"security_protocol": "PLAINTEXT"}
    scram = security.client_settings(
        {"KAFKA_SECURITY_PROTOCOL": "sasl_ssl", "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
         "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p"}
    )  # fmt: skip
    assert scram["security_protocol"] == "SASL_SSL" and scram["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (scram["sasl_plain_username"], scram["sasl_plain_password"]) == ("u", "p")
    assert scram["ssl_context"].verify_mode.name == "CERT_REQUIRED"
    with pytest.raises(ValueError, match="KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD"):
        security.client_settings({"KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"})
    with pytest.raises(ValueError, match="KAFKA_SECURITY_PROTOCOL must be one of"):
        security.client_settings({"KAFKA_SECURITY_PROTOCOL": "TLS"})
    with pytest.raises(ValueError, match="KAFKA_SASL_MECHANISM"):
        security.client_settings({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "GSSAPI"})


def test_the_settings_reach_every_aiokafka_client_the_bus_makes(monkeypatch):
    from aiokafka import AIOKafkaProducer

    settings = security.client_settings(
        {"KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p"}
    )
    monkeypatch.setattr(kafka, "_SECURITY", settings)
    made = []

    class Recorder:
        def __init__(self, **kwargs):
            made.append(kwargs)
            raise RuntimeError("recorded")

    for name in ("AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient"):
        monkeypatch.setattr(kafka, name, Recorder)
    bus = kafka.KafkaBus("broker:9092")
    for call in (bus._started_producer(), bus.consumer(["t"], "g"), bus.create_topics(["t"]),
                 kafka.wait_for_broker("broker:9092", timeout_s=0.1)):  # fmt: skip
        with pytest.raises(RuntimeError, match="recorded"):
            asyncio.run(call)
    assert len(made) == 4 and all(m["sasl_plain_username"] == "u" for m in made)
    assert all(m["security_protocol"] == "SASL_PLAINTEXT" for m in made)

    async def real_producer():  # aiokafka takes them
        return AIOKafkaProducer(**settings, bootstrap_servers="broker:9092")

    client = asyncio.run(real_producer()).client
    assert client._sasl_mechanism == "PLAIN" and client._security_protocol == "SASL_PLAINTEXT"
