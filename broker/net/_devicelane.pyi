# The compiled device path (_devicelane.pyx), as mypy sees it.
from typing import Any

from broker.commitlog.keys import PartitionKey

class DeviceLane:
    proto: Any
    key: PartitionKey
    def __init__(self, proto: Any, key: PartitionKey) -> None: ...
    def receive(self, data: bytes) -> bool: ...

class DeviceAck:
    def __call__(self, offset: int | None) -> None: ...
