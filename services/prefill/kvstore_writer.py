"""The kvstore writer process: a prefill's write-back data path, out of the prefill's interpreter.

``python -m services.prefill.kvstore_writer SOCK_FD RING_FD`` (started by the prefill, kvstore_writeback.py):
SOCK_FD is this end of the socket pair the prefill made, RING_FD the write-back ring (a /dev/shm file the
prefill created and unlinked at once, so only the two processes' descriptors and mappings keep it). The
prefill's page export writes a finished prompt's new full pages straight into a span of the ring; this
process reads them there, computes each page's CRC-32, builds the Put messages already serialized
(``kvstore_pages.serialized_pieces``: the page bytes copied once) and sends them on its own grpc.aio channel
(the prefill's client certificate and CA), so none of that takes the prefill's GIL from its engine thread or
its event loop.

Control frames (``<u32 length><msgpack list>``, never pickle), typed by their first item:

* prefill -> writer: CONFIG ``[CONFIG, {settings}]`` (first), PUT ``[PUT, id, offset, pages, page bytes, [block hash...]]``,
  PING ``[PING, n]``, STOP;
* writer -> prefill: HELLO ``[HELLO, pid]`` (the ring is mapped and the channel made) or FATAL
  ``[FATAL, why]`` (then it exits), DONE ``[DONE, id, status, detail]`` once a PUT's span is no longer read
  (status ``ok``; ``unreachable``: the kvstore did not answer or the Put timed out; ``refused``: it answered
  with an error; ``bad``: the PUT broke a bound), PONG ``[PONG, n]``.

A span belongs to the prefill again only once its DONE is sent or this process has exited. Signals: SIGINT
and SIGTERM are ignored (a process group's signal reaches this process too; the prefill stops it with STOP
once it has drained, or kills it); the channel closing (the prefill exited) ends it at once.

No torch here: the process starts in well under a second and holds no device.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import signal
import socket
import struct
import sys
from collections.abc import Iterable
from typing import Any

import grpc
import msgpack

from services.common.checksum import checksum
from services.common.grpc_util import create_channel, rpc_error_summary
from services.common.kvstore_client import KVStoreClient
from services.common.kvstore_pages import DEFAULT_PIECE_BYTES, serialized_pieces
from services.common.logging import LoggingConfig, setup_logging
from services.common.tls import TLSConfig

log = logging.getLogger(__name__)

# prefill -> writer
CONFIG, PUT, PING, STOP = range(4)
# writer -> prefill
HELLO, FATAL, DONE, PONG = range(100, 104)

HEADER = struct.Struct("<I")
MAX_FRAME = 16 << 20
"""Largest control frame (bytes): a PUT names one 16-byte hash per page, so even 1 GiB of 4 KiB pages fits."""
RECONNECT_BACKOFF_MS = (500, 2000)
"""(first, longest) wait between reconnect attempts to a kvstore that went away (milliseconds)."""
WRITE_BACK_TIMEOUT_S = 60.0
"""Longest one background Put may take (seconds)."""
STOP_WAIT_S = 5.0
"""On STOP, how long Puts under way may take to finish before the process exits (seconds)."""
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
EXIT_BAD_START = 2


class WireError(RuntimeError):
    """A control frame broke the format (the channel is closed after it)."""


def encode(body: list[Any] | dict[str, Any]) -> bytes:
    packed = msgpack.packb(body, use_bin_type=True)
    if len(packed) > MAX_FRAME:
        raise WireError(f"control frame of {len(packed)} bytes (max {MAX_FRAME})")
    return HEADER.pack(len(packed)) + packed


def decode(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several types for malformed input
        raise WireError(f"control frame does not parse: {e}") from None


async def read_frame(reader: asyncio.StreamReader) -> Any | None:
    """The next frame's body, or None at the end of the channel."""
    try:
        header = await reader.readexactly(HEADER.size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    (n,) = HEADER.unpack(header)
    if not 0 < n <= MAX_FRAME:
        raise WireError(f"bad control frame length {n}")
    try:
        return decode(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def _recv_blocking(sock: socket.socket) -> Any | None:
    def exactly(n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            part = sock.recv(n - len(buf))
            if not part:
                return None
            buf += part
        return bytes(buf)

    header = exactly(HEADER.size)
    if header is None:
        return None
    (n,) = HEADER.unpack(header)
    if not 0 < n <= MAX_FRAME:
        raise WireError(f"bad control frame length {n}")
    body = exactly(n)
    return None if body is None else decode(body)


def put_problem(msg: list[Any], ring_bytes: int, page_bytes: int) -> str | None:
    """Why a PUT frame may not be served (its span outside the ring, another page size, hashes that do not
    match its pages), or None."""
    if len(msg) != 6:
        return f"PUT has {len(msg)} items, expected 6"
    _, _, off, n, pb, hashes = msg
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (off, n, pb)):
        return "PUT offset, pages and page bytes must be integers"
    if pb != page_bytes:
        return f"PUT pages of {pb} bytes, this writer's are {page_bytes}"
    if n <= 0 or off < 0 or off + n * pb > ring_bytes:
        return f"PUT span [{off}, {off + n * pb}) is not inside the {ring_bytes}-byte ring"
    if not isinstance(hashes, list) or len(hashes) != n or not all(isinstance(h, bytes) for h in hashes):
        return f"PUT names {n} pages but not one hash (bytes) for each"
    return None


def encode_pages(ring: memoryview | bytes, off: int, page_bytes: int, fp: str, hashes: Iterable[bytes],
                 piece_bytes: int) -> list[bytes]:
    """The Put messages of the pages at ``ring[off:]`` (one after another, ``page_bytes`` each), serialized,
    each with its page's CRC-32."""
    out: list[bytes] = []
    view = memoryview(ring)
    try:
        for i, h in enumerate(hashes):
            page = view[off + i * page_bytes:off + (i + 1) * page_bytes]
            out.extend(serialized_pieces(fp, h, page, checksum(page), piece_bytes))
            page.release()
    finally:
        view.release()
    return out


class Writer:
    def __init__(self, cfg: dict[str, Any], ring: mmap.mmap, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.fp = str(cfg["fingerprint"])
        self.page_bytes = int(cfg["page_bytes"])
        self.piece_bytes = int(cfg.get("piece_bytes") or DEFAULT_PIECE_BYTES)
        self.ring_bytes = int(cfg["ring_bytes"])
        self.timeout_s = float(cfg.get("timeout_s") or WRITE_BACK_TIMEOUT_S)
        self.ring = ring
        self.reader, self.writer = reader, writer
        tls = None
        if cfg.get("tls_cert"):
            tls = TLSConfig(tls_cert=cfg["tls_cert"], tls_key=cfg["tls_key"], tls_ca=cfg["tls_ca"],
                            tls_server_name=cfg.get("tls_server_name") or TLSConfig.tls_server_name)
        first, longest = RECONNECT_BACKOFF_MS
        self.channel = create_channel(str(cfg["address"]), tls=tls, options=[
            ("grpc.initial_reconnect_backoff_ms", first), ("grpc.min_reconnect_backoff_ms", first),
            ("grpc.max_reconnect_backoff_ms", longest)])
        self.client = KVStoreClient(self.channel, piece_bytes=self.piece_bytes)
        self.address = str(cfg["address"])
        self.tasks: set[asyncio.Task] = set()

    def send(self, body: list[Any]) -> None:
        self.writer.write(encode(body))

    async def run(self) -> None:
        """Serve PUTs until STOP (then let those under way finish, bounded) or the channel's end (at once)."""
        self.send([HELLO, os.getpid()])
        await self.writer.drain()
        stopping = False
        while True:
            try:
                msg = await read_frame(self.reader)
            except WireError as e:
                log.error("kvstore writer: %s; exiting", e)
                break
            if msg is None:
                break
            if not isinstance(msg, list) or not msg or not isinstance(msg[0], int):
                log.error("kvstore writer: a control frame that is not a typed list; exiting")
                break
            kind = msg[0]
            if kind == PUT:
                task = asyncio.create_task(self._put(msg))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif kind == PING:
                self.send([PONG, msg[1] if len(msg) > 1 else 0])
            elif kind == STOP:
                stopping = True
                break
            else:
                log.error("kvstore writer: unknown control frame type %r; exiting", kind)
                break
            await self.writer.drain()
        if stopping and self.tasks:
            await asyncio.wait(set(self.tasks), timeout=STOP_WAIT_S)
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.channel.close()

    async def _put(self, msg: list[Any]) -> None:
        wid = msg[1]
        bad = put_problem(msg, self.ring_bytes, self.page_bytes)
        if bad is not None:
            log.error("kvstore writer: %s", bad)
            self._done(wid, "bad", bad)
            return
        _, _, off, _, pb, hashes = msg
        try:
            messages = await asyncio.to_thread(encode_pages, self.ring, off, pb, self.fp, hashes, self.piece_bytes)
        except BaseException as e:
            self._done(wid, "bad", f"encoding failed: {e!r}")
            raise
        # The pages are copied into the messages: the span is no longer read, but it goes back only with the
        # answer below (one message per write).
        status, detail = "ok", ""
        try:
            await asyncio.wait_for(self.client.put_serialized(messages), self.timeout_s)
        except TimeoutError:
            status, detail = "unreachable", f"no answer within {self.timeout_s:.0f} s"
        except grpc.aio.AioRpcError as e:
            status = "unreachable" if e.code() in _UNREACHABLE else "refused"
            detail = rpc_error_summary(e)
        except Exception as e:  # the channel itself failed: still an answer, so the span goes back
            status, detail = "refused", repr(e)
        self._done(wid, status, detail)

    def _done(self, wid: Any, status: str, detail: str) -> None:
        try:
            self.send([DONE, wid, status, detail])
        except (ConnectionError, RuntimeError):  # the prefill went away: nothing to tell
            pass


async def _serve(sock: socket.socket, cfg: dict[str, Any], ring: mmap.mmap) -> None:
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_FRAME + HEADER.size)
    try:
        try:
            w = Writer(cfg, ring, reader, writer)
        except Exception as e:  # its settings (TLS files, address): the prefill logs the line
            writer.write(encode([FATAL, f"{type(e).__name__}: {e}"]))
            await writer.drain()
            raise
        await w.run()
    finally:
        writer.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not all(a.isdigit() for a in args):
        print("usage: python -m services.prefill.kvstore_writer SOCK_FD RING_FD (started by a prefill)",
              file=sys.stderr)
        return EXIT_BAD_START
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(args[0]))
    ring_fd = int(args[1])
    try:
        first = _recv_blocking(sock)
    except WireError as e:
        print(f"kvstore writer: {e}", file=sys.stderr)
        return EXIT_BAD_START
    if not (isinstance(first, list) and len(first) == 2 and first[0] == CONFIG and isinstance(first[1], dict)):
        print("kvstore writer: the prefill sent no CONFIG frame", file=sys.stderr)
        return EXIT_BAD_START
    cfg = first[1]
    setup_logging(str(cfg.get("service") or "prefill-kvstore-writer"),
                  LoggingConfig(log_level=str(cfg.get("log_level") or "INFO"),
                                log_format=str(cfg.get("log_format") or "text")))
    try:
        ring = mmap.mmap(ring_fd, int(cfg["ring_bytes"]), mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(ring_fd)
    except (OSError, ValueError, KeyError) as e:
        sock.sendall(encode([FATAL, f"cannot map the write-back ring: {e}"]))
        return EXIT_BAD_START
    try:
        asyncio.run(_serve(sock, cfg, ring))
    except Exception:  # told to the prefill as FATAL, or the channel broke
        log.debug("kvstore writer failed", exc_info=True)
        return EXIT_BAD_START
    return 0

if __name__ == "__main__":
    sys.exit(main())
