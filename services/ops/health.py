"""`mmlane health`: ping every control socket at once; exit 0 only when every process serves.

Healthy means: every process answers within --timeout, says 'serving', and every engine has a
model loaded. A role that `mmlane serve` is about to restart is answered for by serve, as
'restarting' with the number of the restart: unhealthy, but not silent. When the sockets are
discovered (no --connect), at least one frontend, one MM worker and one engine must answer too,
so a role whose socket is gone counts as missing.

The pings go out together, one REQ socket each, and each role answers from its stats thread, so
a role busy with a 12 MP image still answers at once. A socket that gets no answer is closed
with linger 0: nothing of ours waits in it afterwards.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import msgspec
import zmq

from mmlane.ops.discovery import connect, endpoint_label, targets
from mmlane.ops.feed import ROLE_ORDER, process_order
from mmlane.ops.text import latency_text, state_text
from mmlane.protocol.messages import ControlReply, Ping, Pong


@dataclass
class Answer:
    """What one control socket said to a ping, how fast, and what is wrong with it, if anything."""

    endpoint: str
    pong: Pong | None = None
    seconds: float = 0.0
    problem: str = ""
    """Why this process is not healthy; "" when it is."""

    @property
    def name(self) -> str:
        return self.pong.name if self.pong else endpoint_label(self.endpoint)

    @property
    def role(self) -> str:
        return self.pong.role if self.pong else ""


def health_command(args: argparse.Namespace) -> int:
    where = targets(args, "control")
    answers = ping_all(where.require_endpoints(), args.timeout)
    for answer in answers:
        print(answer_line(answer), flush=True)
    problems = [f"{answer.name}: {answer.problem}" for answer in answers if answer.problem]
    if where.discovering:
        problems += missing_roles(answers)
    if problems:
        print(f"mmlane health: unhealthy: {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0


def ping_all(endpoints: list[str], timeout_s: float) -> list[Answer]:
    """Ping every endpoint at once and wait up to `timeout_s` for all the answers; each
    answer comes back judged (its `problem` set), in pipeline order."""
    ctx = zmq.Context()
    try:
        answers = _ping(ctx, endpoints, timeout_s)
    finally:
        ctx.destroy(linger=0)
    return sorted(answers, key=lambda answer: process_order(answer.role, answer.name))


def _ping(ctx: zmq.Context, endpoints: list[str], timeout_s: float) -> list[Answer]:
    ping = msgspec.msgpack.encode(Ping())
    decoder = msgspec.msgpack.Decoder(ControlReply)
    poller = zmq.Poller()
    waiting: dict[zmq.Socket, Answer] = {}
    started = time.monotonic()
    for endpoint in endpoints:
        sock = connect(ctx, zmq.REQ, endpoint)
        sock.send(ping, zmq.NOBLOCK)  # queued on the connecting pipe: never blocks
        poller.register(sock, zmq.POLLIN)
        waiting[sock] = Answer(endpoint)
    answers = list(waiting.values())
    while waiting and (remaining := started + timeout_s - time.monotonic()) > 0:
        for sock, _ in poller.poll(int(remaining * 1000) + 1):
            answer = waiting.pop(sock)
            answer.seconds = time.monotonic() - started
            _judge(answer, sock.recv(), decoder)
            poller.unregister(sock)
            sock.close(linger=0)
    for sock, answer in waiting.items():
        where = "" if answer.name == answer.endpoint else f" ({answer.endpoint})"
        answer.problem = f"no answer within {timeout_s:g} s{where}"
        sock.close(linger=0)
    return answers


def _judge(answer: Answer, body: bytes, decoder: msgspec.msgpack.Decoder) -> None:
    """Read the answer and say what, if anything, makes this process unhealthy."""
    try:
        answer.pong = decoder.decode(body)
    except msgspec.DecodeError as exc:
        answer.problem = f"unreadable answer ({exc})"
        return
    if answer.pong.state != "serving":
        answer.problem = f"state {state_text(answer.pong.state, answer.pong.restarts)}"
    elif answer.pong.role == "engine" and not answer.pong.model:
        answer.problem = "the engine has no model loaded"


def missing_roles(answers: list[Answer]) -> list[str]:
    """A problem for each role that no process answered for."""
    answered = {answer.role for answer in answers if answer.pong is not None}
    return [f"no {role} answered" for role in ROLE_ORDER if role not in answered]


def answer_line(answer: Answer) -> str:
    """One line per process: role, name, pid, state, model, answer time, verdict."""
    pong = answer.pong
    if pong is None:
        return (f"{'?':<10} {answer.name:<16} {'-':>8}  {'-':<9} {'-':<16} {'-':>9}  "
                f"UNHEALTHY: {answer.problem}")
    verdict = f"UNHEALTHY: {answer.problem}" if answer.problem else "ok"
    state = state_text(pong.state, pong.restarts)
    return (f"{pong.role:<10} {pong.name:<16} {pong.pid:>8}  {state:<9} "
            f"{pong.model or '-':<16} {latency_text(answer.seconds):>9}  {verdict}")
