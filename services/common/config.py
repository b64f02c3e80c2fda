"""What every role's typed, validated configuration shares: the settings common to all roles
(`OpsConfig`, `SecurityConfig`), the run dir of their ipc:// sockets, and the helpers that build
and check a config. Each role's own config lives beside it (services/frontend/config.py,
services/mm_worker/config.py, services/engine/config.py). Unknown keys are rejected; each field
says why.

The command line (`services/cli.py`) builds them with `load_config`, so a bad value fails at
startup with a message naming the setting. Import-light: no torch, no zmq.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from mmlane.protocol.errors import FatalError

C = TypeVar("C", bound=msgspec.Struct)

DEFAULT_HOST = "127.0.0.1"
"""Where a listener binds unless told otherwise: loopback, reachable from this machine only."""


CGROUP = Path("/sys/fs/cgroup")
"""Where this process's cgroup shows (a container's own, under a cgroup namespace)."""


def usable_cores(cgroup: Path = CGROUP) -> int:
    """The cores this process may use, which the defaults sized by cores count: those its
    affinity allows, at most its cgroup's CPU quota rounded up (a container's CPU limit, e.g.
    `docker run --cpus 4` on a larger host, which the affinity does not show); at least 1."""
    cores = len(os.sched_getaffinity(0))
    quota = _cpu_quota(cgroup)
    return max(1, cores if quota is None else min(cores, math.ceil(quota)))


def _cpu_quota(cgroup: Path) -> float | None:
    """The CPUs' worth of time the cgroup may use (cgroup v2's cpu.max, else v1's CFS quota and
    period); None where no quota is set or none can be read."""
    for files, unlimited in (((cgroup / "cpu.max",), "max"),
                             ((cgroup / "cpu" / "cpu.cfs_quota_us",
                               cgroup / "cpu" / "cpu.cfs_period_us"), "-1")):
        try:
            words = " ".join(path.read_text() for path in files).split()
            if words[0] == unlimited:
                return None
            quota, period = int(words[0]), int(words[1])
        except (OSError, ValueError, IndexError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


_RUN_DIR: ContextVar[Path | None] = ContextVar("run_dir", default=None)


def default_run_dir() -> Path:
    """Where internal ipc:// sockets live unless addresses are given: `$MMLANE_RUN_DIR`, or
    the folder of `run_dir_defaults` while configs are built inside it."""
    return _RUN_DIR.get() or Path(
        os.environ.get("MMLANE_RUN_DIR") or Path(tempfile.gettempdir()) / "mmlane"
    )


@contextlib.contextmanager
def run_dir_defaults(run_dir: Path) -> Iterator[None]:
    """Configs built inside default their ipc:// sockets to `run_dir`: the launcher builds its
    children's configs as the children, started with MMLANE_RUN_DIR=RUN_DIR, would."""
    token = _RUN_DIR.set(run_dir)
    try:
        yield
    finally:
        _RUN_DIR.reset(token)


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on loopback addresses only ('', '*' and 0.0.0.0 do not): an
    address, or a name that resolves to loopback addresses alone."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name or an interface: loopback if everything it names is
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(
            ipaddress.ip_address(str(info[4][0]).partition("%")[0]).is_loopback for info in infos)


def ipc(name: str, run_dir: Path | None = None) -> str:
    return f"ipc://{(run_dir or default_run_dir()) / name}.sock"


def process_name(role: str, endpoint: str) -> str:
    """A name that tells this process from others of its role on one machine, from the address
    it serves on: 'frontend-8765' for tcp port 8765, 'mm-worker-2' for ipc://.../mm-worker-2.sock."""
    address = endpoint.partition("://")[2]
    if endpoint.startswith("ipc://"):
        stem = Path(address).stem
        return stem if stem.startswith(role) else f"{role}-{stem}"
    port = address.rpartition(":")[2]
    return f"{role}-{port}" if port.isdigit() else role


class OpsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How a role is watched and stopped; the same settings for every role."""

    name: str = ""
    """What stats and health call this process; "": its role and port or socket name."""
    stats_endpoint: str = ""
    """Where the role binds its stats socket (PUB); "": ipc://RUN_DIR/stats-NAME.sock."""
    control_endpoint: str = ""
    """Where the role answers pings (ROUTER); "": ipc://RUN_DIR/control-NAME.sock."""
    stats_interval_s: float = 1.0
    """Seconds between two published Stats messages."""
    drain_timeout_s: float = 30.0
    """At SIGTERM: seconds to finish the requests held before failing them (retryable)."""

    def __post_init__(self) -> None:
        _positive(self, "stats_interval_s")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be 0 or more, got {self.drain_timeout_s}")

    def named(self, name: str) -> OpsConfig:
        """These settings with the default endpoints of the process called `name`."""
        name = self.name or name
        return msgspec.structs.replace(
            self, name=name, stats_endpoint=self.stats_endpoint or ipc(f"stats-{name}"),
            control_endpoint=self.control_endpoint or ipc(f"control-{name}"),
        )


class SecurityConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How this role's sockets to the other roles are secured: ZMQ CURVE on tcp (README,
    "Across hosts"), file permissions on ipc."""

    curve_keys: str = ""
    """Folder of CURVE keys (`mmlane keys`): this role's own pair (ROLE.key, ROLE.key_secret)
    and the public key of each role it accepts (engine.key, mm-worker.key, frontend.key). Its
    tcp sockets to other roles are then encrypted, and only peers holding an accepted key are
    served; "": plain tcp, allowed on loopback addresses only (unless insecure_tcp)."""
    insecure_tcp: bool = False
    """Allow binding plain tcp (no curve_keys) on a non-loopback address: anyone who can reach
    the port can submit work and read replies. For a network that is private by other means."""

    def __post_init__(self) -> None:
        if self.curve_keys and not Path(self.curve_keys).is_dir():
            raise ValueError(f"curve_keys {self.curve_keys!r} is not a directory")


IMAGE_NICE = 10
"""How many nice steps below the text lanes image work runs by default (`image_nice`): on the
2-core CPU VM, text under a stream of 12 MP photos took 1.5-2 ms less at the median, with as
many images done (BENCHMARKS.md, "Image work below text on shared cores"). Linux's SCHED_IDLE
measured no better, and would starve images while text fills the cores: at 10 they keep about
a tenth of a core."""


MM_CACHE_GB = 0.25
"""The feature caches' capacity by default (`mm_cache_gb`), in GiB: an MM worker's sender cache
and the engine's receiver cache that mirrors it hold the same. Sized for a laptop: the engine
holds up to this much per MM worker, in tensors. On a server, give what repeats (a chat's
images come again each turn): 4 or more, as deploy/ does (vLLM's own cache defaults to 4)."""


def check_nice(config: msgspec.Struct, name: str) -> None:
    if not 0 <= getattr(config, name) <= 19:
        raise ValueError(f"{name} must be 0 (off) to 19, got {getattr(config, name)}")


ImageBackend = Literal["auto", "pil", "torchvision"]
"""Which of transformers' image-processor backends renders images. 'pil' is the reference and
needs no torchvision; 'torchvision' is what vLLM's renderer uses, so pixels made with it equal
vLLM's own; 'auto' is transformers' choice: torchvision when it imports, else PIL."""


def default_of(config_type: type[msgspec.Struct], name: str) -> Any:
    """The default of `config_type`'s setting `name`: a place that offers the same setting (the
    bench's, a role's helper) takes its default from the setting's home instead of writing it
    again."""
    for field in msgspec.structs.fields(config_type):
        if field.name == name:
            if field.default is not msgspec.NODEFAULT:
                return field.default
            if field.default_factory is not msgspec.NODEFAULT:
                return field.default_factory()
            raise ValueError(f"{config_type.__name__}.{name} has no default")
    raise ValueError(f"{config_type.__name__} has no setting {name!r}")


def load_config(config_type: type[C], values: dict[str, Any]) -> C:
    """Build a config from settings, refusing unknown keys and bad values by name."""
    try:
        return msgspec.convert(values, config_type)
    except (msgspec.ValidationError, ValueError) as exc:
        raise FatalError(f"invalid {config_type.__name__}: {exc}", code="bad_config") from exc


def handed_config(config_type: type[C], config_json: str) -> C:
    """The config a parent handed a child process as `--config-json`: msgspec JSON, or "-" to
    read it from stdin (the launcher's way: a command line is visible to every user)."""
    text = sys.stdin.buffer.read() if config_json == "-" else config_json
    try:
        values = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise FatalError(f"invalid {config_type.__name__} JSON: {exc}", code="bad_config") from exc
    return load_config(config_type, values)


def _positive(config: msgspec.Struct, *names: str) -> None:
    for name in names:
        if not getattr(config, name) > 0:  # NaN too
            raise ValueError(f"{name} must be positive, got {getattr(config, name)}")
