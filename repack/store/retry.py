"""How a request to object storage is retried, and how long a silent server is waited for: in
one place, for every command, the loader and read-ahead (docs/objstore.md, "Failures and
retries").

Long jobs meet every transient failure of a busy object store sooner or later: throttling
(``503 SlowDown``, ``429``), server errors (``500``, ``502``, ``503``, ``504``), connections
refused, reset or closed, a reply cut mid-way, and servers that do not answer. Each request
of :class:`~repack.store.s3.S3Store` runs in a :class:`Retry`:

* **what is retried**: the failures above (:func:`transient`) and ``409
  ConditionalRequestConflict`` (S3 asks for that one to be retried); a reply cut mid-way is
  not asked again whole: the store asks for the bytes still missing, pinned to the ETag of
  the first reply (``If-Match``), so that the pieces are of one version. What another attempt
  cannot change is never retried: a refusal (not found, access denied, a precondition), a
  TLS or certificate error, an endpoint that is no valid URL;
* **how many times**: ``AWS_MAX_ATTEMPTS`` (or ``max_attempts`` in the profile of the AWS
  config file) attempts per request, repack's default :data:`DEFAULT_ATTEMPTS`; an attempt
  that brought some of the missing bytes counts none;
* **how long it waits**: full jitter, a random wait in ``[0, min(MAX_DELAY, FIRST_DELAY *
  2**n))`` before retry ``n + 1`` (1, 2, 4, 8, 16, then 20 s at most): with 10 attempts a
  request gives up after 111 s of waits at most, about 55 s on average;
* **an endpoint that is not there** (connection refused, a host name that does not resolve):
  :data:`UNREACHED_ATTEMPTS` attempts while the endpoint has not answered this process yet (a
  typo, a closed port, a server not started: one line in a second or so, not after a
  minute); once it has answered, a server that went away is being restarted: the whole
  budget applies, each wait at least half its bound (equal jitter: with 10 attempts, 55 s
  of waits at least), so that a restart is ridden out whatever the draw, not only on
  average;
* **a silent server**: a request that waits for an answer (to connect, or for a byte of the
  reply) :data:`STALL_ENV` seconds in all (default :data:`DEFAULT_STALL`, over all its
  attempts and the waits between them) fails with :class:`~repack.errors.Stalled`, naming the
  object and the setting; each attempt waits at most a quarter of it. From then on, until the
  server answers again, the process makes one attempt (a probe) at most every quarter of the
  bound, and every other request fails at once the same way: read-ahead, the loader's own
  read and a command's next request do not each wait the whole bound again, and a server
  back is found within a quarter of the bound.

botocore's own retries are off (one attempt per botocore call: its count, and ours, would
multiply); its ``adaptive`` mode (``AWS_RETRY_MODE=adaptive`` or ``retry_mode`` in the config
file), which also slows the client down when the server throttles, is kept when the user
asks for it. ``standard`` and ``legacy`` both mean repack's policy above.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from repack import interrupt
from repack.errors import InputError, Stalled

__all__ = [
    "ATTEMPTS_ENV",
    "DEFAULT_ATTEMPTS",
    "DEFAULT_STALL",
    "FIRST_DELAY",
    "MAX_DELAY",
    "MODE_ENV",
    "STALL_ENV",
    "UNREACHED_ATTEMPTS",
    "Policy",
    "Verdict",
    "Retry",
    "policy",
    "transient",
]

T = TypeVar("T")

#: Attempts per request (botocore's variable, honoured), and repack's default.
ATTEMPTS_ENV = "AWS_MAX_ATTEMPTS"
DEFAULT_ATTEMPTS = 10
#: botocore's retry mode: ``adaptive`` keeps botocore's client-side rate limiter.
MODE_ENV = "AWS_RETRY_MODE"
#: Seconds a request waits in all for a server that does not answer, and its default.
STALL_ENV = "REPACK_S3_STALL_TIMEOUT"
DEFAULT_STALL = 120.0
#: Attempts of a request to an endpoint that refuses connections, or whose name does not
#: resolve, while it has not answered this process yet.
UNREACHED_ATTEMPTS = 2
#: The longest first wait, doubled at each retry up to :data:`MAX_DELAY` (seconds).
FIRST_DELAY = 1.0
MAX_DELAY = 20.0

#: Error codes of a server asking the client to slow down (botocore's list, and S3's).
THROTTLING = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "TransactionInProgressException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "RequestThrottled",
        "SlowDown",
        "PriorRequestNotComplete",
        "EC2ThrottledException",
    }
)
#: Error codes and statuses of a failure that may not happen again.
TRANSIENT_CODES = frozenset(
    {"RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable"}
)
#: A conditional write that met another one in flight on the same key (409): S3 asks for it
#: to be retried; it was not applied, and it is no refusal of the condition.
CONFLICT = "ConditionalRequestConflict"
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Policy:
    """The retry settings in force (:func:`policy`)."""

    #: Attempts per request.
    attempts: int
    #: botocore's retry mode as the user set it (None: not set).
    mode: str | None
    #: Seconds a request waits in all for a server that does not answer.
    stall: float
    #: Where ``attempts`` came from, for messages: ``AWS_MAX_ATTEMPTS=3``, ``max_attempts = 3
    #: in the AWS config file`` or repack's default.
    attempts_from: str = ""
    #: The endpoint's URL, to know whether it has answered this process yet.
    endpoint: str = ""

    @property
    def timeout(self) -> float:
        """Seconds one attempt waits to connect, and for each byte of a reply."""
        return max(0.05, self.stall / 4)

    def botocore_retries(self) -> dict:
        """botocore's ``retries`` setting: one attempt per call (the retries are ours), in
        the user's ``adaptive`` mode if asked for (its client-side rate limiting)."""
        mode = "adaptive" if self.mode == "adaptive" else "standard"
        return {"mode": mode, "total_max_attempts": 1}


def _number(name: str, text: str, kind: type, least: float):
    try:
        value = kind(text.strip())
    except ValueError:
        value = None
    if value is None or value < least:
        what = "a whole number" if kind is int else "a number of seconds"
        raise InputError(f"{name}={text!r}: expected {what}, at least {least:g}")
    return value


def policy(scoped_config: dict | None = None) -> Policy:
    """The settings from the environment and ``scoped_config`` (the AWS config file's
    profile in use, as botocore reads it).

    Raises:
        InputError: a setting that is no number, or out of range.
    """
    scoped = scoped_config or {}
    text = os.environ.get(ATTEMPTS_ENV, "").strip()
    if text:
        attempts, source = _number(ATTEMPTS_ENV, text, int, 1), f"{ATTEMPTS_ENV}={text}"
    elif str(scoped.get("max_attempts", "")).strip():
        found = str(scoped["max_attempts"])
        attempts = _number("max_attempts (AWS config file)", found, int, 1)
        source = f"max_attempts = {found} in the AWS config file"
    else:
        attempts, source = DEFAULT_ATTEMPTS, f"repack's default; {ATTEMPTS_ENV} sets it"
    mode = os.environ.get(MODE_ENV, "").strip() or str(scoped.get("retry_mode", "")).strip()
    if mode and mode not in ("legacy", "standard", "adaptive"):
        raise InputError(f"{MODE_ENV}={mode!r}: expected legacy, standard or adaptive")
    text = os.environ.get(STALL_ENV, "").strip()
    stall = _number(STALL_ENV, text, float, 0.1) if text else DEFAULT_STALL
    return Policy(attempts, mode or None, stall, source)


def _botocore():
    import botocore.exceptions

    return botocore.exceptions


class Verdict(NamedTuple):
    """What a failed attempt says (:func:`transient`)."""

    #: Another attempt may succeed.
    retry: bool
    #: The server was silent (a connect or read timeout).
    stall: bool
    #: The request may have been applied (a write whose reply was lost).
    uncertain: bool
    #: No connection was made: refused, or the host name does not resolve.
    unreachable: bool = False
    #: The server answered (an error reply): it is there.
    replied: bool = False


def transient(err: BaseException) -> Verdict:
    """What the botocore (or urllib3) error ``err`` of an attempt says."""
    exceptions = _botocore()
    urllib3 = _urllib3()
    if isinstance(err, exceptions.ClientError):
        response = getattr(err, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in THROTTLING or code == CONFLICT:
            return Verdict(True, False, False, replied=True)
        if code in TRANSIENT_CODES or status in TRANSIENT_STATUS:
            return Verdict(True, False, True, replied=True)
        return Verdict(False, False, False, replied=True)
    # what another attempt cannot change: TLS (a certificate, a plain-HTTP port spoken to in
    # TLS), and an endpoint that is no valid URL (botocore's SSLError is a ConnectionError)
    if isinstance(err, (exceptions.SSLError, urllib3.SSLError, urllib3.LocationValueError)):
        return Verdict(False, False, False)
    if isinstance(err, exceptions.ConnectTimeoutError):
        return Verdict(True, True, False)
    if isinstance(err, (exceptions.ReadTimeoutError, urllib3.TimeoutError)):
        return Verdict(True, True, True)
    if isinstance(err, exceptions.EndpointConnectionError):
        return Verdict(True, False, False, unreachable=True)  # nothing was sent
    if isinstance(
        err,
        (
            exceptions.ConnectionError,
            exceptions.HTTPClientError,  # closed, reset, a reply cut mid-way
            exceptions.IncompleteReadError,
            urllib3.HTTPError,  # the body of an error reply cut (botocore reads it as is)
        ),
    ):
        return Verdict(True, False, True)
    return Verdict(False, False, False)


def _urllib3():
    import urllib3.exceptions

    return urllib3.exceptions


#: The endpoints that answered this process (its parent's included: a forked DataLoader
#: worker's endpoint is there).
_answered: set[str] = set()


class _Silence:
    """When a request of this process last gave up on a silent (or gone) server, and the
    probe that may find it back (see the module)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: When the last request gave up, or the last probe found no answer (None: the
        #: server answered since).
        self.gave_up: float | None = None
        #: Seconds that request waited.
        self.waited = 0.0
        #: Whether a probe is in flight.
        self.probing = False

    def admit(self, interval: float) -> bool | float:
        """For a request starting now: True to go ahead as usual, False to go ahead as the
        probe (one attempt), or the seconds waited by the request that gave up (fail at
        once)."""
        if self.gave_up is None:
            return True
        with self.lock:
            if self.gave_up is None:
                return True
            if self.probing or time.monotonic() - self.gave_up < interval:
                return self.waited
            self.probing = True
            return False

    def heard(self) -> None:
        """The server answered."""
        if self.gave_up is not None or self.probing:
            with self.lock:
                self.gave_up, self.probing = None, False

    def silent(self, waited: float | None = None) -> None:
        """A request gave up (``waited`` seconds), or a probe found no answer."""
        with self.lock:
            self.gave_up, self.probing = time.monotonic(), False
            if waited is not None:
                self.waited = waited


_silence = _Silence()


def _forget_after_fork() -> None:
    global _silence
    _silence = _Silence()


os.register_at_fork(after_in_child=_forget_after_fork)


class Retry:
    """The attempts of one request on the object ``where``.

    Use :meth:`run` for a request that is one call, or :meth:`failed` / :meth:`answered`
    from a loop of one's own (a read that asks for the rest of a reply cut mid-way).
    """

    def __init__(self, where: str, settings: Policy) -> None:
        self.where = where
        self.policy = settings
        #: Failed attempts in a row (without progress).
        self.failures = 0
        #: Attempts made.
        self.tried = 0
        #: Seconds spent waiting for a silent server (attempts that timed out, and the waits
        #: after them).
        self.stalled = 0.0
        #: Whether a failed attempt may have been applied by the server (a write whose reply
        #: was lost): a conditional write refused afterwards may be refused by its own effect.
        self.uncertain = False
        #: Why the attempts ended before the count was spent, for :meth:`spent`.
        self._cut_short = ""
        #: Whether this request is the probe of a server that fell silent.
        self._probe = False
        self.started = time.monotonic()
        self._attempt_started = self.started

    def begin(self) -> None:
        """An attempt starts: fails at once if a request of this process gave up on a silent
        server, unless this attempt is the probe that may find it back (at most one per
        quarter of the bound).

        Raises:
            Stalled: it did, and this is no probe.
        """
        if not self._probe:
            admitted = _silence.admit(self.policy.timeout)
            if admitted is not True:
                if admitted is not False:
                    raise self._stalled(admitted, again=True)
                self._probe = True
        self.tried += 1
        self._attempt_started = time.monotonic()

    def answered(self) -> None:
        """The server answered (a reply, or bytes of one): the count of failures in a row
        starts again, and a silence is counted from now."""
        self.failures = 0
        self._attempt_started = time.monotonic()
        self._heard()

    def _heard(self) -> None:
        """The server is there (a reply, an error reply): the silence is over."""
        self._probe = False
        _silence.heard()
        if self.policy.endpoint not in _answered:
            _answered.add(self.policy.endpoint)

    def failed(self, err: BaseException) -> None:
        """An attempt failed with ``err``: return after the wait before the next attempt, or
        raise ``err`` when it is no transient failure or the attempts are spent, or
        :class:`~repack.errors.Stalled` when the server was silent too long."""
        verdict = transient(err)
        if verdict.replied:
            self._heard()  # an error reply is an answer (the failures in a row still count)
        elif self._probe:
            # the probe found no answer either: fail as the others do, and let the next
            # probe come a quarter of the bound from now
            self._probe = False
            _silence.silent()
            if verdict.retry:
                raise self._stalled(_silence.waited, again=True, probed=True) from None
        if not verdict.retry:
            raise err
        self.uncertain = self.uncertain or verdict.uncertain
        self.failures += 1
        now = time.monotonic()
        settings = self.policy
        bound = min(MAX_DELAY, FIRST_DELAY * 2 ** (self.failures - 1))
        delay = random.uniform(0, bound)
        if verdict.unreachable:
            if settings.endpoint not in _answered:
                if self.tried >= UNREACHED_ATTEMPTS:
                    self._cut_short = (
                        "the endpoint has not answered this process; is it the right one?"
                    )
                    raise err
            else:
                # a server that answered is being restarted: at least half of each wait
                # (equal jitter), so that the attempts ride out a restart whatever the draw
                # (10 attempts: 55 s at least), not only on average
                delay = random.uniform(bound / 2, bound)
        if verdict.stall:
            self.stalled += now - self._attempt_started
            if self.stalled + delay + settings.timeout > settings.stall:
                _silence.silent(self.stalled)
                raise self._stalled(self.stalled) from None
        if self.failures >= settings.attempts:
            raise err
        if verdict.stall:
            self.stalled += delay
        interrupt.pause(delay)

    def run(self, attempt: Callable[[], T]) -> T:
        """``attempt()``, tried again as :meth:`failed` says."""
        while True:
            self.begin()
            try:
                result = attempt()
            except Exception as err:
                self.failed(err)
                continue
            self.answered()
            return result

    def spent(self) -> str:
        """What was tried, for the message of a failure past the retries: empty when the
        first attempt failed for good."""
        if self.tried < 2:
            return ""
        elapsed = time.monotonic() - self.started
        why = self._cut_short or self.policy.attempts_from
        return f"; {self.tried} attempts in {elapsed:.0f} s ({why})"

    def _stalled(self, waited: float, again: bool = False, probed: bool = False) -> Stalled:
        bound = self.policy.stall
        waited = f"{waited:.1f}" if waited < 10 else f"{waited:.0f}"
        if again:
            why = (
                f"no answer from the server; a request of this process waited {waited} s "
                "for one moments ago"
            )
            if probed:
                why += ", and one attempt now got none either"
        else:
            why = f"no answer from the server in {waited} s"
        return Stalled(
            f"{self.where}: {why} ({STALL_ENV}={bound:g} bounds the wait)", location=self.where
        )
