"""The producer's handoff state machine, exhaustively and without engines: every
transition of every state, every lease-timer edge, an abort in every state, and when
vLLM may free a request's blocks. The transport is an in-memory port that records
what the handoffs asked of it."""

from __future__ import annotations

import itertools
import time

import pytest

from vllm_omni_kv.connector.handoff import (
    Handoff,
    HandoffState,
    HandoffStateError,
    ProducerHandoffs,
)
from vllm_omni_kv.errors import OmniKVError

S = HandoffState
ALL = list(S)

#: the legal moves, written out from the module's diagram: (state, method) -> new state
LEGAL = {
    (S.PUBLISHED, "extend"): S.PUBLISHED,
    (S.CLAIMED, "extend"): S.CLAIMED,
    (S.PUBLISHED, "claim"): S.CLAIMED,
    (S.PUBLISHED, "release"): S.RELEASED,
    (S.CLAIMED, "release"): S.RELEASED,
    (S.PUBLISHED, "expire"): S.EXPIRED,
    (S.CLAIMED, "expire"): S.EXPIRED,
    (S.PUBLISHED, "withdraw"): S.WITHDRAWN,
    (S.PUBLISHED, "revoke"): S.WITHDRAWN,
    (S.CLAIMED, "revoke"): S.WITHDRAWN,
}
METHODS = ("extend", "claim", "release", "expire", "withdraw", "revoke")


class Port:
    """The transport as the handoffs see it: leases, payloads and holds in memory."""

    def __init__(self) -> None:
        self.lease: dict[str, float | None] = {}
        self.withdrawn: list[tuple[str, int]] = []
        self.released: set[str] = set()
        self.reading: set[str] = set()  # holds a consumer is copying under
        self.taken_back: list[str] = []
        self.revoked: list[str] = []
        self.expired_holds: list[str] = []
        self.refuse_expiry = False  # a region that cannot take a hold from its reader

    def lease_until(self, key: str) -> float | None:
        return self.lease.get(key, 0.0)

    def withdraw(self, key: str, parts: int) -> None:
        self.withdrawn.append((key, parts))

    def hold_released(self, hold: str) -> bool:
        return hold in self.released

    def revoke(self, hold: str) -> None:
        self.revoked.append(hold)

    def take_back(self, hold: str) -> bool:
        if hold in self.reading:
            return False
        self.taken_back.append(hold)
        return True

    def expire_hold(self, hold: str) -> bool:
        if self.refuse_expiry:
            return False
        self.expired_holds.append(hold)  # marked and gone; its reader's copy will fail
        return True


def _in(state: HandoffState, hold: str = "") -> Handoff:
    h = Handoff("r", "k", 10.0, hold)
    h.state = state
    return h


@pytest.mark.parametrize(("state", "method"), list(itertools.product(ALL, METHODS)))
def test_every_transition_of_every_state(state: HandoffState, method: str) -> None:
    h = _in(state)
    call = getattr(h, method)
    args = (5.0,) if method == "extend" else ()
    to = LEGAL.get((state, method))
    if to is None:
        with pytest.raises(HandoffStateError, match=f"from {state.value}"):
            call(*args)
        assert h.state is state, "a refused transition changed the state"
    else:
        call(*args)
        assert h.state is to


def test_the_state_error_is_one_of_ours() -> None:
    assert issubclass(HandoffStateError, OmniKVError)


def test_an_extension_never_shortens_the_lease() -> None:
    h = _in(S.PUBLISHED)
    h.extend(20.0)
    h.extend(15.0)
    assert h.deadline == 20.0


def test_which_payloads_let_vllm_free_the_blocks() -> None:
    for state in ALL:
        assert _in(state).blocks_free, "a packed payload is a copy: blocks free at once"
        shared = _in(state, hold="h")
        assert shared.blocks_free == (state in {S.RELEASED, S.EXPIRED, S.WITHDRAWN, S.FAILED})


# -- the owner: lease timer edges --------------------------------------------------------
def _owner(ttl: float = 1.0, grace: float = 30.0) -> tuple[ProducerHandoffs, Port]:
    port = Port()
    return ProducerHandoffs(port, ttl, grace=grace, timer=False), port


def test_a_lease_is_due_exactly_at_its_deadline() -> None:
    own, port = _owner()
    h = own.published("r", "k", parts=3)
    own.check(h.deadline - 1e-6)
    assert h.state is S.PUBLISHED and not port.withdrawn
    own.check(h.deadline)
    assert h.state is S.EXPIRED and port.withdrawn == [("k", 3)] and own.expired == 1


def test_an_extension_to_exactly_now_does_not_count() -> None:
    own, port = _owner()
    h = own.published("r", "k")
    port.lease["k"] = h.deadline
    own.check(h.deadline)
    assert h.state is S.EXPIRED and own.expired == 1


def test_an_extension_into_the_future_moves_the_deadline() -> None:
    own, port = _owner()
    h = own.published("r", "k")
    port.lease["k"] = h.deadline + 30
    own.check(h.deadline)
    assert h.state is S.PUBLISHED and h.deadline == port.lease["k"] and not port.withdrawn
    port.lease["k"] = 0.0  # the consumer stopped extending
    own.check(h.deadline)
    assert h.state is S.EXPIRED and own.expired == 1


def test_a_packed_payload_gone_at_its_deadline_was_consumed() -> None:
    own, port = _owner()
    h = own.published("r", "k", parts=2)
    port.lease["k"] = None
    own.check(h.deadline)
    assert h.state is S.RELEASED and own.expired == 0
    assert port.withdrawn == [("k", 2)]  # what a backend that cannot tell still holds


def test_a_shared_payload_released_before_its_deadline() -> None:
    own, port = _owner()
    h = own.published("r", "k", hold="h")
    port.released.add("h")
    own.check(h.deadline - 0.5)
    assert h.state is S.RELEASED and not port.taken_back and own.expired == 0


def test_a_shared_payload_being_read_at_its_deadline_is_claimed_then_released() -> None:
    own, port = _owner()
    h = own.published("r", "k", hold="h")
    port.reading.add("h")
    own.check(h.deadline)
    assert h.state is S.CLAIMED and not port.withdrawn
    own.check(h.deadline + 5)  # still read: still claimed
    assert h.state is S.CLAIMED
    port.reading.discard("h")
    port.released.add("h")
    own.check(h.deadline + 6)
    assert h.state is S.RELEASED and own.expired == 0


def test_a_claim_past_the_lease_and_its_grace_is_taken_back_from_its_reader() -> None:
    own, port = _owner(grace=2.0)
    h = own.published("r", "k", hold="h")
    port.reading.add("h")  # a reader holds it and never lets go (stopped, stuck)
    own.check(h.deadline)
    own.check(h.deadline + 2.0 - 1e-6)
    assert h.state is S.CLAIMED and not port.expired_holds and own.done({"r"}) == set()
    own.check(h.deadline + 2.0)
    assert h.state is S.EXPIRED and port.expired_holds == ["h"]
    assert port.withdrawn == [("k", 1)] and own.expired == 1
    assert own.done(set()) == {"r"}, "vLLM may free the blocks now"


def test_blocks_a_reader_cannot_be_told_to_drop_stay_held() -> None:
    """A hold the region could not take back from its reader keeps the blocks from vLLM
    (a copy of reused pages would pass); the next tick tries again."""
    own, port = _owner(grace=2.0)
    h = own.published("r", "k", hold="h")
    port.reading.add("h")
    port.refuse_expiry = True
    own.check(h.deadline + 2.0)
    assert h.state is S.CLAIMED and own.done({"r"}) == set() and not port.withdrawn
    port.refuse_expiry = False
    own.check(h.deadline + 3.0)
    assert h.state is S.EXPIRED and port.expired_holds == ["h"]
    assert own.done(set()) == {"r"}


def test_a_claimed_payload_whose_reader_died_expires() -> None:
    own, port = _owner()
    h = own.published("r", "k", hold="h")
    port.reading.add("h")
    own.check(h.deadline)
    port.reading.discard("h")  # its lock went with its process; it never released
    own.check(h.deadline + 1)
    assert h.state is S.EXPIRED and port.taken_back == ["h"] and own.expired == 1


def test_a_lease_check_that_fails_expires_the_payload() -> None:
    own, port = _owner()

    def broken(key: str) -> float | None:
        raise OSError("backend gone")

    port.lease_until = broken  # type: ignore[method-assign]
    h = own.published("r", "k")
    own.check(h.deadline)
    assert h.state is S.EXPIRED


# -- aborts (withdraw) in every state ------------------------------------------------------
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("state", ALL)
def test_an_abort_in_every_state(state: HandoffState, shared: bool) -> None:
    own, port = _owner()
    h = own.published("r", "k", hold="h" if shared else "")
    h.state = state
    own.withdraw(["r"])
    if state is S.PUBLISHED:
        assert h.state is S.WITHDRAWN and port.withdrawn == [("k", 1)]
        assert port.taken_back == (["h"] if shared else [])
        assert own.expired == 0
    else:  # a reader copying keeps its claim; ended handoffs stay ended
        assert h.state is state and not port.withdrawn and not port.taken_back


def test_an_abort_while_a_reader_copies_keeps_the_blocks_until_it_releases() -> None:
    own, port = _owner()
    h = own.published("r", "k", hold="h")
    port.reading.add("h")
    own.withdraw(["r"])
    assert h.state is S.CLAIMED
    assert own.done({"r"}) == set()
    port.reading.discard("h")
    port.released.add("h")
    assert own.done(set()) == {"r"} and h.state is S.RELEASED


def test_an_abort_of_an_unknown_request_is_a_no_op() -> None:
    own, port = _owner()
    own.withdraw(["nobody"])
    assert not port.withdrawn and len(own) == 0


# -- preemption (vLLM freed the blocks) ---------------------------------------------------
@pytest.mark.parametrize("state", ALL)
def test_a_preemption_in_every_state(state: HandoffState) -> None:
    own, port = _owner()
    h = own.published("r", "k", hold="h")
    h.state = state
    own.revoke(["r"])
    if state in (S.PUBLISHED, S.CLAIMED):
        assert h.state is S.WITHDRAWN and port.revoked == ["h"]
        assert port.withdrawn == [("k", 1)]
    else:
        assert h.state is state and not port.revoked and not port.withdrawn


def test_a_preempted_request_is_not_reported_and_its_resend_starts_anew() -> None:
    own, port = _owner()
    own.published("r", "k", hold="h")
    port.reading.add("h")  # a consumer is copying: it is told through the revoke mark
    own.revoke(["r"])
    assert port.revoked == ["h"] and own.done(set()) == set()
    h2 = own.published("r", "k", hold="h2")  # saved again after the recompute
    assert own.done({"r"}) == set(), "the new payload's blocks are still named"
    port.released.add("h2")
    assert own.done(set()) == {"r"} and h2.state is S.RELEASED


# -- reporting (finished_sending) ----------------------------------------------------------
def test_a_packed_request_is_reported_once_vllm_finished_it() -> None:
    own, _port = _owner()
    h = own.published("r", "k")
    assert own.done(set()) == set()
    assert own.done({"r"}) == {"r"}
    assert own.done({"r"}) == set(), "reported twice"
    assert h.state is S.PUBLISHED and len(own) == 1  # the lease goes on after the report


def test_a_shared_request_waits_for_every_payload() -> None:
    own, port = _owner()
    own.published("r", "k0", hold="h0")
    own.published("r", "k1", hold="h1")  # two target ranks
    assert own.done({"r"}) == set()
    port.released.add("h0")
    assert own.done(set()) == set()
    port.released.add("h1")
    assert own.done(set()) == {"r"}
    assert own.state_of("r") == [], "a reported, ended request is forgotten"


def test_a_failed_send_is_reported_and_withdraws_what_it_published() -> None:
    own, port = _owner()
    own.published("r", "k0", hold="h0")
    own.failed("r")
    assert own.state_of("r") == [S.WITHDRAWN, S.FAILED]
    assert port.taken_back == ["h0"] and port.withdrawn == [("k0", 1)]
    assert own.done({"r"}) == {"r"}


def test_an_idle_step_waits_for_a_hold_then_reports() -> None:
    own, port = _owner()
    own.published("r", "k", hold="h")
    t0 = time.monotonic()
    assert own.done({"r"}, wait=0.05) == set()
    assert 0.04 <= time.monotonic() - t0 < 1.0
    port.released.add("h")
    assert own.done(set(), wait=5.0) == {"r"}


def test_close_takes_back_every_live_hold() -> None:
    own, port = _owner()
    own.published("a", "ka", hold="ha")
    own.published("b", "kb", hold="hb")
    port.released.add("hb")
    own.check(0.0)
    own.close()
    assert port.taken_back == ["ha"] and len(own) == 0


def test_the_timer_expires_leases_with_no_engine_step() -> None:
    port = Port()
    own = ProducerHandoffs(port, 0.2)
    try:
        h = own.published("r", "k")
        deadline = time.monotonic() + 5
        while h.state is S.PUBLISHED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert h.state is S.EXPIRED and own.expired == 1
    finally:
        own.close()
