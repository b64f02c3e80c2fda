"""The MM worker role: FIFO image loading, decoding and processing in front of the engine."""

from services.mm_worker.worker import MMWorker

__all__ = ["MMWorker"]
