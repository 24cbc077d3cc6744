"""compose.yaml, compose.gpu.yaml and deploy/prometheus.yml agree with each other: read as YAML,
without Docker (tests/compose/run.sh runs the stack itself). Where docker-compose (1.x) or Docker
Compose v2 is installed, it must also accept the files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PARKADE_SERVICES = ("tokenizer", "scheduler", "executor", "gateway")
REPLICA_1 = ("scheduler-1", "executor-1")  # the second engine replica, behind a profile
STACK = {*PARKADE_SERVICES, "kafka", "topics", "otel-collector", "jaeger", "prometheus"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def default(value: str) -> str:
    """A value as Compose reads it with no variable set: `${NAME:-default}` becomes `default`."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", str(value))


@pytest.fixture(scope="module")
def services() -> dict:
    return load("compose.yaml")["services"]


def flag(command: list[str], name: str) -> str:
    """The value after `name` in a command list."""
    assert name in command, f"{name} is not in {command}"
    return default(command[command.index(name) + 1])


def test_the_stack_has_every_service(services):
    assert set(services) >= STACK, f"missing: {sorted(STACK - set(services))}"


def test_the_parkade_services_and_the_topics_job_run_one_image_built_from_the_dockerfile(services):
    runs = (*PARKADE_SERVICES, "topics")
    builds = {name: services[name]["build"] for name in runs}
    assert all(build == builds["topics"] for build in builds.values()), builds
    assert builds["topics"]["context"] == "."
    assert (ROOT / builds["topics"].get("dockerfile", "Dockerfile")).is_file()
    assert len({services[name]["image"] for name in runs}) == 1
    for name in PARKADE_SERVICES:
        assert services[name]["command"][:2] == ["parkade", name]
    assert services["topics"]["command"][:3] == ["parkade", "topics", "--create"]


def test_the_parkade_services_restart_and_have_healthchecks(services):
    for name in PARKADE_SERVICES:
        service = services[name]
        assert service.get("restart") in ("unless-stopped", "on-failure", "always"), name
        test = service["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL"), (name, test)
        probe = " ".join(test)
        if name == "gateway":
            port = flag(service["command"], "--http-port")
            assert f"127.0.0.1:{port}/health" in probe, probe
        else:
            port = service["environment"]["PARKADE_METRICS_PORT"]
            assert f"127.0.0.1:{port}/metrics" in probe, probe
    for name in ("kafka", "jaeger", "prometheus"):
        assert "test" in services[name]["healthcheck"], name


def test_every_service_waits_for_what_it_needs(services):
    for name, service in services.items():
        for needed, how in service.get("depends_on", {}).items():
            assert needed in services, f"{name} depends on {needed}, which is not a service"
            assert how["condition"] in CONDITIONS, (name, needed, how)
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[needed], f"{name} waits for {needed} to be healthy"
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in PARKADE_SERVICES:
        depends_on = services[name]["depends_on"]
        assert depends_on["kafka"]["condition"] == "service_healthy", name
        assert depends_on["topics"]["condition"] == "service_completed_successfully", name


def test_the_services_reach_kafka_and_the_collector_by_their_service_names(services):
    advertised = services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert "PLAINTEXT://kafka:9092" in advertised.split(",")
    for name in (*PARKADE_SERVICES, "topics"):
        assert services[name]["environment"]["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092", name
    for name in PARKADE_SERVICES:
        environment = services[name]["environment"]
        assert environment["OTEL_SERVICE_NAME"] == f"parkade-{name}"
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    # the collector's config and Prometheus' are mounted from deploy/, which must hold them
    for name in ("otel-collector", "prometheus"):
        for volume in services[name]["volumes"]:
            if volume.startswith("./"):
                assert (ROOT / volume.split(":")[0]).is_file(), volume


def test_prometheus_scrapes_every_parkade_service_on_a_port_it_serves(services):
    config = load("deploy/prometheus.yml")
    targets = [t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    scraped = set()
    for target in targets:
        host, port = target.split(":")
        assert host in (*PARKADE_SERVICES, *REPLICA_1), f"Prometheus scrapes {target}: not a Parkade service"
        service = services[host]
        served = {service["environment"]["PARKADE_METRICS_PORT"]}
        if host == "gateway":
            served.add(flag(service["command"], "--http-port"))
        assert port in served, f"{target}: {host} serves metrics on {sorted(served)}"
        scraped.add(host)
    assert scraped == {*PARKADE_SERVICES, *REPLICA_1}


def test_a_second_engine_replica_runs_behind_the_replicas_profile(services):
    for name in REPLICA_1:
        service, plain = services[name], services[name.removesuffix("-1")]
        assert service["profiles"] == ["replicas"] and "profiles" not in plain
        assert flag(service["command"], "--replica") == "1"
        assert service["command"][:2] == plain["command"][:2]
        assert service["image"] == plain["image"] and service["depends_on"] == plain["depends_on"]
        assert service["environment"]["OTEL_SERVICE_NAME"] == f"parkade-{name}"
    assert flag(services["executor-1"]["command"], "--model") == flag(
        services["executor"]["command"], "--model"
    )


def test_the_gpu_override_runs_the_executor_alone_on_one_nvidia_device(services):
    gpu = load("compose.gpu.yaml")["services"]
    assert set(gpu) == {"executor"}
    executor = gpu["executor"]
    assert default(executor["build"]["args"]["TORCH_VARIANT"]).startswith("cu")
    assert executor["image"] != services["executor"]["image"]  # the CPU image stays for the others
    assert flag(executor["command"], "--device") == "cuda"
    assert executor["command"][:2] == ["parkade", "executor"]
    devices = executor["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_the_dockerfile_builds_cpu_torch_by_default_and_runs_as_a_user():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim-bookworm" in dockerfile
    assert "ARG TORCH_VARIANT=cpu" in dockerfile
    user = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert user and user[-1] not in ("root", "0")
