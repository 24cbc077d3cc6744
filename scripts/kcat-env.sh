# Source this before using kcat against the embedded Tansu broker (`parkade up`, the tests).
# Debian 12's kcat links librdkafka 2.0.2, whose ApiVersions request Tansu answers in a form it
# cannot read ("Read underflow"); librdkafka 2.16, as the confluent-kafka wheel bundles it (one
# of the test extras), talks to it. Against Apache Kafka kcat needs none of this.
_rdkafka=$("${VENV:-.venv}/bin/python" -c '
import pathlib, confluent_kafka
wheel = pathlib.Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs"
print(next(wheel.glob("librdkafka*.so.1")))') || return 1
_dir="${TMPDIR:-/tmp}/parkade-rdkafka"
mkdir -p "$_dir" && ln -sf "$_rdkafka" "$_dir/librdkafka.so.1"
export LD_LIBRARY_PATH="$_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset _rdkafka _dir
