"""Encode and decode messages as ZMQ multipart frames: msgpack first, then one frame per array.

Every `np.ndarray` inside a message is replaced in the msgpack by a `TensorHeader` (dtype, shape,
frame index) and its buffer is sent as its own frame with `copy=False`; the receiver rebuilds it
with `np.frombuffer` over the received frame, without a copy. A codec is built once by the object
that owns the socket and is not shared between threads.

On one host a codec may move large arrays through shared memory instead (protocol/shm.py): the
sender's codec is given a `ShmWriter`, and its header then names a block (`shm`) instead of a
frame. Only a decoder built with `accept_shm` (one that reads an ipc socket) takes such headers;
any other refuses them, so nothing on a tcp socket can make a process open a file. A header
whose block is gone, or refused, leaves the rest of the message to decode: the codec raises
`TensorsLost` or `TensorsRefused` with it, so that its sender is still answered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from mmlane.protocol import shm
from mmlane.protocol.errors import RequestError, TensorsLost, TensorsRefused, translate

T = TypeVar("T")

# Arrays whose dtype is not in this set are refused: it keeps `frombuffer` to plain numbers.
_ALLOWED_DTYPES = frozenset(
    np.dtype(t).str for t in ("u1", "i1", "i2", "i4", "i8", "f2", "f4", "f8", "bool")
)


class TensorHeader(msgspec.Struct, array_like=True, frozen=True):
    """What stands in the msgpack for an array: its dtype, shape and frame number."""

    dtype: str
    shape: tuple[int, ...]
    frame: int
    """The frame that holds the bytes; 0 when `shm` names the shared-memory block instead."""
    shm: str = ""


class Codec(Generic[T]):
    """Encoder for any message, typed decoder for one union (the messages of one socket)."""

    def __init__(self, decode_type: Any, *, shm_writer: shm.ShmSender | None = None,
                 accept_shm: bool = False) -> None:
        self._out_frames: list[memoryview] = []
        self._in_frames: Sequence[Any] = ()
        self._used_frames: set[int] = set()
        self._shm_writer = shm_writer
        self._shm_reader = shm.ShmReader() if accept_shm else None
        self._lost: list[str] = []
        self._refused: list[str] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_array)
        self._decoder = msgspec.msgpack.Decoder(decode_type, dec_hook=self._dec_array)

    def encode(self, message: msgspec.Struct) -> list[Any]:
        """Return the frames to send: the msgpack body, then each array's buffer."""
        self._out_frames = []
        try:
            body = self._encoder.encode(message)
            return [body, *self._out_frames]
        finally:
            self._out_frames = []

    def decode(self, frames: Sequence[Any]) -> T:
        """Rebuild a message from received frames (bytes or zmq.Frame); raises RequestError.

        Whatever fails while decoding is the frames' fault, whoever sent them: msgspec's
        errors, and also a RecursionError from msgpack nested too deeply, which msgspec does
        not wrap. A frame that no tensor of the message uses is refused too, so that a sender
        whose frames and header disagree is told at once."""
        if not frames:
            raise RequestError("empty message", code="invalid_message")
        self._in_frames = frames
        self._used_frames = set()
        try:
            message = self._decoder.decode(_buffer(frames[0]))
        except Exception as exc:
            raise translate(exc, "undecodable message", default="invalid_message") from exc
        finally:
            self._in_frames = ()
            lost, self._lost = self._lost, []
            refused, self._refused = self._refused, []
        if len(self._used_frames) != len(frames) - 1:
            raise RequestError(
                f"undecodable message: {len(frames) - 1} frames after the body, but its "
                f"tensors use {len(self._used_frames)}", code="invalid_message",
            )
        if refused:
            raise TensorsRefused(f"{len(refused)} shared-memory tensor(s) refused: {refused[0]}",
                                 decoded=message)
        if lost:
            raise TensorsLost(
                f"{len(lost)} shared-memory tensor(s) were gone on arrival ({lost[0]}, ...): "
                "their sender restarted, or they waited too long", decoded=message,
            )
        return message

    def _enc_array(self, obj: Any) -> Any:
        if not isinstance(obj, np.ndarray):
            raise NotImplementedError(f"cannot encode {type(obj).__name__}")
        array = np.ascontiguousarray(obj)
        if self._shm_writer is not None:
            name = self._shm_writer.put(array)
            if name is not None:
                return TensorHeader(array.dtype.str, array.shape, 0, name)
        self._out_frames.append(memoryview(array.data).cast("B"))
        return TensorHeader(array.dtype.str, array.shape, len(self._out_frames))

    def _dec_array(self, type_: type, obj: Any) -> Any:
        if type_ is not np.ndarray:
            raise NotImplementedError(f"cannot decode {type_!r}")
        header = msgspec.convert(obj, TensorHeader)
        if header.dtype not in _ALLOWED_DTYPES:
            raise ValueError(f"unsupported tensor dtype {header.dtype!r}")
        if header.shm:
            return self._take_shm(header)
        if not 0 < header.frame < len(self._in_frames):
            raise ValueError(f"tensor frame {header.frame} missing ({len(self._in_frames)} frames)")
        if header.frame in self._used_frames:
            raise ValueError(f"tensor frame {header.frame} is used twice")
        self._used_frames.add(header.frame)
        buffer = _buffer(self._in_frames[header.frame])
        dtype = np.dtype(header.dtype)
        if any(d < 0 for d in header.shape):
            raise ValueError(f"tensor frame {header.frame}: negative dimension in {header.shape}")
        expected = dtype.itemsize * math.prod(header.shape)  # Python ints: no overflow
        if len(buffer) != expected:
            raise ValueError(
                f"tensor frame {header.frame} holds {len(buffer)} bytes, "
                f"shape {header.shape} of {header.dtype} needs {expected}"
            )
        return np.frombuffer(buffer, dtype=dtype).reshape(header.shape)

    def _take_shm(self, header: TensorHeader) -> np.ndarray:
        if self._shm_reader is None:
            raise ValueError("shared-memory tensors are refused on this socket")
        dtype = np.dtype(header.dtype)
        try:
            array = self._shm_reader.take(header.shm, dtype, header.shape)
        except shm.SlotRefused as exc:
            self._refused.append(str(exc))
            return np.empty(0, dtype)
        if array is None:
            self._lost.append(header.shm)
            return np.empty(0, dtype)
        return array


def _buffer(frame: Any) -> Any:
    """The bytes of a frame without copying (zmq.Frame exposes `.buffer`)."""
    return getattr(frame, "buffer", frame)
