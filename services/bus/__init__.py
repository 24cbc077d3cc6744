"""The message bus the services talk over: a small interface, two implementations.

`KafkaBus` (aiokafka) is what the services run on; `MemoryBus` runs the same services in one
process for tests. Delivery is at-least-once: a consumer commits only after its handler
succeeded, so handlers must be idempotent.
"""

from parkade.services.bus.base import Bus, Consumer, Outgoing, OutgoingRecord, Record
from parkade.services.bus.memory import MemoryBus

__all__ = ["Bus", "Consumer", "MemoryBus", "Outgoing", "OutgoingRecord", "Record"]
