"""`python -m bench`: mmlane against the in-process preprocessing designs, side by side.

One invocation runs each mode on the same model, tokenizer, image processor, images, engine and
client, one after the other; each mode has its own server processes:

    shared  one server process whose one thread pool tokenizes and preprocesses images
            (vLLM before it isolated MM preprocessing on its own executor)
    split   one server process: a tokenizer pool, and a one-thread MM executor for the images
            (vLLM after that change)
    mmlane  mmlane's frontend and MM worker processes

Every mode hands its preprocessed requests to the same mmlane engine process (started as `mmlane
serve` starts it), as vLLM's API server hands requests to its engine core: the model is not what
is compared. The load generator (`client.py`, `workload.py`) is the bench process itself, the same
in every mode, speaking mmlane's native API to whichever server runs.

Phases, per mode (`workload.py`): idle (Poisson text requests only); probe-idle (tokenizer probes
only, the baseline); one probe phase per probe image size (4 closed image loops + probes); then
one load phase per image rate (Poisson text + Poisson image requests), the last being the
saturating load. Every image sent is new bytes (`images.py`), so no feature cache can hit.

Definitions (all times from the load generator's clock, `time.monotonic()`):

- text / image latency: submit to the terminal reply of a request (max_tokens 1 by default).
- time until the engine holds the preprocessed request ("engine hold"): the arrival of the
  request's first output minus its submit time, minus the idle engine's service time for that
  request class (`engine_service_ms`: the bench sends the same preprocessed request straight to
  the engine, idle, and times its first output). It is defined the same way in every mode, from
  what the client sees; under load it also counts the wait in the engine's queue. For shared and
  split, the server also reports the exact moment it sent each request to the engine: the
  "exact handoff" figures, which check the estimate.
- images/s: a phase's images over the time from its first image's submit to its last image's
  reply (its drain included): under a saturating load the server is busy all along, so this is
  its throughput.
- tokenizer-probe wait: every `probe_interval_ms` the client sends a request whose text forges
  the image placeholder token; the server's tokenizer executor renders and tokenizes it, finds
  the forgery and answers with an error, so it never reaches the MM lane or the engine: it is
  a no-op round trip through the tokenizer executor. Its wait is its round trip minus the median
  round trip of the probe-idle phase (at least 0). In shared and split the server additionally
  submits a true no-op to its tokenizer executor every interval and records submit-to-start
  (vLLM's own probe): the "executor no-op wait". mmlane's frontend has no such hook and the
  bench adds none, so for mmlane the round-trip figure is the only one.
- CPU seconds by process: /proc utime + stime of each process over a phase; per text request
  from the idle phase; per image from the saturating phase less its text requests' idle cost.

Results: `results.py` (the JSON schema), `report.py` (table, chart).
"""
