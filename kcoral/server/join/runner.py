# -*- test-case-name: tests.unit.test_join -*-
"""
One claimed job, from the node's own execute pipeline to the gateway.

L{JobRunner.run} hands the job's program to the server's C{/execute}
pipeline in process (L{kcoral.server.http.app.KcoralAPI.execute_program}):
the validation, blob caches, limits, seat line, worker, rendering, request
events, metrics and saved program of a client's request, without an HTTP
hop.  The blobs the caches lack are fetched from the gateway with the
job's token and hash-checked (L{kcoral.server.join.transfer}) while the
program waits, and go into the caches as uploaded blobs do: the next job
that needs one finds it there.  Whatever the pipeline answered (a result,
an error, a 503) goes to the gateway as the job's result: a small one as
a NATS request when the job names the gateway's result subjects
(L{kcoral.server.join.natsresult}), else, or when that finds no answer,
posted over HTTP, its large parts streamed from the worker's buffers.  A blob that fails its check is
never used: the job ends with an C{engine} error and the program does not
run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import attrs
from twisted.internet.defer import Deferred, FirstError, gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from kcoral.gateway.jobs import JobMessage
from kcoral.ipc.shared import SharedBuffer
from kcoral.server.http.app import Answer, FetchMissing
from kcoral.server.http.streaming import shared_bytes
from kcoral.server.join.natsresult import NatsResults
from kcoral.server.join.transfer import BlobRefused, GatewayLink
from kcoral.server.workers.line import PoolBusy
from kcoral.wire.errors import choose_request_id
from kcoral.wire.multipart import RequestTooLarge
from kcoral.wire.render import RequestError

__all__ = ["POOL_CLIENT", "JobRunner", "Pipeline", "pool_client"]

#: The client a pool job runs as, for the reuse scope, when its message
#: names none: the gateway's client identity, kept apart from direct ones.
POOL_CLIENT = "pool"


def pool_client(client: str | None) -> str:
    """
    The reuse-scope client of a pool job: the gateway's client (its token's
    client name or its address) under a C{pool:} prefix, so that no direct
    client of this node can pass for it, or C{pool} when none is named.
    """
    return POOL_CLIENT if client is None else f"{POOL_CLIENT}:{client}"


class BytesInFlight(Protocol):
    """
    The server's bytes in flight (L{kcoral.server.http.site.KcoralSite}:
    C{--max-bytes-in-flight}), which a job's fetched blobs and its result's
    buffers count against as an upload's and a response's do.
    """

    bytes_in_flight: int

    def reserve_bytes(self, size: int, held: int) -> bool: ...

    def release_bytes(self, size: int) -> None: ...


class Pipeline(Protocol):
    """The server's execute pipeline (L{kcoral.server.http.app.KcoralAPI})."""

    async def execute_program(
        self,
        request_id: str,
        program: bytes,
        client: str | None,
        *,
        fetch: FetchMissing | None = None,
        admitted: Callable[[], None] | None = None,
        gate: Callable[[], Deferred[bool]] | None = None,
        via: str = "in_process",
        finish_later: bool = False,
    ) -> Answer: ...


@attrs.define(eq=False)
class JobRunner:
    """
    Runs claimed jobs on the node's pipeline and posts their results.

    @ivar max_request_bytes: the node's C{--max-request-bytes}: a job whose
        program and missing blobs together exceed it is answered 413, as
        the upload of them would be.
    @ivar in_flight: the server's bytes in flight: blobs to fetch that do
        not fit are answered 503 (as an upload over the cap is), and a
        result's shared buffers count until they are posted; C{None}: no cap.
    @ivar nats: sends small results over NATS; C{None}: every result is posted.
    """

    pipeline: Pipeline
    link: GatewayLink
    _clock: IReactorTime
    max_request_bytes: int
    in_flight: BytesInFlight | None = None
    nats: NatsResults | None = None

    log = Logger()

    async def run(
        self,
        job: JobMessage,
        admitted: Callable[[], None] | None = None,
        claim_won: Callable[[], Deferred[bool]] | None = None,
    ) -> None:
        """
        Run C{job} and post its result; errors are logged, never raised.

        @param admitted: called once the job goes to the pool's seat line.
        @param claim_won: whether this node won the job's claim: asked
            before the job takes a seat, and before its answer is sent
            (a job this node did not win is never run, nor answered).
        """
        started = self._clock.seconds()
        held: list[int] = []
        budget = self.in_flight
        try:
            answer = await self.answer(job, admitted, held, claim_won)
            if answer.finish is not None:
                # The request's last event is logged on the loop's next
                # turn: after this turn has sent the result on its way
                # (its publish is written first), not in front of it.
                self._clock.callLater(0, answer.finish)
            if claim_won is not None and not await claim_won():
                return  # another node's (or cancelled): nothing to send
            answered = self._clock.seconds()
            if budget is not None and not isinstance(answer.body, bytes):
                # The result's buffers exist already: they count, whatever the cap.
                shared = shared_bytes(answer.body)
                budget.bytes_in_flight += shared
                held.append(shared)
            await self._post(job, answer, started, answered)
        finally:
            if budget is not None and held:
                budget.release_bytes(sum(held))

    async def _post(self, job: JobMessage, answer: Answer, started: float, answered: float) -> None:
        fields = {
            "job": job.job,
            "request_id": job.request_id,
            "status": answer.status,
            "bytes": answer.length,
            "answer_ms": round((answered - started) * 1000.0, 3),
        }
        via = "nats"
        try:
            code = None if self.nats is None else await self.nats.send(job, answer)
            if code is None:
                via = "http"
                code = await self.link.post_result(job, answer)
        except Exception as e:
            self.log.error(
                "job {job}: result not delivered: {error}",
                kcoral_event="join_result_lost",
                error=str(e),
                **fields,
            )
            return
        timing = {
            "via": via,
            "gateway_status": code,
            "elapsed_ms": round((self._clock.seconds() - started) * 1000.0, 3),
            "post_ms": round((self._clock.seconds() - answered) * 1000.0, 3),
        }
        if 200 <= code < 300:
            self.log.info(
                "job {job} finished: {status}, result sent over {via} ({gateway_status})",
                kcoral_event="join_job_finished",
                **timing,
                **fields,
            )
        else:
            self.log.error(
                "job {job}: the gateway refused its result ({gateway_status})",
                kcoral_event="join_result_refused",
                **timing,
                **fields,
            )

    async def answer(
        self,
        job: JobMessage,
        admitted: Callable[[], None] | None = None,
        held: list[int] | None = None,
        claim_won: Callable[[], Deferred[bool]] | None = None,
    ) -> Answer:
        """
        What the node's pipeline answers C{job} (never fails).

        @param held: gets the bytes in flight the job's fetched blobs
            reserved, for the caller to release.
        @param claim_won: the pipeline's gate before the seat line.
        """
        program = job.program.encode("utf-8")

        async def fetch(missing: list[str]) -> Mapping[str, bytes | SharedBuffer]:
            return await self._fetch(job, len(program), missing, held)

        # The gateway's request id when it is one a client could send.
        request_id = choose_request_id([job.request_id.encode("utf-8")])
        return await self.pipeline.execute_program(
            request_id,
            program,
            pool_client(job.client),
            fetch=fetch,
            admitted=admitted,
            gate=claim_won,
            via="join",
            finish_later=True,
        )

    async def _fetch(
        self,
        job: JobMessage,
        program_bytes: int,
        missing: list[str],
        held: list[int] | None = None,
    ) -> dict[str, bytes | SharedBuffer]:
        """
        The blobs C{missing}, fetched side by side.

        @raise RequestError: a blob the job does not list, or one refused.
        @raise RequestTooLarge: more bytes than the node takes in a request.
        @raise PoolBusy: they do not fit in the bytes in flight.
        """
        manifest = {blob.sha256: blob for blob in job.blobs}
        unlisted = [digest for digest in missing if digest not in manifest]
        if unlisted:
            raise RequestError(
                "engine",
                f"the job lacks blob {unlisted[0]} that its program references",
                "server_error",
                error_kind="join_blob_unlisted",
            )
        size = sum(manifest[d].size for d in missing)
        if program_bytes + size > self.max_request_bytes:
            raise RequestTooLarge()
        if self.in_flight is not None:
            if not self.in_flight.reserve_bytes(size, 0):
                raise PoolBusy("server saturated")
            if held is not None:
                held.append(size)
            else:
                self.in_flight.release_bytes(size)
        try:
            fetched: list[bytes | SharedBuffer] = await gatherResults(
                [
                    Deferred.fromCoroutine(self.link.fetch_blob(job, manifest[digest]))
                    for digest in missing
                ],
                consumeErrors=True,
            )
        except FirstError as e:
            error = e.subFailure.value  # type: ignore[union-attr]
            if isinstance(error, BlobRefused):
                self.log.error(
                    "job {job}: blob {sha256} refused: {reason}; the program does not run",
                    kcoral_event="join_blob_refused",
                    job=job.job,
                    request_id=job.request_id,
                    sha256=error.sha256,
                    reason=error.reason,
                )
                message = f"blob {error.sha256} from the gateway refused: {error.reason}"
            else:
                message = f"blob fetch failed: {type(error).__name__}: {error}"
            raise RequestError(
                "engine", message[:500], "server_error", error_kind="join_blob_fetch"
            ) from None
        return dict(zip(missing, fetched, strict=True))
