"""How a request to object storage is retried, and how long a silent server is waited for: in
one place, for every command, the loader and read-ahead (docs/objstore.md, "Failures and
retries").

Long jobs meet every transient failure of a busy object store sooner or later: throttling
(``503 SlowDown``, ``429``), server errors (``500``, ``502``, ``503``, ``504``), connections
refused, reset or closed, a reply cut mid-way, and servers that do not answer. Each request
of :class:`~repack.store.s3.S3Store` runs in a :class:`Retry`:

* **what is retried**: the failures above (:func:`transient`); a reply cut mid-way is not
  asked again whole: the store asks for the bytes still missing, pinned to the ETag of the
  first reply (``If-Match``), so that the pieces are of one version;
* **how many times**: ``AWS_MAX_ATTEMPTS`` (or ``max_attempts`` in the profile of the AWS
  config file) attempts per request, repack's default :data:`DEFAULT_ATTEMPTS`; an attempt
  that brought some of the missing bytes counts none;
* **how long it waits**: full jitter, a random wait in ``[0, min(MAX_DELAY, FIRST_DELAY *
  2**n))`` before retry ``n + 1`` (1, 2, 4, 8, 16, then 20 s at most): with 10 attempts a
  request gives up after 111 s of waits at most, about 55 s on average;
* **a silent server**: a request that waits for an answer (to connect, or for a byte of the
  reply) :data:`STALL_ENV` seconds in all (default :data:`DEFAULT_STALL`, over all its
  attempts and the waits between them) fails with :class:`~repack.errors.Stalled`, naming the
  object and the setting; each attempt waits at most a quarter of it. For the next
  :data:`STALL_ENV` seconds, every request of the process then fails at once the same way
  (unless one gets an answer meanwhile): read-ahead, the loader's own read and a command's
  next request do not each wait the whole bound again.

botocore's own retries are off (one attempt per botocore call: its count, and ours, would
multiply); its ``adaptive`` mode (``AWS_RETRY_MODE=adaptive`` or ``retry_mode`` in the config
file), which also slows the client down when the server throttles, is kept when the user
asks for it. ``standard`` and ``legacy`` both mean repack's policy above.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

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
    "Policy",
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


def transient(err: BaseException) -> tuple[bool, bool, bool]:
    """``(retry it, a stall, the request may have been applied)`` for a botocore error."""
    exceptions = _botocore()
    if isinstance(err, exceptions.ClientError):
        response = getattr(err, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in THROTTLING:
            return True, False, False
        if code in TRANSIENT_CODES or status in TRANSIENT_STATUS:
            return True, False, True
        return False, False, False
    if isinstance(err, exceptions.ConnectTimeoutError):
        return True, True, False
    if isinstance(err, (exceptions.ReadTimeoutError, _urllib3().TimeoutError)):
        return True, True, True
    if isinstance(err, exceptions.EndpointConnectionError):
        return True, False, False  # refused: nothing was sent
    if isinstance(
        err,
        (
            exceptions.ConnectionError,
            exceptions.HTTPClientError,  # closed, reset, a reply cut mid-way
            exceptions.IncompleteReadError,
            _urllib3().HTTPError,  # the body of an error reply cut (botocore reads it as is)
        ),
    ):
        return True, False, True
    return False, False, False


def _urllib3():
    import urllib3.exceptions

    return urllib3.exceptions


class _Silence:
    """When a request of this process last gave up on a silent server (see the module)."""

    def __init__(self) -> None:
        self.gave_up: float | None = None
        self.waited = 0.0

    def recent(self, bound: float) -> float | None:
        at = self.gave_up
        if at is None or time.monotonic() - at >= bound:
            return None
        return self.waited


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
        self.started = time.monotonic()
        self._attempt_started = self.started

    def begin(self) -> None:
        """An attempt starts: fails at once if a request of this process just gave up on a
        silent server.

        Raises:
            Stalled: it did.
        """
        waited = _silence.recent(self.policy.stall)
        if waited is not None:
            raise self._stalled(waited, again=True)
        self.tried += 1
        self._attempt_started = time.monotonic()

    def answered(self) -> None:
        """The server answered (a reply, or bytes of one): the count of failures in a row
        starts again, and a silence is counted from now."""
        self.failures = 0
        self._attempt_started = time.monotonic()
        _silence.gave_up = None

    def failed(self, err: BaseException) -> None:
        """An attempt failed with ``err``: return after the wait before the next attempt, or
        raise ``err`` when it is no transient failure or the attempts are spent, or
        :class:`~repack.errors.Stalled` when the server was silent too long."""
        retry, stall, uncertain = transient(err)
        if not retry:
            raise err
        self.uncertain = self.uncertain or uncertain
        self.failures += 1
        now = time.monotonic()
        settings = self.policy
        delay = random.uniform(0, min(MAX_DELAY, FIRST_DELAY * 2 ** (self.failures - 1)))
        if stall:
            self.stalled += now - self._attempt_started
            if self.stalled + delay + settings.timeout > settings.stall:
                _silence.gave_up, _silence.waited = now, self.stalled
                raise self._stalled(self.stalled) from None
        if self.failures >= settings.attempts:
            raise err
        if stall:
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
        return f"; {self.tried} attempts in {elapsed:.0f} s ({self.policy.attempts_from})"

    def _stalled(self, waited: float, again: bool = False) -> Stalled:
        bound = self.policy.stall
        waited = f"{waited:.1f}" if waited < 10 else f"{waited:.0f}"
        why = (
            f"no answer from the server; a request of this process waited {waited} s "
            "for one moments ago"
            if again
            else f"no answer from the server in {waited} s"
        )
        return Stalled(
            f"{self.where}: {why} ({STALL_ENV}={bound:g} bounds the wait)", location=self.where
        )
