"""Pixels from one process to another on one host: ZMQ frames against shared memory, against a
plain memcpy of the same bytes, and over loopback tcp plain and with CURVE, in one run.

    python scripts/bench_transport.py [--messages 40] [--rounds 3] [--mb 2.9]

Each message is an EngineRequest with one image's uint8 pixel_values (2.9 MB: a 12 MP photo for the
embedded tiny Qwen2-VL, one frame of its two; 5.79 MB before the MM worker sent one frame), encoded
by the real codec and sent over a real ipc PUSH/PULL pair to a second process, which decodes it and
reads one byte of every page of the pixels (so that a mapping's pages are in, as whoever uses the
tensor would fault them in). `frames` is the codec as over tcp; `shm` gives the sender's codec a
ShmWriter (protocol/shm.py), as the MM worker does for an ipc engine without a pool. `pool slot` is
the way of an MM worker with a pool (`--mm-processes` 2 or more): the pixels already lie in a slot
of a pool process's own writer, where the process put them as it made them (that copy replaced the
pool's earlier copy into a block of its own, and is not timed: before each pass, every message's
pixels are put into a slot of their own); the sender takes each as a view (`ShmViews.adopt`) and
its codec hands the slot on, so the transport copies once, in the receiver. `tcp` is frames over
tcp://127.0.0.1, `curve` the same with the roles' CURVE (services/common/sockets.py `Security`,
keys made by `write_keys`): what the encryption between hosts costs per image, without a network's
own limits. `memcpy` copies the same bytes into a new array in one process (`np.copyto`), the bound
the issue measures against. Per round the six alternate. The sender sends its messages back to
back, at most WINDOW (4) not yet read by the receiver, a first pass to warm up (the sockets; the
slots, which an MM worker reuses), then the timed one; throughput is the bytes of all over the time
from the first encode to the receiver's last read (CLOCK_MONOTONIC is one clock for both
processes); latency is one message's encode-to-read time. Prints, per mode, median latency, GB/s,
and the throughput as a share of memcpy's; asserts nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from mmlane.common.config import SecurityConfig
from mmlane.common.sockets import Security, free_tcp_port, make_socket, write_keys
from mmlane.protocol import shm
from mmlane.protocol.codec import Codec
from mmlane.protocol.messages import EngineInput, EngineRequest, MMItem, SamplingParams

PAGE = 4096
WINDOW = 4
"""Messages in flight at most, as an MM worker's send queue holds a few (ENGINE_SEND_HWM)."""


def request(pixels: np.ndarray, sent_at: float) -> EngineRequest:
    # The send time travels as the deadline, a float the receiver reads back.
    return EngineRequest(request_id="r", reply_to="x", prompt_token_ids=[1],
                         sampling=SamplingParams(max_tokens=1), deadline=sent_at,
                         mm_items=[MMItem(offset=0, length=1, tensors={"pixel_values": pixels})])


def receive(endpoint: str, done: str, count: int, keys: str) -> None:
    """The receiving process: decode each message, read a byte per page, report when done."""
    ctx = zmq.Context()
    security = Security("engine", SecurityConfig(curve_keys=keys))
    pull = make_socket(ctx, zmq.PULL, endpoint, bind=True, security=security)
    back = ctx.socket(zmq.PUSH)
    back.connect(done)
    codec: Codec = Codec(EngineInput, accept_shm=True)
    back.send(b"ready")
    for _ in range(2):  # a warm-up pass, then the timed one
        times = []
        for _ in range(count):
            message = codec.decode(pull.recv_multipart(copy=False))
            pixels = message.mm_items[0].tensors["pixel_values"].reshape(-1)
            int(pixels[::PAGE].sum())  # every page in
            times.append((message.deadline, time.monotonic()))
            back.send(b"")  # taken: the sender may send one more
        back.send_pyobj(times)
    security.close()
    ctx.destroy(linger=0)


def transport(mode: str, pixels: np.ndarray, count: int,
              run_dir: Path) -> tuple[list[float], float]:
    """Seconds per message, sender's encode to receiver's read; and for all of them."""
    endpoint = (f"tcp://127.0.0.1:{free_tcp_port()}" if mode in ("tcp", "curve")
                else f"ipc://{run_dir}/{mode}.sock")
    done = f"ipc://{run_dir}/{mode}-done.sock"
    keys = str(run_dir / "keys") if mode == "curve" else ""
    ctx = zmq.Context()
    back = ctx.socket(zmq.PULL)
    back.bind(done)
    child = multiprocessing.get_context("spawn").Process(
        target=receive, args=(endpoint, done, count, keys))
    child.start()
    back.recv()
    security = Security("mm-worker", SecurityConfig(curve_keys=keys))
    push = make_socket(ctx, zmq.PUSH, endpoint, bind=False, security=security, peer="engine")
    writer = (shm.ShmWriter(shm.sender_tag(f"bench-{time.time_ns()}"), threshold=1 << 20,
                            capacity=2 << 30, max_age_s=60)
              if mode in ("shm", "pool slot") else None)
    views = shm.ShmViews(keep_from=1 << 20)
    codec: Codec = Codec(EngineInput, shm_writer=views if mode == "pool slot" else writer)
    for _ in range(2):  # the first pass warms the sockets and the slots up
        in_flight = 0
        made = [str(writer.put(pixels)) for _ in range(count)] \
            if writer is not None and mode == "pool slot" else []
        for index in range(count):
            if in_flight == WINDOW:
                back.recv()
                in_flight -= 1
            sent_at = time.monotonic()
            tensor = views.adopt(made[index], pixels.dtype, pixels.shape) if made else pixels
            assert tensor is not None  # its slot is ours until the receiver frees it
            push.send_multipart(codec.encode(request(tensor, sent_at)), copy=False)
            del tensor
            in_flight += 1
        for _ in range(in_flight):
            back.recv()
        times = back.recv_pyobj()
    child.join()
    push.close(linger=0)
    ctx.destroy(linger=0)
    if writer is not None:
        writer.close()
    return [read - sent for sent, read in times], times[-1][1] - times[0][0]


def memcpy(pixels: np.ndarray, count: int) -> tuple[list[float], float]:
    times = []
    for _ in range(count):
        started = time.monotonic()
        copy = np.empty_like(pixels)
        np.copyto(copy, pixels)
        times.append(time.monotonic() - started)
        del copy
    return times, sum(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=40, help="per mode and round (40)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, modes alternating (3)")
    parser.add_argument("--mb", type=float, default=2.9, help="pixel bytes per message, in MB "
                        "(2.9: a 12 MP photo's uint8 pixels for the tiny Qwen2-VL)")
    args = parser.parse_args()
    pixels = np.random.default_rng(0).integers(0, 256, int(args.mb * 1e6), np.uint8)
    latencies: dict[str, list[float]] = {"memcpy": [], "frames": [], "shm": [], "pool slot": [],
                                         "tcp": [], "curve": []}
    totals = dict.fromkeys(latencies, 0.0)
    with tempfile.TemporaryDirectory(prefix="mml-bench-") as tmp:
        for role in ("engine", "mm-worker"):
            write_keys(Path(tmp) / "keys", role)
        for _ in range(args.rounds):
            for mode in latencies:
                times, total = (memcpy(pixels, args.messages) if mode == "memcpy" else
                                transport(mode, pixels, args.messages, Path(tmp)))
                latencies[mode] += times
                totals[mode] += total
    sent = pixels.nbytes * args.messages * args.rounds
    print(f"{pixels.nbytes:,} bytes per message, {args.rounds} rounds x {args.messages}")
    print(f"{'mode':9} {'latency p50 ms':>15} {'GB/s':>6} {'of memcpy':>10}")
    for mode, times in latencies.items():
        print(f"{mode:9} {statistics.median(times) * 1e3:15.2f} {sent / totals[mode] / 1e9:6.2f} "
              f"{totals['memcpy'] / totals[mode]:9.0%}")


if __name__ == "__main__":
    main()
