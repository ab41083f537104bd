"""The engine's transport between processes: process groups over a rendezvous store, ``Link`` (messages of a kind,
int64 metadata and raw tensor bytes over torch.distributed point-to-point), the control keys (``Control``) through
which worker processes report to their driver, and the loopback rendezvous store of a single host. Used by the
pipeline's stages (engine/stage.py) and AFD's ranks (engine/afd/)."""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

# a recv on an idle stage must not time out (gloo applies the group timeout to recv too)
IDLE_TIMEOUT = datetime.timedelta(days=30)


class PeerLost(RuntimeError):
    """A send/recv failed because a neighbouring stage went away."""


def make_group(store: Any, name: str, rank: int, size: int, device: torch.device, local: bool) -> Any:
    """A process group over ``store`` without touching torch.distributed's global default group."""
    prefixed = dist.PrefixStore(name, store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = IDLE_TIMEOUT
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = IDLE_TIMEOUT
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if local:
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    elif ifname:
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=i) for i in ifname.split(",")]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(prefixed, rank, size, opts)


SLOT_BYTES = 32 * 1024  # on CPU (gloo), every message travels in a slot of this size that the receiver posts ahead
SLOTS_AHEAD = 4  # slots kept posted per peer (messages that can arrive while the receiver computes)
# sends kept in flight before the oldest is waited on: gloo's send work reports completion only once waited on
# (is_completed() stays False), so without a bound every message's buffer was kept for the process's life (a stage of
# a one-layer-per-stage pipeline grew ~12 MB per 8 x 32-token generation, and pruning the list cost more each send).
# A pipeline has at most M micro-batches in the chain, so a send this old has been received: the wait returns at once
MAX_PENDING_SENDS = 64
_SLOT_HDR = 32  # int64 kind, body bytes, metadata values, send time (ns)
_SLOT_TAG, _REST_TAG = 1, 2  # gloo tags of slots and of the remainders of larger messages (raw messages use tag 0)


class Link:
    """Messages over one process group: ``kind``, int64 metadata and raw tensor bytes.

    On CPU (gloo) the receiver keeps ``SLOTS_AHEAD`` recvs of ``slot_bytes`` posted, in order, for the next messages
    from every peer it has heard from: a fixed-size slot holds a 32-byte header (kind, body bytes, metadata count,
    send time), the metadata and the start of the payload; a larger body's remainder follows as a second message
    (its own tag) of known size. Why: gloo moves a send that meets a posted recv in one trip, but a message that
    arrives while its receiver is busy computing waits for a recv-ready handshake, and gloo's event loop thread
    spins meanwhile (measured on the 2-stage pipeline with 2 micro-batches: its loop threads used ~1 CPU-second per
    256 micro-batch steps, stealing the cores the stages compute on). On other devices a message is an int64
    header [kind, nbytes, nmeta] then the payload. Sends are asynchronous; buffers are kept alive until their send
    completes."""

    def __init__(self, pg: Any, device: torch.device, slot_bytes: int = SLOT_BYTES):
        self.pg = pg
        self.device = device
        self.slot_bytes = slot_bytes if device.type == "cpu" else 0
        self._pending: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._slots: dict[int, collections.deque[tuple[torch.Tensor, Any]]] = {}

    def _put(self, dst: int, t: torch.Tensor, tag: int = 0) -> None:
        try:
            self._pending.append((self.pg.send([t], dst, tag), t))
        except RuntimeError as e:
            raise PeerLost(str(e)) from None
        self._prune()

    def _post(self, src: int, buf: torch.Tensor, tag: int = 0) -> Any:
        try:
            return self.pg.recv([buf], src, tag)
        except RuntimeError as e:
            raise PeerLost(str(e)) from None

    def _wait(self, work: Any, sent_ns: Any) -> None:
        """Wait for a posted recv (``sent_ns()`` reads the message's send time; subclasses use it to split the wait)."""
        try:
            work.wait()
        except RuntimeError as e:
            raise PeerLost(str(e)) from None

    def send(self, dst: int, kind: int, meta: list[int], tensors: list[torch.Tensor] = ()) -> None:
        m = torch.tensor(meta, dtype=torch.int64).view(torch.uint8)
        parts = [m.to(self.device)] + [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        body = torch.cat(parts) if len(parts) > 1 else parts[0]
        if self.slot_bytes:
            n = min(body.numel(), self.slot_bytes - _SLOT_HDR)
            first = torch.empty(self.slot_bytes, dtype=torch.uint8)
            first[:_SLOT_HDR] = torch.tensor([kind, body.numel(), len(meta), time.time_ns()], dtype=torch.int64).view(
                torch.uint8
            )
            first[_SLOT_HDR:_SLOT_HDR + n] = body[:n]
            self._put(dst, first, _SLOT_TAG)
            if body.numel() > n:
                self._put(dst, body[n:], _REST_TAG)
        else:
            self._put(dst, torch.tensor([kind, body.numel(), len(meta)], dtype=torch.int64, device=self.device))
            if body.numel():
                self._put(dst, body)

    def post(self, src: int) -> None:
        """Keep ``SLOTS_AHEAD`` slot recvs from ``src`` posted (topped up after every message)."""
        if self.slot_bytes:
            q = self._slots.setdefault(src, collections.deque())
            while len(q) < SLOTS_AHEAD:
                buf = torch.empty(self.slot_bytes, dtype=torch.uint8)
                q.append((buf, self._post(src, buf, _SLOT_TAG)))

    def recv(self, src: int) -> tuple[int, list[int], torch.Tensor]:
        if not self.slot_bytes:
            hdr = torch.empty(3, dtype=torch.int64, device=self.device)
            self._wait(self._post(src, hdr), lambda: 0)
            kind, nbytes, nmeta = (int(v) for v in hdr.tolist())
            body = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if nbytes:
                self._wait(self._post(src, body), lambda: 0)
        else:
            self.post(src)
            buf, work = self._slots[src].popleft()
            hdr = buf[:_SLOT_HDR].view(torch.int64)
            self._wait(work, lambda: hdr[3])
            kind, nbytes, nmeta = (int(v) for v in hdr[:3].tolist())
            n = min(nbytes, self.slot_bytes - _SLOT_HDR)
            body = buf[_SLOT_HDR:_SLOT_HDR + n]
            rest = torch.empty(nbytes - n, dtype=torch.uint8) if nbytes > n else None
            self.post(src)
            if rest is not None:
                rest_work = self._post(src, rest, _REST_TAG)
                self._wait(rest_work, lambda: hdr[3])
                body = torch.cat([body, rest])
        meta = body[: 8 * nmeta].view(torch.int64).tolist() if nmeta else []
        return kind, meta, body[8 * nmeta:]

    def _prune(self) -> None:
        """Release the buffers of finished sends: the completed ones at the front, then (gloo) wait on the oldest
        beyond MAX_PENDING_SENDS."""
        try:
            while self._pending and self._pending[0][0].is_completed():
                self._pending.popleft()
            while len(self._pending) > MAX_PENDING_SENDS:
                self._pending.popleft()[0].wait()
        except RuntimeError as e:
            raise PeerLost(str(e)) from None

    def close(self) -> None:
        """Drop the process group and the work posted on it (the group's threads and sockets go with the last
        reference)."""
        self._pending.clear()
        self._slots.clear()
        self.pg = None

    def flush(self) -> None:
        try:
            for w, _ in self._pending:
                w.wait()
        except RuntimeError as e:
            raise PeerLost(str(e)) from None
        self._pending.clear()


def json_meta(obj: Any) -> list[int]:
    """A small control payload (BEGIN) as int64 metadata: the UTF-8 bytes of its JSON."""
    return list(json.dumps(obj).encode())


def meta_json(meta: list[int]) -> Any:
    return json.loads(bytes(meta).decode())


class Control:
    """Keys in the rendezvous store through which stages report liveness, progress and errors to the driver."""

    def __init__(self, store: Any, run_id: str):
        self.store = store
        self.run = run_id

    def key(self, what: str, rank: int | None = None) -> str:
        return f"waferline/{self.run}/{what}" + (f"/{rank}" if rank is not None else "")

    def set(self, what: str, rank: int | None, value: str) -> None:
        self.store.set(self.key(what, rank), value)

    def get(self, what: str, rank: int | None = None) -> str | None:
        k = self.key(what, rank)
        if not self.store.check([k]):
            return None
        return self.store.get(k).decode(errors="replace")


LOOPBACK = "127.0.0.1"


def loopback_store(world_size: int, timeout: datetime.timedelta, port: int = 0, host: str = LOOPBACK) -> Any:
    """The rendezvous store of processes on this host, its server listening on ``host`` (a loopback address, IPv4
    or IPv6) only, on ``port`` (0: any free port; the store's ``port`` says which).

    A TCPStore server otherwise listens on every interface, and it has no authentication: whoever reaches the port
    could join the run's process groups or rewrite its keys. So the socket is bound here and handed to the store
    (``master_listen_fd``). Several hosts rendezvous through the address given to torchrun instead."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the descriptor from here on
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout,
                             master_listen_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def loopback_host(addr: str) -> str | None:
    """The loopback address that ``addr`` names (``localhost`` is 127.0.0.1; IPv6's ``::1`` too), or None for any
    other address."""
    import ipaddress

    if addr == "localhost":
        return LOOPBACK
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    return str(ip) if ip.is_loopback else None


def _client_of(store: Any, load: dict[str, Any]) -> Any:
    """A second connection to the rendezvous store for the publisher thread (store clients are not shared)."""
    host, port = load["store_addr"]
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
