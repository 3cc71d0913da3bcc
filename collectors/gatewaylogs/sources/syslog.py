"""The `syslog` source: a gateway (nginx `access_log syslog:server=...`, ingress-nginx `enable-syslog`) or a
relay (rsyslog, syslog-ng) sends its access log as syslog messages, over UDP or TCP on the same port.

Messages are RFC 3164 (nginx) or RFC 5424 (relays); TCP frames are octet-counted or newline-framed
(RFC 6587), told apart frame by frame. The message part is one access-log line in the log's format.
What cannot be read is counted by reason (tally.REFUSED_REASONS), never raised: a frame cut short by its
connection's end or a header without its message (truncated), garbage (malformed), a message over
MAX_MESSAGE_BYTES (oversize), datagrams the kernel dropped with its receive queue full (kernel_drops,
Linux's SO_RXQ_OVFL), lines of a sender over `max_records_per_second` (over_rate). Memory stays bounded:
a connection buffers at most one message, and at most MAX_CONNECTIONS and MAX_SENDERS are tracked.
"""

from __future__ import annotations

import logging
import re
import selectors
import socket
import struct
import sys
import threading
import time
from collections import OrderedDict

from kvwatch.collectors.gatewaylogs.sources.base import Source
from kvwatch.collectors.gatewaylogs.tally import SessionTally
from kvwatch.core.errors import KVWatchError

log = logging.getLogger("kvwatch.gatewaylog")

DEFAULT_PORT = 5514  # syslog's 514 needs root
# A gateway's request line limit (nginx: 8 KiB) and rsyslog's default message size (8 KiB) keep real
# access-log messages far shorter.
MAX_MESSAGE_BYTES = 16 * 1024
MAX_CONNECTIONS = 256  # a connection over it is closed as it is accepted
MAX_SENDERS = 4096  # the rate of the least recently seen sender beyond it is forgotten
MAX_DATAGRAMS_PER_WAKE = 256  # then the TCP connections get their turn
_RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024  # asked of the kernel (which caps it at net.core.rmem_max)
_READ_BYTES = 64 * 1024
# Linux's socket option that reports, with each datagram, how many the receive queue dropped so far.
_SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40) if sys.platform.startswith("linux") else None
_COUNT = struct.Struct("I")
# A plain int: `&` with socket's IntFlag member runs enum's Python code for every datagram.
_MSG_TRUNC = int(socket.MSG_TRUNC)
_OCTET_COUNT_DIGITS = 7  # "16384 " and then some: more digits are no octet count

_RFC3164_TIME = re.compile(rb"[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d ")
# RFC 3164's optional host name and its tag (`nginx:` or `nginx[12]:`), before the message.
_RFC3164_TAG = re.compile(rb"(?:[^ :]+ )?[^ :\[]{1,48}(?:\[[^\]]*\])?: ")
_BOM = b"\xef\xbb\xbf"


class Refused(KVWatchError, ValueError):
    """A frame that is no access-log message; `reason` is one of tally.REFUSED_REASONS."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# The headers of most messages, read by one match: RFC 5424 without structured data (a relay's), and RFC
# 3164 (nginx's) read as _rfc3164_message reads it. Any other frame takes the step-by-step way.
_COMMON_HEADER = re.compile(
    rb"<(?P<priority>\d{1,3})>(?:1 (?:[^ ]* ){5}- |(?!1 )(?:"
    + _RFC3164_TIME.pattern
    + rb")?(?:"
    + _RFC3164_TAG.pattern
    + rb")?)"
)


def message_of(frame: bytes) -> bytes:
    """The message part of one syslog message, RFC 5424 or RFC 3164."""
    header = _COMMON_HEADER.match(frame)
    if header is None or int(header["priority"]) > 191:
        return _message_of(frame)
    return _checked_message(frame[header.end() :])


def _message_of(frame: bytes) -> bytes:
    """message_of step by step, which says why a frame has no message."""
    end = frame.find(b">", 2, 5)  # `<PRI>`: 1 to 3 digits, 191 at most
    if frame[:1] != b"<" or end < 0 or not frame[1:end].isdigit() or int(frame[1:end]) > 191:
        raise Refused("malformed")
    rest = frame[end + 1 :]
    return _checked_message(_rfc5424_message(rest[2:]) if rest.startswith(b"1 ") else _rfc3164_message(rest))


def _checked_message(message: bytes) -> bytes:
    message = message.removeprefix(_BOM).rstrip(b"\r\n\0")
    if not message:
        raise Refused("truncated")
    return message


def _rfc5424_message(rest: bytes) -> bytes:
    """After `<PRI>1 `: TIMESTAMP HOSTNAME APP-NAME PROCID MSGID STRUCTURED-DATA [SP MSG]."""
    fields = rest.split(b" ", 5)
    if len(fields) < 6:
        raise Refused("truncated")
    data = fields[5]
    if not data:
        raise Refused("truncated")
    if data.startswith(b"-"):
        return data[2:] if data[1:2] in (b" ", b"") else _refuse("malformed")
    if not data.startswith(b"["):
        raise Refused("malformed")
    end = _structured_data_end(data)
    return data[end + 1 :] if data[end : end + 1] in (b" ", b"") else _refuse("malformed")


def _structured_data_end(data: bytes) -> int:
    """Where the SD-ELEMENTs at the start of `data` end: `]` closes one outside a quoted value, in which
    `\\` escapes the next byte."""
    position, quoted = 0, False
    while position < len(data):
        byte = data[position]
        if quoted and byte == 0x5C:  # backslash
            position += 2
            continue
        if byte == 0x22:  # double quote
            quoted = not quoted
        elif byte == 0x5D and not quoted and data[position + 1 : position + 2] != b"[":  # ] not followed by [
            return position + 1
        position += 1
    raise Refused("truncated")


def _rfc3164_message(rest: bytes) -> bytes:
    if _RFC3164_TIME.match(rest):
        rest = rest[16:]
    tag = _RFC3164_TAG.match(rest)
    return rest[tag.end() :] if tag else rest


def _refuse(reason: str) -> bytes:
    raise Refused(reason)


class _Rates:
    """A token bucket per sender, so that one sender's flood is refused and the others' lines are not."""

    def __init__(self, per_second: float) -> None:
        self.per_second = per_second
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()  # sender -> [tokens, last refill]
        self._latest: tuple[str, list[float]] | None = None  # the last sender, already the most recent

    def admit(self, sender: str, now: float, wanted: int) -> int:
        """How many of `wanted` lines of `sender` at `now` fit its bucket; those are taken from it."""
        if self._latest is not None and self._latest[0] == sender:  # a burst from one sender: most lines
            bucket = self._latest[1]
        else:
            bucket = self._bucket(sender, now)
        bucket[0] = min(self.per_second, bucket[0] + (now - bucket[1]) * self.per_second)
        bucket[1] = now
        admitted = min(wanted, int(bucket[0]))  # never below 0: at most the whole tokens are taken
        bucket[0] -= admitted
        return admitted

    def _bucket(self, sender: str, now: float) -> list[float]:
        bucket = self._buckets.get(sender)
        if bucket is None:
            bucket = self._buckets[sender] = [self.per_second, now]
            if len(self._buckets) > MAX_SENDERS:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(sender)
        self._latest = (sender, bucket)
        return bucket


class _Connection:
    """One TCP sender's stream: what is buffered of its next frame, and what of an oversize one is left
    to skip (a byte count for an octet-counted frame, or up to the next newline)."""

    __slots__ = ("socket", "sender", "buffer", "skip_bytes", "skip_line")

    def __init__(self, connection: socket.socket, sender: str) -> None:
        self.socket, self.sender = connection, sender
        self.buffer = bytearray()
        self.skip_bytes, self.skip_line = 0, False


def listen_address(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class SyslogReceiver:
    """Receives one gateway log over syslog, UDP and TCP on the `listen` address of its config section,
    in a thread of its own that hands each message to `tally`."""

    def __init__(self, section, tally: SessionTally) -> None:
        self.host, self.port = listen_address(section.listen)
        self.tally = tally
        self._rates = _Rates(section.max_records_per_second)
        self._selector = selectors.DefaultSelector()
        self._sockets: list[socket.socket] = []
        self._connections: dict[int, _Connection] = {}
        self._kernel_drops = 0  # SO_RXQ_OVFL's count so far
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._wake_read, self._wake_write = socket.socketpair()

    def start(self) -> None:
        """Listen on UDP and TCP; returns once both are bound, else raises OSError."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            udp = self._bound(socket.socket(family, socket.SOCK_DGRAM))
            udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER_BYTES)
            if _SO_RXQ_OVFL is not None:
                udp.setsockopt(socket.SOL_SOCKET, _SO_RXQ_OVFL, 1)
            tcp = socket.socket(family, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._bound(tcp).listen(128)
        except OSError:
            self._close_all()
            raise
        self._selector.register(udp, selectors.EVENT_READ, self._read_datagrams)
        self._selector.register(tcp, selectors.EVENT_READ, self._accept)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name=f"syslog {self.tally.name}", daemon=True)
        self._thread.start()
        log.info(
            "gateway log %s: receiving syslog on %s:%d (UDP and TCP)", self.tally.name, self.host, self.port
        )

    def stop(self) -> None:
        """Stop receiving; returns once the thread has ended and every socket is closed."""
        if self._thread is not None and not self._stopping:
            self._stopping = True
            self._wake_write.send(b"x")
            self._thread.join()
        self._close_all()

    def _bound(self, sock: socket.socket) -> socket.socket:
        self._sockets.append(sock)
        sock.bind((self.host, self.port))
        sock.setblocking(False)
        return sock

    def _close_all(self) -> None:
        for connection in self._connections.values():
            connection.socket.close()
        self._connections.clear()
        for sock in (*self._sockets, self._wake_read, self._wake_write):
            sock.close()
        self._selector.close()

    def _run(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select():
                if key.data is not None and not self._stopping:
                    key.data(key.fileobj)

    # --- UDP --------------------------------------------------------------------------------------

    def _read_datagrams(self, udp: socket.socket) -> None:
        ancillary = socket.CMSG_SPACE(_COUNT.size) if _SO_RXQ_OVFL is not None else 0
        runs: list[tuple[str, list[bytes]]] = []  # (sender, its datagrams), in the order received
        for _ in range(MAX_DATAGRAMS_PER_WAKE):
            try:
                data, ancdata, flags, address = udp.recvmsg(MAX_MESSAGE_BYTES, ancillary)
            except BlockingIOError:
                break
            if ancdata:
                self._count_kernel_drops(ancdata)
            if flags & _MSG_TRUNC:
                self.tally.refuse("oversize")
            elif runs and runs[-1][0] == address[0]:
                runs[-1][1].append(data)
            else:
                runs.append((address[0], [data]))
        self._take(runs)

    def _count_kernel_drops(self, ancdata: list) -> None:
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == _SO_RXQ_OVFL and len(data) >= _COUNT.size:
                total = _COUNT.unpack_from(data)[0]
                if dropped := (total - self._kernel_drops) % 2**32:
                    self.tally.refuse("kernel_drops", dropped)
                self._kernel_drops = total

    # --- TCP --------------------------------------------------------------------------------------

    def _accept(self, tcp: socket.socket) -> None:
        try:
            connection, sender = tcp.accept()
        except OSError:  # the sender gave up first, or no descriptor is left: the others go on
            return
        if len(self._connections) >= MAX_CONNECTIONS:
            connection.close()
            return
        connection.setblocking(False)
        self._connections[connection.fileno()] = _Connection(connection, sender[0])
        self._selector.register(connection, selectors.EVENT_READ, self._read_stream)

    def _read_stream(self, sock: socket.socket) -> None:
        connection = self._connections[sock.fileno()]
        try:
            data = sock.recv(_READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the sender closed: a frame it began is cut short
            if connection.buffer.strip() and not connection.skip_line and not connection.skip_bytes:
                self.tally.refuse("truncated")
            self._selector.unregister(sock)
            del self._connections[sock.fileno()]
            sock.close()
            return
        connection.buffer += data
        frames: list[bytes] = []
        self._take_frames(connection, frames)
        self._take([(connection.sender, frames)])

    def _take_frames(self, connection: _Connection, frames: list[bytes]) -> None:
        """Collect every whole frame in the buffer; what is left is the start of the next one."""
        buffer = connection.buffer
        while buffer:
            if connection.skip_bytes:
                skipped = min(connection.skip_bytes, len(buffer))
                del buffer[:skipped]
                connection.skip_bytes -= skipped
            elif connection.skip_line:
                end = buffer.find(b"\n")
                del buffer[: len(buffer) if end < 0 else end + 1]
                connection.skip_line = end < 0
            elif buffer[0] in b"\r\n":
                del buffer[:1]
            elif not self._take_frame(connection, buffer, frames):
                return

    def _take_frame(self, connection: _Connection, buffer: bytearray, frames: list[bytes]) -> bool:
        """Collect the frame at the start of the buffer; False when it is not whole yet."""
        if buffer[:1].isdigit():  # octet counting: "LENGTH SP MESSAGE"
            space = buffer.find(b" ", 0, _OCTET_COUNT_DIGITS)
            if space < 0:
                if len(buffer) < _OCTET_COUNT_DIGITS and buffer.isdigit():
                    return False
                self.tally.refuse("malformed")
                connection.skip_line = True
                return True
            if not buffer[:space].isdigit():
                self.tally.refuse("malformed")
                connection.skip_line = True
                return True
            length = int(buffer[:space])
            if length > MAX_MESSAGE_BYTES:
                self.tally.refuse("oversize")
                del buffer[: space + 1]
                connection.skip_bytes = length
                return True
            if len(buffer) < space + 1 + length:
                return False
            frame = bytes(buffer[space + 1 : space + 1 + length])
            del buffer[: space + 1 + length]
        else:  # newline framing (a frame starts with "<"), or garbage up to the next newline
            end = buffer.find(b"\n")
            if end < 0:
                if len(buffer) <= MAX_MESSAGE_BYTES:
                    return False
                self.tally.refuse("oversize")
                connection.skip_line = True
                return True
            frame = bytes(buffer[:end])
            del buffer[: end + 1]
            if len(frame) > MAX_MESSAGE_BYTES:
                self.tally.refuse("oversize")
                return True
        frames.append(frame)
        return True

    # --- both -------------------------------------------------------------------------------------

    def _take(self, runs: list[tuple[str, list[bytes]]]) -> None:
        """The frames of one wake's datagrams, or of one TCP read, by sender: each sender held to its rate,
        each frame's message read or why it has none counted, the messages counted together."""
        now, messages = time.monotonic(), []
        for sender, frames in runs:
            admitted = self._rates.admit(sender, now, len(frames))
            if admitted < len(frames):
                self.tally.refuse("over_rate", len(frames) - admitted)
            for frame in frames[:admitted]:
                try:
                    messages.append(message_of(frame))
                except Refused as refused:
                    self.tally.refuse(refused.reason)
        if messages:
            self.tally.take_lines(messages, self.tally.clock())


SOURCE = Source(name="syslog", default_port=DEFAULT_PORT, receiver=SyslogReceiver)
