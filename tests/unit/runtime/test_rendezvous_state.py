"""When the etcd-v3 backend calls a stored state corrupt, decided without etcd."""

from __future__ import annotations

from elasticjob_runtime.rendezvous.backend import state_digest, state_problem
from elasticjob_runtime.rendezvous.keys import state_digest_key

DIGEST_KEY = state_digest_key("run")


def test_the_digest_sits_beside_the_state_under_the_run_prefix() -> None:
    assert DIGEST_KEY == "/elasticjob/run/rdzv/state.sha256"


def test_a_state_with_the_digest_written_with_it_is_sound() -> None:
    assert state_problem(b'{"number": 3}', state_digest(b'{"number": 3}'), DIGEST_KEY) is None
    assert state_problem(b"", state_digest(b""), DIGEST_KEY) is None


def test_a_state_without_a_digest_was_written_by_something_else() -> None:
    problem = state_problem(b"non_base64", None, DIGEST_KEY)
    assert problem is not None
    assert DIGEST_KEY in problem and "missing" in problem


def test_a_state_that_does_not_match_its_digest_was_overwritten() -> None:
    problem = state_problem(b"garbage", state_digest(b"the round"), DIGEST_KEY)
    assert problem is not None
    assert DIGEST_KEY in problem and "overwrote" in problem
