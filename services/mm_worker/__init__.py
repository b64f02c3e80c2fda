"""The MM worker role: FIFO image loading, decoding and processing in front of the engine.

The role is `mmlane.mm_worker.worker.MMWorker`; its settings are `config.MMWorkerConfig`,
which imports without torch (this package's import loads neither)."""
