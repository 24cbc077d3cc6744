"""JSON Schemas of the public topics, generated from the wire types: `python -m parkade.schemas.publish`
writes them to docs/schemas/ (a test fails when those files are out of date).

The schema describes the JSON encoding (`content-type: application/json`); msgpack records carry
the same fields.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from parkade.schemas import topics

PUBLIC_TOPICS = (topics.REQUESTS, topics.TOKENS)
OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "schemas"


def json_schemas() -> dict[str, str]:
    """File name -> its text, one schema per public topic (the union of its message types)."""
    out = {}
    for topic in PUBLIC_TOPICS:
        schema: dict[str, Any] = msgspec.json.schema(topics.TOPIC_TYPES[topic])
        schema = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": f"Parkade {topic} topic (prefix parkade. by default)",
            **schema,
        }
        out[f"{topic}.schema.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def main() -> int:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in json_schemas().items():
        (OUT_DIR / name).write_text(text)
        print(OUT_DIR / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
