"""Data containers passed between workers."""

from baton.data.bucket import TensorBucket
from baton.data.proto import DataProto

__all__ = ["DataProto", "TensorBucket"]
