"""The consumer's half of NIXL's WRITE direction: ask a producer to WRITE a move into this
agent's registered memory, and wait for its end.

Per producer (its side-channel endpoint) this agent proves itself once (``nixl_sink``:
metadata, then the echo of the challenge the producer sent as a NIXL notification) and
sends each table set once (``nixl_tables``); a move is then one ``nixl_write`` per
:data:`~.write_wire.MAX_PAIRS` pages of a layer group (one for most moves), each ended by
the producer's notification ``D`` (done) or ``E`` (failed) + its nonce. A producer that
forgot this agent (a restart, an eviction) answers ``need_sink``/``need_tables`` and the
setup is sent again, once.

A move that fails or runs past ``timeout_s`` raises at once; bytes may land until the
producer says its writes ended, so the move is *waited out* off the pull thread
(:mod:`.wait_outs`): it raises :class:`~vllm_omni_kv.backends.pull.puller.ReadStillRunning`,
whose future keeps the memory the writes target until no write can land.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from vllm_omni_kv.backends.backoff import Backoff
from vllm_omni_kv.backends.keyed_locks import KeyedLocks
from vllm_omni_kv.backends.nixl import write_wire as ww
from vllm_omni_kv.backends.nixl.memory import Span
from vllm_omni_kv.backends.nixl.wait_outs import WaitOuts
from vllm_omni_kv.backends.pull.page_reads import PageReads, Read
from vllm_omni_kv.backends.pull.puller import ReadStillRunning
from vllm_omni_kv.backends.pull.side_channel import SideChannelClient
from vllm_omni_kv.errors import KVTransferError, KVTransferTimeout
from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

MAX_SENT_SETS = 256
#: pause before a request the producer answered ``busy`` is sent again
BUSY_RETRY_S = 0.002


class Notices:
    """NIXL notifications for this agent, handed to the thread waiting for each."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        self._waiting: dict[bytes, str] = {}  # nonce -> the producer agent it must come from
        self._ended: dict[bytes, bytes] = {}  # nonce -> b"D" | b"E"
        #: producer agent -> (digest of our request, its challenge once it came)
        self._challenges: dict[str, tuple[bytes, bytes]] = {}

    def expect(self, nonce: bytes, sender: str) -> None:
        with self._lock:
            self._waiting[nonce] = sender

    def expect_challenge(self, sender: str, digest: bytes) -> None:
        """Wait for ``sender``'s challenge to our request of ``digest`` (others are not
        ours: a client that copied our metadata may have asked too)."""
        with self._lock:
            self._challenges[sender] = (digest, b"")

    def forget(self, nonces: list[bytes]) -> None:
        with self._lock:
            for n in nonces:
                self._waiting.pop(n, None)
                self._ended.pop(n, None)

    def ended(self, nonce: bytes) -> bytes | None:
        return self.ended_of({nonce}).get(nonce)

    def ended_of(self, nonces: set[bytes]) -> dict[bytes, bytes]:
        """The ends of those of ``nonces`` that ended (one drain of the notifications)."""
        self._drain()
        with self._lock:
            return {n: self._ended[n] for n in nonces if n in self._ended}

    def challenge(self, sender: str) -> bytes | None:
        self._drain()
        with self._lock:
            got = self._challenges.get(sender)
            if got is None or not got[1]:
                return None
            del self._challenges[sender]
            return got[1]

    def _drain(self) -> None:
        with self._lock:
            try:
                news = self._agent.get_new_notifs()
            except Exception as e:
                logger.debug("NIXL get_new_notifs: %s", e)
                return
            for sender, msgs in news.items():
                name = sender.decode() if isinstance(sender, bytes) else str(sender)
                for m in msgs:
                    self._take(name, bytes(m))

    def _take(self, sender: str, m: bytes) -> None:
        kind, key = m[:1], m[1:]
        if kind in (b"D", b"E") and self._waiting.get(key) == sender:
            self._ended[key] = kind
            return
        challenge = ww.parse_challenge(m)
        want = self._challenges.get(sender)
        if challenge is not None and want is not None and challenge[1] == want[0]:
            self._challenges[sender] = (want[0], challenge[0])


class WriteClient:
    """Moves by producer WRITE for one agent (its ``name``, metadata and ``spans()``)."""

    def __init__(
        self,
        agent: Any,
        name: str,
        spans: Callable[[], list[Span]],
        client: SideChannelClient,
        side_channel_timeout_s: float,
        closed: Callable[[], bool],
    ) -> None:
        self._agent, self._name, self._spans, self._client = agent, name, spans, client
        self._sc_timeout = side_channel_timeout_s
        self._closed = closed
        self.notices = Notices(agent)
        self._wait_outs = WaitOuts(
            client, name, side_channel_timeout_s, self.notices.ended_of, self.notices.forget
        )
        self._lock = threading.Lock()
        #: one proof at a time per producer agent (each waits for that agent's challenge);
        #: proofs to other producers go on meanwhile
        self._proving = KeyedLocks()
        self._proven: dict[str, bytes] = {}  # endpoint -> our sink token there (its challenge)
        #: endpoint -> (our last proven token there, a challenge answered since): kept when
        #: ``_proven`` is forgotten, as a producer changes a sink's metadata only for a
        #: request carrying its token
        self._tokens: OrderedDict[str, tuple[bytes | None, bytes | None]] = OrderedDict()
        self._sets: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    def write_pages(self, endpoint: str, peer: str, reads: PageReads, timeout_s: float) -> None:
        """``reads`` (remote: the producer's tables) written by the producer into ours."""
        tid = ww.tables_id(reads.remote, reads.local)

        def setup(stale: bytes | None) -> None:
            self._prove(endpoint, peer, stale)
            if stale is not None or (endpoint, tid) not in self._sets:
                self._ask(endpoint, self._signed(endpoint, ww.tables_msg(self._name, reads)))
                with self._lock:
                    self._sets[(endpoint, tid)] = None
                    while len(self._sets) > MAX_SENT_SETS:
                        self._sets.popitem(last=False)

        self._move(
            endpoint, peer, ww.page_write_msgs(self._name, reads, timeout_s), setup, timeout_s
        )

    def write_ranges(self, endpoint: str, peer: str, reads: list[Read], timeout_s: float) -> None:
        """``(local, remote, bytes)`` ranges written by the producer into ours."""
        msgs = ww.range_write_msgs(self._name, reads, timeout_s)
        self._move(
            endpoint, peer, msgs, lambda stale: self._prove(endpoint, peer, stale), timeout_s
        )

    # -- setup -----------------------------------------------------------------------
    def _prove(self, endpoint: str, peer: str, stale: bytes | None) -> None:
        """Prove this agent at ``endpoint`` unless it is proven there; ``stale``: the token
        the producer no longer took (proven again, unless another thread did meanwhile:
        each proof replaces the token the other threads' writes carry)."""
        if stale is None and endpoint in self._proven:
            return
        with self._proving.held(peer):
            if self._proven.get(endpoint, stale) == stale:
                self._prove_now(endpoint, peer)

    def _prove_now(self, endpoint: str, peer: str) -> None:
        md, spans = self._agent.get_agent_metadata(), self._spans()
        self.notices.expect_challenge(peer, ww.sink_digest(md, spans))
        with self._lock:
            tokens = [t for t in self._tokens.get(endpoint, ()) if t is not None]
        self._ask(endpoint, ww.sink_msg(self._name, md, spans, tokens))
        got: list[bytes] = []

        def challenged() -> bool:
            challenge = self.notices.challenge(peer)
            if challenge is not None:
                got.append(challenge)
            return challenge is not None

        if not _poll(challenged, time.monotonic() + self._sc_timeout):
            raise KVTransferTimeout(
                f"NIXL agent {peer} at {endpoint} sent no challenge within "
                f"{self._sc_timeout:.1f}s: it cannot reach this agent (check UCX between "
                "the hosts) or is not a nixl backend"
            )
        self._keep_token(endpoint, got[0], proven=False)  # its proof may land unanswered
        self._ask(endpoint, ww.proof_msg(self._name, got[0]))
        self._keep_token(endpoint, got[0], proven=True)

    def _keep_token(self, endpoint: str, token: bytes, proven: bool) -> None:
        """Note ``token`` at ``endpoint``: our sink token there once ``proven``; before,
        a challenge whose proof may have landed unanswered (sent with the last proven)."""
        with self._lock:
            last, _answered = self._tokens.pop(endpoint, (None, None))
            self._tokens[endpoint] = (token, None) if proven else (last, token)
            while len(self._tokens) > MAX_SENT_SETS:
                self._tokens.popitem(last=False)
            if proven:
                self._proven[endpoint] = token

    def _signed(self, endpoint: str, msg: dict[str, Any]) -> dict[str, Any]:
        """``msg`` with this agent's sink token at ``endpoint`` (none yet: one the producer
        refuses as ``need_sink``)."""
        with self._lock:
            token = self._proven.get(endpoint, bytes(ww.NONCE_BYTES))
        return ww.with_token(msg, token)

    def _ask(self, endpoint: str, msg: dict[str, Any]) -> dict[str, Any]:
        """``msg``'s reply (asked again while the producer is ``busy``, up to the
        side-channel timeout); a refusal raises."""
        reply = self._request(endpoint, msg, time.monotonic() + self._sc_timeout)
        if not reply.get("ok"):
            raise KVTransferError(
                f"the producer at {endpoint} refused {msg['op']}: "
                f"{reply.get('error') or reply.get('reason')}"
            )
        return reply

    # -- one move --------------------------------------------------------------------
    def _move(
        self,
        endpoint: str,
        peer: str,
        msgs: list[dict[str, Any]],
        setup: Callable[[bytes | None], None],
        timeout_s: float,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        posted: dict[bytes, bytes] = {}  # nonce -> the token it was last sent with
        try:
            setup(None)
            for msg in msgs:
                self.notices.expect(msg["nonce"], peer)
                self._post(endpoint, msg, setup, deadline, posted)
            failed = self._wait(list(posted), deadline)
        except BaseException as e:
            ended = self._wait_outs.add(endpoint, posted)  # forgets them once over
            if ended.done():
                raise
            raise ReadStillRunning(
                f"{e}; the memory the writes target is kept until none can land", ended
            ) from None
        self.notices.forget(list(posted))
        if failed:
            raise KVTransferError(
                f"NIXL agent {peer} at {endpoint} reported a failed write ({failed} of "
                f"{len(posted)}): the producer's memory or the link failed"
            )

    def _post(
        self,
        endpoint: str,
        msg: dict[str, Any],
        setup: Callable[[bytes | None], None],
        deadline: float,
        posted: dict[bytes, bytes],
    ) -> None:
        """Send one write (again after a new setup where the producer asks for it); its
        token goes into ``posted`` first (an abort must carry the token it ran under)."""
        signed = self._signed(endpoint, msg)
        posted[msg["nonce"]] = signed["token"]
        reply = self._request(endpoint, signed, deadline)
        if reply.get("reason") in ("need_sink", "need_tables"):
            setup(signed["token"])
            signed = self._signed(endpoint, msg)
            posted[msg["nonce"]] = signed["token"]
            reply = self._request(endpoint, signed, deadline)
        if not reply.get("ok"):
            raise KVTransferError(
                f"the producer at {endpoint} refused a write: "
                f"{reply.get('error') or reply.get('reason')}"
            )

    def _request(self, endpoint: str, msg: dict[str, Any], deadline: float) -> dict[str, Any]:
        """``msg``'s reply; sent again while the producer answers ``busy`` (not run), until
        ``deadline``."""
        while True:
            reply = self._client.request(endpoint, msg, self._sc_timeout)
            if reply.get("reason") != "busy" or time.monotonic() > deadline:
                return reply
            time.sleep(BUSY_RETRY_S)

    def _wait(self, nonces: list[bytes], deadline: float) -> int:
        """Wait for every write's end; the number that failed. Raises past ``deadline``."""
        left, failed = set(nonces), []

        def all_ended() -> bool:
            for n, end in self.notices.ended_of(left).items():
                left.discard(n)
                failed.append(end == b"E")
            return not left

        if not _poll(all_ended, deadline, self._closed):
            raise KVTransferTimeout(f"{len(left)} NIXL writes did not end in time")
        return sum(failed)

    def close(self) -> None:
        """Let go of the agent (its engine is closing)."""
        self._wait_outs.close()
        self._agent = self.notices._agent = None

    def forget(self, endpoint: str | None = None) -> None:
        """Prove this agent (and send table sets) again at ``endpoint`` (None: everywhere,
        after this agent's registered memory changed)."""
        with self._lock:
            if endpoint is None:
                self._proven.clear()
                self._sets.clear()
                return
            self._proven.pop(endpoint, None)
            for key in [k for k in self._sets if k[0] == endpoint]:
                del self._sets[key]


def _poll(
    ready: Callable[[], bool], deadline: float, stop: Callable[[], bool] = lambda: False
) -> bool:
    """Call ``ready`` until it is true, sleeping a little longer each time
    (:class:`~.backoff.Backoff`); False once ``deadline`` (monotonic) passed or ``stop`` is
    true."""
    backoff = Backoff()
    while not ready():
        if time.monotonic() > deadline or stop():
            return False
        backoff.sleep()
    return True
